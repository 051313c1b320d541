"""Make the transformer export corpus: random-weight BERT, GPT-2, ViT and Llama-style models,
each exported by both torch exporters (TorchScript-based "legacy" and "dynamo"), opset 18.

    python tests/data/make_transformers.py                              # tiny, into tests/data/transformers/
    python tests/data/make_transformers.py --size real --out bench/models/
    python tests/data/make_transformers.py --size deep --out bench/models/deep/ --models gpt2,llama

Needs torch and transformers only when run; the tests read the files it wrote and never import
torch. Models are built from Config objects with seeded random initialisation (nothing is
downloaded), so running it again gives the same weights; the exporters' output may still
change between torch versions.

Files, for NAME in bert, gpt2, vit, llama (a LlamaModel with grouped-query attention):
  NAME_legacy.onnx, NAME_dynamo.onnx    transformers' default attention (SDPA), opset 18
  NAME_legacy_eager.onnx, ..._eager     eager attention (explicit MatMul, Softmax, MatMul)
  bert/gpt2_legacy_opset14.onnx         opset 14, where LayerNorm is still decomposed (tiny only)
  bert/llama_legacy_fp16.onnx           float16, legacy exporter, eager attention (see export_fp16)
  gpt2/llama_EXPORTER_past.onnx         with a KV cache, as models for generation are exported: inputs
                                        input_ids, attention_mask and past_key_values.L.key/.value
                                        [batch, kv heads, past_sequence, head size]; outputs
                                        last_hidden_state and present.L.key/.value (see export_past)

Every model has dynamic batch and sequence dimensions (ViT: dynamic batch; its image size is
fixed by the position embeddings). Tiny files are single files; real-size files keep their
weights in one external data file beside the model (`NAME.onnx.data`). Each file passes
onnx.checker (full check) and runs once in onnxruntime with its optimizations disabled before
the script moves on.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
OPSET = 18
SEED = 0

SIZES = {
    "tiny": {
        "bert": {
            "vocab_size": 128,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
            "type_vocab_size": 2,
        },
        "gpt2": {"vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
        "vit": {
            "image_size": 32,
            "patch_size": 8,
            "num_channels": 3,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
        },
        "llama": {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        },
    },
    "real": {
        "bert": {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12},
        "gpt2": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
        "vit": {
            "image_size": 224,
            "patch_size": 16,
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
        },
        "llama": {
            "vocab_size": 32000,
            "hidden_size": 512,
            "intermediate_size": 1376,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
        },
    },
    # The layer count of the largest models (GPT-2 XL has 48 layers, Llama 70B 80) at a width that
    # keeps the files small: how fuser's time grows with depth (bench/scale.py --real).
    "deep": {
        "bert": {
            "vocab_size": 1000,
            "hidden_size": 64,
            "num_hidden_layers": 96,
            "num_attention_heads": 4,
            "intermediate_size": 128,
        },
        "gpt2": {"vocab_size": 1000, "n_embd": 64, "n_layer": 96, "n_head": 4, "n_positions": 256},
        "vit": {
            "image_size": 64,
            "patch_size": 8,
            "hidden_size": 64,
            "num_hidden_layers": 96,
            "num_attention_heads": 4,
            "intermediate_size": 128,
        },
        "llama": {
            "vocab_size": 1000,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 80,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
        },
    },
}

# Dimensions used for the example inputs the exporters trace with; dynamic dims are exported symbolic.
EXAMPLE_BATCH, EXAMPLE_SEQ, EXAMPLE_PAST = 2, 8, 5
PAST_MODELS = ("gpt2", "llama")
FP16_MODELS = ("bert", "llama")
# At opset 17+ both exporters write LayerNormalization; an older opset shows the decomposed form
# (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add) that older exports carry.
OLD_OPSET, OLD_OPSET_MODELS = 14, ("bert", "gpt2")


def build(kind: str, size: str, attention: str = "sdpa"):
    """A seeded random-weight model; `attention` is transformers' attn_implementation ("sdpa", its
    default, or "eager", the explicit matmul-softmax-matmul code)."""
    import torch
    import transformers as tf

    torch.manual_seed(SEED)
    params = dict(SIZES[size][kind])
    common = {"attn_implementation": attention}
    if kind == "bert":
        config = tf.BertConfig(**params, **common)
        model = tf.BertModel(config, add_pooling_layer=False)
    elif kind == "gpt2":
        last = params["vocab_size"] - 1
        config = tf.GPT2Config(**params, bos_token_id=last, eos_token_id=last, use_cache=False, **common)
        model = tf.GPT2Model(config)
    elif kind == "vit":
        config = tf.ViTConfig(**params, **common)
        model = tf.ViTModel(config, add_pooling_layer=False)
    else:
        config = tf.LlamaConfig(**params, use_cache=False, **common)
        model = tf.LlamaModel(config)
    randomize(model)
    model.eval()
    return model, config


def randomize(model) -> None:
    """transformers initialises every bias and LayerNorm shift to 0 and every norm scale to 1,
    which would let a fusion that drops or misplaces them pass its numerics check; give every
    parameter seeded random values instead (norm scales near 1, the rest small)."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for module in model.modules():
            is_norm = "Norm" in type(module).__name__
            for name, parameter in module.named_parameters(recurse=False):
                noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
                parameter.copy_(1 + 0.1 * noise if is_norm and name == "weight" else 0.05 * noise)


