"""Hugging Face architectures through both torch exporters: does the check pass, what is left unfused, is the output faster.

    python bench/architectures.py make [--dir bench/architectures] [--models bert,t5] [--jobs 2]
    python bench/architectures.py [--dir bench/architectures] [--models ...] [--seconds 2] [--threads 2]

`make` needs torch and transformers (nothing is downloaded from a model hub). It builds 27
architectures from tiny configs (hidden size 64, 2 layers, 4 heads, a 1,000-token vocabulary,
images of 32 or 64 pixels), gives every parameter seeded random values
(tests/data/make_transformers.randomize: norm scales near 1, biases and shifts not zero, so
that a fusion dropping one fails its check), and exports each with torch's TorchScript-based
exporter (`_legacy`, opset 17) and its dynamo exporter (`_dynamo`, opset 18), dynamic batch and
sequence where the exporter takes them. Each export runs in its own process (an exporter can
crash or hang on one architecture without stopping the rest) and is kept only if onnxruntime
reproduces torch's outputs; its inputs are saved beside it as a .npz.

    encoders          bert, bert_sdpa, distilbert, roberta, albert, electra, deberta_v2, mpnet
    encoder-decoders  t5, bart, whisper
    decoders          qwen2, qwen2_sdpa, mistral, phi3, gemma, gpt_neo, gptj, opt, falcon, bloom
    vision            mobilevit, swin, convnext, deit, segformer, clip_vision

`*_sdpa` use transformers' scaled-dot-product attention; the others its eager attention
(MatMul, Softmax, MatMul written out).

The table, per model: nodes of the original and of fuser's `--target onnx` and
`--target onnxruntime` outputs; the decomposed patterns left in the onnxruntime output
(bench/patterns_left.py: l LayerNorm, r RMSNorm, g GELU, s SiLU, a attention, p rotary); the
numerics check of both outputs on the saved inputs; and median latency ratios against the
original at ORT_ENABLE_ALL (onnxruntime CPU, every model timed interleaved in one loop) on
inputs of batch 2 and, for text, `--sequence` tokens (96 by default: at the exports' 16 the
models run in about 0.3 ms, mostly onnxruntime's per-node overhead).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Run as a script, this folder comes first on the path, and bench/transformers.py would stand in
# for the transformers package that `make` exports with.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, ROOT)

import fuser
from bench.patterns_left import patterns_left
from fuser.measure import interleaved_ms, session

BATCH, SEQUENCE, VOCAB, MAX_POSITIONS = 2, 16, 1000, 128
HIDDEN, LAYERS, HEADS, FFN = 64, 2, 4, 256
EXPORT_SECONDS = 300
# An export is kept when onnxruntime's outputs are within this of torch's, relative to the
# larger of 1 and the largest output (MobileViT's reach about 200 and differ by about 1e-4).
EXPORT_RTOL = 1e-5

ARCHITECTURES = [
    "bert", "bert_sdpa", "distilbert", "roberta", "albert", "electra", "deberta_v2", "mpnet",
    "t5", "bart", "whisper",
    "qwen2", "qwen2_sdpa", "mistral", "phi3", "gemma", "gpt_neo", "gptj", "opt", "falcon", "bloom",
    "mobilevit", "swin", "convnext", "deit", "segformer", "clip_vision",
]  # fmt: skip
EXPORTERS = ("legacy", "dynamo")


# ---------------------------------------------------------------------------- building


def _front_ends():
    """Modules taking the exported inputs positionally and returning a tuple of tensors."""
    import torch

    class Outputs(torch.nn.Module):
        def __init__(self, model, names: list[str], **fixed):
            super().__init__()
            self.model, self.names, self.fixed = model, names, fixed

        def pick(self, result):
            return tuple(result[name] for name in self.names)

    class Text(Outputs):
        def forward(self, input_ids, attention_mask):
            return self.pick(self.model(input_ids=input_ids, attention_mask=attention_mask, **self.fixed))

    class Seq2Seq(Outputs):
        def forward(self, input_ids, attention_mask, decoder_input_ids):
            return self.pick(
                self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    decoder_input_ids=decoder_input_ids,
                    use_cache=False,
                )
            )

    class Speech(Outputs):
        def forward(self, input_features, decoder_input_ids):
            # An explicit decoder mask keeps transformers from looking for packed sequences
            # (torch.diff), which the TorchScript-based exporter cannot export.
            return self.pick(
                self.model(
                    input_features=input_features,
                    decoder_input_ids=decoder_input_ids,
                    decoder_attention_mask=torch.ones_like(decoder_input_ids),
                    use_cache=False,
                )
            )

    class Vision(Outputs):
        def forward(self, pixel_values):
            return self.pick(self.model(pixel_values=pixel_values))

    return Text, Seq2Seq, Speech, Vision


def build(architecture: str):
    """(module, example inputs by name, output names, dynamic axes by name) for one architecture."""
    import torch
    import transformers as tf

    from tests.data.make_transformers import randomize

    Text, Seq2Seq, Speech, Vision = _front_ends()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1234)

    def tokens():
        return torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)

    text = {"input_ids": tokens(), "attention_mask": torch.ones(BATCH, SEQUENCE, dtype=torch.int64)}
    text_axes = {name: {0: "batch", 1: "sequence"} for name in text}
    attention = "sdpa" if architecture.endswith("_sdpa") else "eager"
    base = architecture.removesuffix("_sdpa")
    common = {"vocab_size": VOCAB, "attn_implementation": attention}
    sizes = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "intermediate_size": FFN,
        "max_position_embeddings": MAX_POSITIONS,
    }

    def ready(model):
        randomize(model)
        _batchnorm_statistics(model)
        return model.eval()

    def encoder(cls, config, outputs=("last_hidden_state", "pooler_output")):
        axes = {**text_axes, "last_hidden_state": {0: "batch", 1: "sequence"}, "pooler_output": {0: "batch"}}
        axes = {name: dims for name, dims in axes.items() if name in text or name in outputs}
        return Text(ready(cls(config)), list(outputs)), dict(text), list(outputs), axes

    def decoder(cls, config):
        config.use_cache = False
        module = Text(ready(cls(config)), ["logits"], use_cache=False)
        return module, dict(text), ["logits"], {**text_axes, "logits": {0: "batch", 1: "sequence"}}

    def vision(cls, config, size, outputs=("last_hidden_state", "pooler_output")):
        pixels = torch.randn(BATCH, 3, size, size, generator=generator)
        axes = {"pixel_values": {0: "batch"}, **{name: {0: "batch"} for name in outputs}}
        return Vision(ready(cls(config)), list(outputs)), {"pixel_values": pixels}, list(outputs), axes

    if base == "bert":
        return encoder(tf.BertModel, tf.BertConfig(**common, **sizes))
    if base == "distilbert":
        config = tf.DistilBertConfig(
            **common, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN, max_position_embeddings=MAX_POSITIONS
        )
        return encoder(tf.DistilBertModel, config, ("last_hidden_state",))
    if base == "roberta":
        return encoder(tf.RobertaModel, tf.RobertaConfig(**common, **sizes))
    if base == "albert":
        return encoder(tf.AlbertModel, tf.AlbertConfig(**common, embedding_size=32, **sizes))
    if base == "electra":
        return encoder(
            tf.ElectraModel, tf.ElectraConfig(**common, embedding_size=HIDDEN, **sizes), ("last_hidden_state",)
        )
    if base == "deberta_v2":
        config = tf.DebertaV2Config(
            **common,
            **sizes,
            relative_attention=True,
            position_buckets=32,
            pos_att_type=["p2c", "c2p"],
            max_relative_positions=-1,
            position_biased_input=False,
        )
        return encoder(tf.DebertaV2Model, config, ("last_hidden_state",))
    if base == "mpnet":
        return encoder(tf.MPNetModel, tf.MPNetConfig(**common, **sizes))

    encoder_decoder = {
        "d_model": HIDDEN,
        "encoder_layers": LAYERS,
        "decoder_layers": LAYERS,
        "encoder_attention_heads": HEADS,
        "decoder_attention_heads": HEADS,
        "encoder_ffn_dim": FFN,
        "decoder_ffn_dim": FFN,
    }
    if base in ("t5", "bart"):
        if base == "t5":
            config = tf.T5Config(
                **common,
                d_model=HIDDEN,
                d_kv=HIDDEN // HEADS,
                d_ff=FFN,
                num_layers=LAYERS,
                num_decoder_layers=LAYERS,
                num_heads=HEADS,
                relative_attention_num_buckets=32,
                use_cache=False,
            )
            model = tf.T5Model(config)
        else:
            config = tf.BartConfig(
                **common,
                **encoder_decoder,
                max_position_embeddings=MAX_POSITIONS,
                use_cache=False,
            )
            model = tf.BartModel(config)
        outputs = ["last_hidden_state", "encoder_last_hidden_state"]
        axes = {
            **text_axes,
            "decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
            "last_hidden_state": {0: "batch", 1: "decoder_sequence"},
            "encoder_last_hidden_state": {0: "batch", 1: "sequence"},
        }
        return Seq2Seq(ready(model), outputs), {**text, "decoder_input_ids": tokens()}, outputs, axes

    if base == "whisper":
        mel_bins, source_positions = 16, 64  # the encoder takes exactly 2 * source_positions frames
        config = tf.WhisperConfig(
            **common,
            num_mel_bins=mel_bins,
            **encoder_decoder,
            max_source_positions=source_positions,
            max_target_positions=MAX_POSITIONS,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            use_cache=False,
        )
        features = torch.randn(BATCH, mel_bins, 2 * source_positions, generator=generator)
        outputs = ["last_hidden_state", "encoder_last_hidden_state"]
        axes = {
            "input_features": {0: "batch"},
            "decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
            "last_hidden_state": {0: "batch", 1: "decoder_sequence"},
            "encoder_last_hidden_state": {0: "batch"},
        }
        inputs = {"input_features": features, "decoder_input_ids": tokens()}
        return Speech(ready(tf.WhisperModel(config)), outputs), inputs, outputs, axes

    causal = {**common, **sizes, "use_cache": False}
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if base == "qwen2":
        return decoder(tf.Qwen2ForCausalLM, tf.Qwen2Config(**causal, num_key_value_heads=2))
    if base == "mistral":
        return decoder(
            tf.MistralForCausalLM, tf.MistralConfig(**causal, num_key_value_heads=2, head_dim=HIDDEN // HEADS)
        )
    if base == "phi3":
        config = tf.Phi3Config(**causal, **ids, num_key_value_heads=2, original_max_position_embeddings=MAX_POSITIONS)
        return decoder(tf.Phi3ForCausalLM, config)
    if base == "gemma":
        config = tf.GemmaConfig(**causal, **ids, num_key_value_heads=2, head_dim=HIDDEN // HEADS)
        return decoder(tf.GemmaForCausalLM, config)
    named = {**common, "use_cache": False, "bos_token_id": 1, "eos_token_id": 2}
    if base == "gpt_neo":
        config = tf.GPTNeoConfig(
            **named,
            hidden_size=HIDDEN,
            num_layers=LAYERS,
            num_heads=HEADS,
            intermediate_size=FFN,
            max_position_embeddings=MAX_POSITIONS,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
        )
        return decoder(tf.GPTNeoForCausalLM, config)
    if base == "gptj":
        config = tf.GPTJConfig(
            **named, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN, n_positions=MAX_POSITIONS,
            rotary_dim=HIDDEN // HEADS,
        )  # fmt: skip
        return decoder(tf.GPTJForCausalLM, config)
    if base == "opt":
        config = tf.OPTConfig(
            **named, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=FFN,
            max_position_embeddings=MAX_POSITIONS, word_embed_proj_dim=HIDDEN,
        )  # fmt: skip
        return decoder(tf.OPTForCausalLM, config)
    if base == "falcon":
        config = tf.FalconConfig(
            **named, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            ffn_hidden_size=FFN, max_position_embeddings=MAX_POSITIONS,
        )  # fmt: skip
        return decoder(tf.FalconForCausalLM, config)
    if base == "bloom":
        config = tf.BloomConfig(**named, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, pad_token_id=3)
        return decoder(tf.BloomForCausalLM, config)

    attention_only = {"attn_implementation": attention}
    if base == "mobilevit":
        config = tf.MobileViTConfig(
            **attention_only, image_size=64, patch_size=2, hidden_sizes=[32, 48, 64],
            neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 160], num_attention_heads=HEADS, mlp_ratio=2.0, expand_ratio=2.0,
        )  # fmt: skip
        return vision(tf.MobileViTModel, config, 64)
    if base == "swin":
        config = tf.SwinConfig(
            **attention_only, image_size=32, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
            window_size=4, mlp_ratio=2.0,
        )  # fmt: skip
        return vision(tf.SwinModel, config, 32)
    if base == "convnext":
        config = tf.ConvNextConfig(
            image_size=64, patch_size=4, num_stages=4, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1]
        )
        return vision(tf.ConvNextModel, config, 64)
    if base == "deit":
        config = tf.DeiTConfig(
            **attention_only, image_size=32, patch_size=4, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=FFN,
        )  # fmt: skip
        return vision(tf.DeiTModel, config, 32)
    if base == "segformer":
        config = tf.SegformerConfig(
            **attention_only, image_size=64, num_encoder_blocks=4, depths=[1, 1, 1, 1], sr_ratios=[8, 4, 2, 1],
            hidden_sizes=[16, 32, 64, 128], num_attention_heads=[1, 2, 4, 4], mlp_ratios=[2, 2, 2, 2],
            decoder_hidden_size=64,
        )  # fmt: skip
        return vision(tf.SegformerModel, config, 64, ("last_hidden_state",))
    if base == "clip_vision":
        config = tf.CLIPVisionConfig(
            **attention_only, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, image_size=32, patch_size=4,
        )  # fmt: skip
        return vision(tf.CLIPVisionModel, config, 32)
    raise SystemExit(f"unknown architecture '{architecture}'; known: {', '.join(ARCHITECTURES)}")


def _batchnorm_statistics(model) -> None:
    """Running statistics away from 0 and 1, and convolutions scaled for their fan-in, in models
    with BatchNorm: at transformers' initialisation a deep convnet (MobileViT) computes zeros,
    and a Conv + BatchNorm fold would have nothing to get wrong."""
    import torch

    batchnorms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not batchnorms:
        return
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for norm in batchnorms:
            norm.running_mean.copy_(torch.randn(norm.num_features, generator=generator) * 0.1)
            norm.running_var.copy_(torch.rand(norm.num_features, generator=generator) + 0.5)
        for conv in (m for m in model.modules() if isinstance(m, torch.nn.Conv2d)):
            fan_in = conv.weight[0].numel()
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * (2.0 / fan_in) ** 0.5)


# ---------------------------------------------------------------------------- exporting


def export(architecture: str, exporter: str, folder: str) -> str:
    """Export one model (in this process) and check it in onnxruntime against torch; returns a
    summary line."""
    import torch

    torch.set_num_threads(1)
    module, inputs, outputs, axes = build(architecture)
    module.eval()  # the legacy exporter restores the front end's training flag afterwards
    names = list(inputs)
    arguments = tuple(inputs[name] for name in names)
    with torch.no_grad():  # before exporting: the legacy exporter can leave a model changed
        expected = [t.detach().float().numpy() for t in module(*arguments)]
    path = os.path.join(folder, f"{architecture}_{exporter}.onnx")
    with torch.no_grad():
        if exporter == "legacy":
            torch.onnx.export(
                module, arguments, path, dynamo=False, opset_version=17, input_names=names,
                output_names=outputs, dynamic_axes=axes, do_constant_folding=True,
            )  # fmt: skip
            shapes = "dynamic"
        else:
            shapes = _dynamo_export(module, arguments, names, outputs, axes, path)
    model = onnx.load(path)
    onnx.checker.check_model(model)
    graph_inputs = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    feeds = {name: inputs[name].numpy() for name in names if name in graph_inputs}
    import onnxruntime as ort

    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    worst = max(float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b))))) for a, b in zip(got, expected))
    if len(got) != len(expected) or worst > EXPORT_RTOL:
        os.remove(path)
        raise SystemExit(f"onnxruntime differs from torch by {worst:.2g} (relative to the largest output)")
    np.savez(os.path.join(folder, f"{architecture}_{exporter}.npz"), **feeds)
    return f"{len(model.graph.node)} nodes, {shapes} shapes, {worst:.1e} from torch"


def _dynamo_export(module, arguments, names, outputs, axes, path) -> str:
    """Dynamic dimensions named after `axes`, else left to torch (Dim.AUTO), else fixed."""
    import torch
    from torch.export import Dim

    dims: dict[str, Dim] = {}

    def dim(label: str) -> Dim:
        return dims.setdefault(label, Dim(label, min=1, max=64 if label == "batch" else MAX_POSITIONS))

    named = tuple({axis: dim(label) for axis, label in axes.get(n, {}).items()} or None for n in names)
    automatic = tuple({axis: Dim.AUTO for axis in axes.get(n, {})} or None for n in names)
    failures = []
    for label, dynamic in (("dynamic", named), ("automatic", automatic), ("static", None)):
        try:
            program = torch.onnx.export(
                module, arguments, dynamo=True, opset_version=18, input_names=names, output_names=outputs,
                dynamic_shapes=dynamic,
            )  # fmt: skip
            program.save(path, external_data=False)
            return label
        except Exception as error:  # noqa: BLE001 - the next, less dynamic form is tried
            failures.append(f"{label}: {type(error).__name__}: {str(error).strip()[:200]}")
    raise SystemExit("; ".join(failures))


def make(folder: str, architectures: list[str], jobs: int) -> int:
    os.makedirs(folder, exist_ok=True)

    def one(pair):
        architecture, exporter = pair
        started = time.perf_counter()
        command = [sys.executable, os.path.abspath(__file__), "export", architecture, exporter, "--dir", folder]
        try:
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=EXPORT_SECONDS)
            last = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()[-1]
            result = ("ok  " if done.returncode == 0 else "FAIL") + f"  {last[:160]}"
        except subprocess.TimeoutExpired:
            result = f"FAIL  no export after {EXPORT_SECONDS} s"
        line = f"{architecture + '_' + exporter:<22}{time.perf_counter() - started:>6.1f}s  {result}"
        print(line, flush=True)
        return line.split()[2] == "ok"

    pairs = [(a, e) for a in architectures for e in EXPORTERS]
    with ThreadPoolExecutor(jobs) as pool:
        made = sum(pool.map(one, pairs))
    print(f"{made} of {len(pairs)} exports in {folder}")
    return 0 if made == len(pairs) else 1


# ---------------------------------------------------------------------------- table


TOKENS = ("input_ids", "decoder_input_ids", "attention_mask")


def timing_feeds(model: onnx.ModelProto, feeds: dict[str, np.ndarray], sequence: int) -> dict[str, np.ndarray]:
    """The saved inputs with every token input of a symbolic length `sequence` long (ids drawn
    anew, a mask of ones)."""
    symbolic = {
        i.name
        for i in model.graph.input
        if len(i.type.tensor_type.shape.dim) == 2 and i.type.tensor_type.shape.dim[1].dim_param
    }
    generator = np.random.default_rng(0)
    timed = dict(feeds)
    for name in TOKENS:
        if name in feeds and name in symbolic:
            batch = feeds[name].shape[0]
            ones = name == "attention_mask"
            timed[name] = (
                np.ones((batch, sequence), np.int64) if ones else generator.integers(0, VOCAB, (batch, sequence))
            )
    return timed


def row(name: str, path: str, seconds: float, threads: int, sequence: int) -> str:
    original = onnx.load(path)
    with np.load(os.path.splitext(path)[0] + ".npz") as saved:
        feeds = {key: saved[key] for key in saved.files}
    started = time.perf_counter()
    results, failures = {}, []
    for target in ("onnx", "onnxruntime"):
        try:
            results[target], _ = fuser.optimize(original, target=target, inputs=feeds)
        except fuser.FuserError as error:
            failures.append(f"{target}: {str(error).splitlines()[0][:80]}")
            results[target] = None
    fuser_seconds = (time.perf_counter() - started) / 2
    left = patterns_left(results["onnxruntime"]) if results["onnxruntime"] is not None else {}
    letters = "".join(f"{key[0] if key != 'rotary' else 'p'}{count}" for key, count in left.items() if count) or "-"
    nodes = [len(m.graph.node) if m is not None else "-" for m in (original, results["onnx"], results["onnxruntime"])]
    timed = [m for m in (results["onnx"], results["onnxruntime"]) if m is not None]
    sessions = [session(m, "all", threads) for m in (original, *timed)]
    samples = interleaved_ms(sessions, timing_feeds(original, feeds, sequence), seconds=seconds)
    ratios = [statistics.median(a / b for a, b in zip(s, samples[0])) for s in samples[1:]]
    cells = iter(ratios)
    ratio_cells = "".join(f"{next(cells):>9.2f}x" if m is not None else f"{'-':>10}" for m in results.values())
    return (
        f"{name:<24}" + "".join(f"{n:>7}" for n in nodes) + f"  {letters:<10}{fuser_seconds:>6.1f}s"
        f"{statistics.median(samples[0]):>9.2f}{ratio_cells}  "
        + ("ok" if not failures else "FAILED " + "; ".join(failures))
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", choices=["make", "table", "export"], default="table")
    parser.add_argument("names", nargs="*", help=argparse.SUPPRESS)  # export ARCHITECTURE EXPORTER
    parser.add_argument("--dir", default=os.path.join(HERE, "architectures"))
    parser.add_argument("--models", default="", help="architectures (make) or models (table), comma-separated")
    parser.add_argument("--jobs", type=int, default=2, help="exports at once (make)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing budget per model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=96, help="tokens per text input when timing")
    args = parser.parse_args(argv)
    chosen = [m for m in args.models.split(",") if m]
    if args.action == "export":
        print(export(*args.names, args.dir))
        return 0
    if args.action == "make":
        return make(args.dir, chosen or ARCHITECTURES, args.jobs)
    models = chosen or [f"{a}_{e}" for a in ARCHITECTURES for e in EXPORTERS]
    header = (
        f"{'model':<24}{'orig':>7}{'onnx':>7}{'ort':>7}  {'left':<10}{'fuser':>7}{'orig ms':>9}"
        f"{'onnx/all':>10}{'ort/all':>10}  check"
    )
    print(header)
    print("-" * len(header))
    for name in models:
        path = os.path.join(args.dir, f"{name}.onnx")
        if not os.path.exists(path):
            print(f"{name:<24}missing: run `python bench/architectures.py make` first")
            continue
        print(row(name, path, args.seconds, args.threads, args.sequence), flush=True)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
