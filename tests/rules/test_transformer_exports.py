"""The transformer rules on real exports: tiny BERT, GPT-2, ViT and Llama models written by
torch.onnx (legacy TorchScript exporter and dynamo; eager-attention, opset-14 and float16
variants), in tests/data/transformers.

Each file is optimized with every built-in rule for the onnxruntime target, with fuser's own
check fed realistic inputs: input_ids in [0, vocab) with the vocabulary size read from the
embedding table the ids index, token_type_ids in [0, 2), an attention_mask of ones, normal
pixel_values, and for the exports with a KV cache (*_past) 5 cached tokens of normal keys and
values, which the mask then spans too; batch 2, sequence 7. The check compares every output in onnxruntime (graph
optimizations off) with fuser's per-dtype tolerances (float32 rtol 1e-4, atol 1e-5; float16
rtol 1e-2, atol 1e-3). Then, per file:
  - every Erf/Tanh of the original became a GELU op (Gelu, FastGelu or BiasGelu), none is left;
  - no ReduceMean is left: every written-out layer/RMS norm was fused;
  - no Sigmoid feeds a Mul that also reads the Sigmoid's input (SiLU fused);
  - no Softmax is left: every attention became MultiHeadAttention (legacy Llama included, whose
    rotary embeddings hide from shape inference what the heads-merging Reshape gives);
  - no Neg is left in Llama: every rotate_half became com.microsoft RotaryEmbedding;
  - no norm is followed by a Mul with a constant where the original norm's weight could fold;
  - no Cast feeds a norm: the float32 norms of float16 Llama read the float16 data themselves
    (the Cast back to float16 after them stays, see rules/norm_cast_fold.py).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import onnx
import pytest

import fuser

DATA = Path(__file__).resolve().parents[1] / "data" / "transformers"
FILES = sorted(DATA.glob("*.onnx")) if DATA.is_dir() else []
GELU_OPS = {"Gelu", "FastGelu", "BiasGelu"}
BATCH, SEQUENCE, PAST = 2, 7, 5


def vocabulary_size(model: onnx.ModelProto) -> int:
    """Rows of the embedding table(s) input_ids index, following the ids through reshapes and
    casts (not through Shape, which reads only their size)."""
    tables = {t.name: t for t in model.graph.initializer}
    consumers = defaultdict(list)
    for node in model.graph.node:
        for slot, name in enumerate(node.input):
            consumers[name].append((node, slot))
    sizes, pending, seen = [], ["input_ids"], set()
    while pending:
        for node, slot in consumers[pending.pop()]:
            if node.op_type == "Gather" and slot == 1 and node.input[0] in tables:
                sizes.append(tables[node.input[0]].dims[0])
            elif node.op_type != "Shape":
                fresh = [o for o in node.output if o not in seen]
                seen.update(fresh)
                pending.extend(fresh)
    assert sizes, "no embedding table is indexed by input_ids"
    return min(sizes)


def realistic_inputs(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    cached = any(graph_input.name.startswith("past_key_values") for graph_input in model.graph.input)
    feeds = {}
    for graph_input in model.graph.input:
        name, elem_type = graph_input.name, graph_input.type.tensor_type.elem_type
        if name.startswith("past_key_values"):
            heads, size = (d.dim_value for d in graph_input.type.tensor_type.shape.dim[1::2])
            feeds[name] = rng.standard_normal((BATCH, heads, PAST, size)).astype(np.float32)
        elif name == "input_ids":
            feeds[name] = rng.integers(0, vocabulary_size(model), (BATCH, SEQUENCE)).astype(np.int64)
        elif name == "token_type_ids":
            feeds[name] = rng.integers(0, 2, (BATCH, SEQUENCE)).astype(np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((BATCH, PAST + SEQUENCE if cached else SEQUENCE), np.int64)
        elif name == "pixel_values":
            dims = [d.dim_value for d in graph_input.type.tensor_type.shape.dim[1:]]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
            feeds[name] = rng.standard_normal((BATCH, *dims)).astype(dtype)
        else:
            raise AssertionError(f"no realistic input known for '{name}'")
    return feeds


def sigmoid_times_input(model: onnx.ModelProto) -> list[str]:
    """Mul nodes reading Sigmoid(t) and t: written-out SiLUs."""
    sigmoid_of = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Sigmoid"}
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "Mul" and any(sigmoid_of.get(a) == b for a, b in (n.input, n.input[::-1]))
    ]


def norms_followed_by_constant_mul(model: onnx.ModelProto) -> list[str]:
    constants = {t.name for t in model.graph.initializer}
    produced_by = {o: n for n in model.graph.node for o in n.output}
    found = []
    for node in model.graph.node:
        if node.op_type != "Mul" or not any(i in constants for i in node.input):
            continue
        for name in node.input:
            producer = produced_by.get(name)
            if producer is not None and producer.op_type == "Cast":  # a float32 norm's result back in float16
                name, producer = producer.input[0], produced_by.get(producer.input[0])
            if producer is not None and producer.op_type.endswith("Normalization") and name == producer.output[0]:
                found.append(node.name)
    return found


def casts_into_norms(model: onnx.ModelProto) -> list[str]:
    """Cast nodes that feed a normalization."""
    produced_by = {o: n for n in model.graph.node for o in n.output}
    return [
        produced_by[i].name
        for node in model.graph.node
        if node.op_type.endswith("Normalization")
        for i in node.input
        if i in produced_by and produced_by[i].op_type == "Cast"
    ]


def casts_to_float32_before_a_square(model: onnx.ModelProto) -> list[str]:
    """The float32 RMS norm of a float16 export: Cast, then Pow."""
    casts = {n.output[0]: n.name for n in model.graph.node if n.op_type == "Cast"}
    return [casts[n.input[0]] for n in model.graph.node if n.op_type == "Pow" and n.input[0] in casts]


def test_the_corpus_has_every_pattern_the_checks_below_look_for():
    """The per-file checks hold trivially for a file without the pattern; the corpus as a whole
    must have each one, or a check would prove nothing."""
    assert len(FILES) >= 20, f"{DATA} should hold the committed exports (tests/data/make_transformers.py)"
    models = [onnx.load(str(path)) for path in FILES]
    assert any(n.op_type in ("Erf", "Tanh") for m in models for n in m.graph.node)
    assert any(n.op_type == "ReduceMean" for m in models for n in m.graph.node)
    assert any(sigmoid_times_input(m) for m in models)
    assert any(casts_to_float32_before_a_square(m) for m in models)
    assert any(
        n.op_type == "Neg" for path, m in zip(FILES, models) if path.name.startswith("llama") for n in m.graph.node
    )


@pytest.fixture(scope="module", params=[p.name for p in FILES])
def optimized(request):
    path = DATA / request.param
    original = onnx.load(str(path))
    after, report = fuser.optimize(str(path), target="onnxruntime", inputs=realistic_inputs(original))
    return request.param, original, after, report


def test_numerics_pass_on_realistic_inputs(optimized):
    name, original, after, report = optimized
    assert report.verdict is not None and report.verdict.passed, report.verdict.summary()
    assert {o.name for o in report.verdict.outputs} == {o.name for o in original.graph.output}
    assert all(o.status == "ok" for o in report.verdict.outputs)
    assert [o.name for o in after.graph.output] == [o.name for o in original.graph.output]
    assert len(after.graph.node) < len(original.graph.node)


def test_gelu_fused(optimized):
    name, original, after, report = optimized
    before, now = Counter(n.op_type for n in original.graph.node), Counter(n.op_type for n in after.graph.node)
    written_out = before["Erf"] + before["Tanh"]
    assert now["Erf"] == now["Tanh"] == 0
    assert sum(now[op] for op in GELU_OPS) == written_out


def test_norms_fused(optimized):
    name, original, after, report = optimized
    assert not [n.name for n in after.graph.node if n.op_type == "ReduceMean"]


def test_attention_fused(optimized):
    """Attention with scaled_dot_product_attention's NaN guard becomes MultiHeadAttention; the
    rest (eager attention, ViT's legacy export) attention-multihead leaves as it is."""
    name, original, after, report = optimized
    softmaxes = sum(n.op_type == "Softmax" for n in original.graph.node)
    assert softmaxes > 0
    left = 0 if sum(n.op_type == "IsNaN" for n in original.graph.node) == softmaxes else softmaxes
    assert sum(n.op_type == "Softmax" for n in after.graph.node) == left
    assert sum(n.op_type == "MultiHeadAttention" for n in after.graph.node) == softmaxes - left


def test_rotary_fused(optimized):
    name, original, after, report = optimized
    rotations = sum(n.op_type == "Neg" for n in original.graph.node) if name.startswith("llama") else 0
    assert not [n.name for n in after.graph.node if n.op_type == "Neg"]
    assert [n.domain for n in after.graph.node if n.op_type == "RotaryEmbedding"] == ["com.microsoft"] * rotations


def test_silu_fused(optimized):
    name, original, after, report = optimized
    assert sigmoid_times_input(after) == []


def test_norm_weights_folded(optimized):
    """A norm's weight Mul folds into the norm (or its Skip* fusion); float16 Llama's too,
    through the Cast back to float16 (norm-scale-through-cast)."""
    name, original, after, report = optimized
    assert norms_followed_by_constant_mul(after) == []


def test_norm_casts_folded(optimized):
    name, original, after, report = optimized
    assert casts_into_norms(after) == []