def example_inputs(kind: str, config):
    """Example inputs (as a dict of keyword arguments) and the dynamic axes of each."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    batch, seq = EXAMPLE_BATCH, EXAMPLE_SEQ
    if kind == "vit":
        image = torch.randn(batch, config.num_channels, config.image_size, config.image_size, generator=generator)
        return {"pixel_values": image}, {"pixel_values": {0: "batch"}}
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.int64)}
    if kind == "bert":
        inputs["token_type_ids"] = torch.randint(0, 2, (batch, seq), generator=generator)
    return inputs, {name: {0: "batch", 1: "sequence"} for name in inputs}


class Positional:
    """Front ends with named positional arguments, returning the last hidden state only (a plain tensor output)."""

    @staticmethod
    def make(model, kind):
        import torch

        class Encoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, token_type_ids):
                return self.model(
                    input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=False
                )[0]

        class Decoder(Encoder):
            def forward(self, input_ids, attention_mask):
                return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]

        class Vision(Encoder):
            def forward(self, pixel_values):
                return self.model(pixel_values=pixel_values, return_dict=False)[0]

        front = {"bert": Encoder, "vit": Vision}.get(kind, Decoder)
        return front().eval()


class WithPast:
    """The decoder with a KV cache given and returned as flat tensors, as exports for generation
    have it: (input_ids, attention_mask, past key 0, past value 0, key 1, ...) -> (last hidden
    state, present key 0, present value 0, ...); the mask spans the past and the new tokens."""

    @staticmethod
    def make(model, layers: int):
        import torch
        from transformers import DynamicCache

        class Decoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, *past):
                cache = DynamicCache()
                for layer in range(layers):
                    cache.update(past[2 * layer], past[2 * layer + 1], layer)
                out = self.model(
                    input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True
                )
                present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
                return (out.last_hidden_state, *present)

        return Decoder().eval()

    @staticmethod
    def shape(config) -> tuple[int, int, int]:
        """Layers, key/value heads and head size."""
        if hasattr(config, "n_layer"):
            return config.n_layer, config.n_head, config.n_embd // config.n_head
        heads = config.num_attention_heads
        return config.num_hidden_layers, config.num_key_value_heads or heads, config.hidden_size // heads

    @staticmethod
    def inputs(config, batch=EXAMPLE_BATCH, seq=EXAMPLE_SEQ, past=EXAMPLE_PAST) -> dict:
        import torch

        layers, kv_heads, head = WithPast.shape(config)
        generator = torch.Generator().manual_seed(SEED)
        inputs = {
            "input_ids": torch.randint(0, config.vocab_size, (batch, seq), generator=generator),
            "attention_mask": torch.ones(batch, past + seq, dtype=torch.int64),
        }
        for layer in range(layers):
            for part in ("key", "value"):
                inputs[f"past_key_values.{layer}.{part}"] = torch.randn(
                    batch, kv_heads, past, head, generator=generator
                )
        return inputs


def export_past(model, config, exporter: str, path: str, external: bool) -> None:
    """A KV-cache export. The legacy one names the mask's length `past_sequence + sequence`;
    the dynamo one is asked for a dynamic dim there (torch.export.Dim.DYNAMIC), which it names
    with a symbol of its own, as it does for anyone who does not spell the sum out."""
    import torch

    layers = WithPast.shape(config)[0]
    inputs = WithPast.inputs(config)
    names = list(inputs)
    past_names = names[2:]
    outputs = ["last_hidden_state"] + [name.replace("past_key_values", "present") for name in past_names]
    module = WithPast.make(model, layers)
    args = tuple(inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "past_sequence + sequence"},
                "last_hidden_state": {0: "batch", 1: "sequence"},
                **{name: {0: "batch", 2: "past_sequence"} for name in past_names},
                **{name: {0: "batch", 2: "past_sequence + sequence"} for name in outputs[1:]},
            }
            legacy_export(module, args, path, names, outputs, axes, OPSET)
        else:
            batch = torch.export.Dim("batch", min=1, max=64)
            sequence = torch.export.Dim("sequence", min=1, max=256)
            past = torch.export.Dim("past_sequence", min=1, max=256)
            shapes = (
                {0: batch, 1: sequence},
                {0: batch, 1: torch.export.Dim.DYNAMIC},
                tuple({0: batch, 2: past} for _ in past_names),
            )
            dynamo_export(module, args, path, names, outputs, shapes, OPSET)
    normalize(path, external)


def export(kind: str, model, config, exporter: str, path: str, external: bool, dtype=None, opset=OPSET) -> None:
    import torch

    inputs, axes = example_inputs(kind, config)
    if dtype is not None:
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    names = list(inputs)
    module = Positional.make(model, kind)
    args = tuple(inputs.values())
    if exporter == "legacy":
        dynamic_axes = dict(axes)
        dynamic_axes["last_hidden_state"] = {0: "batch"} if kind == "vit" else {0: "batch", 1: "sequence"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            legacy_export(module, args, path, names, ["last_hidden_state"], dynamic_axes, opset)
    else:
        batch = torch.export.Dim("batch", min=1, max=1024)
        sequence = torch.export.Dim("sequence", min=2, max=1024 if kind != "gpt2" else config.n_positions)
        dims = {0: batch} if kind == "vit" else {0: batch, 1: sequence}
        dynamic_shapes = {name: dims for name in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dynamo_export(module, args, path, names, ["last_hidden_state"], dynamic_shapes, opset)
    normalize(path, external)


def legacy_export(module, args, path: str, names: list, outputs: list, dynamic_axes: dict, opset: int) -> None:
    """torch.onnx.export with the TorchScript-based exporter (dynamo=False), constants folded."""
    import torch

    torch.onnx.export(
        module,
        args,
        path,
        input_names=names,
        output_names=outputs,
        dynamic_axes=dynamic_axes,
        opset_version=opset,
        dynamo=False,
        do_constant_folding=True,
    )


def dynamo_export(module, args, path: str, names: list, outputs: list, dynamic_shapes, opset: int) -> None:
    """torch.onnx.export with dynamo=True, saved as one file (normalize() then lays it out)."""
    import torch

    program = torch.onnx.export(
        module,
        args,
        input_names=names,
        output_names=outputs,
        dynamic_shapes=dynamic_shapes,
        opset_version=opset,
        dynamo=True,
        external_data=False,
        verbose=False,
    )
    program.save(path, external_data=False)


def normalize(path: str, external: bool) -> None:
    """Save as one file (tiny) or with all weights in one external file beside it (real size).
    The dynamo exporter's per-node metadata (source stack traces with this machine's paths) is
    dropped so that regeneration is reproducible; it does not change the graph."""
    import onnx

    model = onnx.load(path)
    for node in model.graph.node:
        del node.metadata_props[:]
    data_name = os.path.basename(path) + ".data"
    for stale in (os.path.join(os.path.dirname(path), data_name),):
        if os.path.exists(stale):
            os.remove(stale)
    if external:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data_name)
    else:
        onnx.save(model, path)


def cast_to_fp16(source: str, path: str, external: bool) -> None:
    """The documented fallback: every float32 initializer, Constant value, Cast-to-float and graph
    input/output becomes float16; the graph's arithmetic is otherwise untouched."""
    import numpy as np
    import onnx
    from onnx import TensorProto, numpy_helper

    model = onnx.load(source)
    graph = model.graph

    def cast_tensor(tensor):
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))

    for init in graph.initializer:
        cast_tensor(init)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                cast_tensor(attr.t)
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.FLOAT16
    for value in list(graph.input) + list(graph.output):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    del graph.value_info[:]
    onnx.save(model, path)
    normalize(path, external)


def verify(path: str, kind: str, config) -> None:
    """onnx.checker plus one onnxruntime run with its graph optimizations disabled."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    onnx.checker.check_model(path, full_check=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    past = path.endswith("_past.onnx")
    inputs = WithPast.inputs(config) if past else example_inputs(kind, config)[0]
    feeds = {}
    for spec in session.get_inputs():
        value = inputs[spec.name].numpy()
        feeds[spec.name] = value.astype(np.float16) if spec.type == "tensor(float16)" else value
    outputs = session.run(None, feeds)
    if len(outputs) != (1 + 2 * WithPast.shape(config)[0] if past else 1):
        raise SystemExit(f"{path}: {len(outputs)} outputs")
    if not all(np.isfinite(output).all() for output in outputs):
        raise SystemExit(f"{path}: non-finite output")


def export_fp16(kind: str, size: str, path: str, external: bool) -> None:
    """The legacy exporter on the float16 model, with eager attention: its SDPA symbolic upcasts
    inside attention and leaves float32 behind (an invalid graph for BERT, float32 weights and a
    float32 residual stream for Llama). If the export fails, the documented cast of the float32
    (SDPA) export instead."""
    import torch

    model, config = build(kind, size, "eager")
    try:
        export(kind, model.half(), config, "legacy", path, external, dtype=torch.float16)
        verify(path, kind, config)
    except Exception as error:  # noqa: BLE001 - any exporter or runtime failure means: fall back
        print(f"{kind}: float16 legacy export failed ({type(error).__name__}: {error}); casting the float32 export")
        cast_to_fp16(path.replace("_fp16.onnx", ".onnx"), path, external)
    finish(path, kind, config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", default=None, help="output folder (default tests/data/transformers for tiny)")
    parser.add_argument("--models", default="bert,gpt2,vit,llama")
    parser.add_argument("--exporters", default="legacy,dynamo")
    parser.add_argument(
        "--past",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also export gpt2 and llama with a KV cache (*_past); default: for --size tiny only",
    )
    parser.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also export the *_eager variants (eager attention code); default: for --size tiny only",
    )
    args = parser.parse_args(argv)
    if args.out is None and args.size != "tiny":
        parser.error(f"--out is required for --size {args.size}")
    out = args.out or os.path.join(HERE, "transformers")
    os.makedirs(out, exist_ok=True)
    external = args.size != "tiny"
    if args.eager is None:
        args.eager = args.size == "tiny"
    if args.past is None:
        args.past = args.size == "tiny"

    exporters = args.exporters.split(",")
    for kind in args.models.split(","):
        for attention, suffix in (("sdpa", ""), ("eager", "_eager")):
            if attention == "eager" and not args.eager:
                continue
            model, config = build(kind, args.size, attention)
            for exporter in exporters:
                path = os.path.join(out, f"{kind}_{exporter}{suffix}.onnx")
                export(kind, model, config, exporter, path, external)
                finish(path, kind, config)
        model, config = build(kind, args.size)
        if kind in OLD_OPSET_MODELS and "legacy" in exporters and args.size == "tiny":
            path = os.path.join(out, f"{kind}_legacy_opset{OLD_OPSET}.onnx")
            export(kind, model, config, "legacy", path, external, opset=OLD_OPSET)
            finish(path, kind, config)
        if kind in FP16_MODELS and "legacy" in exporters:
            export_fp16(kind, args.size, os.path.join(out, f"{kind}_legacy_fp16.onnx"), external)
        if kind in PAST_MODELS and args.past:
            for exporter in exporters:
                path = os.path.join(out, f"{kind}_{exporter}_past.onnx")
                export_past(model, config, exporter, path, external)
                finish(path, kind, config)
    return 0


def finish(path: str, kind: str, config) -> None:
    verify(path, kind, config)
    report(path)


def report(path: str) -> None:
    import onnx

    model = onnx.load(path, load_external_data=False)
    size = os.path.getsize(path) + sum(
        os.path.getsize(os.path.join(os.path.dirname(path), f))
        for f in os.listdir(os.path.dirname(path))
        if f == os.path.basename(path) + ".data"
    )
    print(f"{path}: {len(model.graph.node)} nodes, {size / 1e6:.2f} MB")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
