"""Helpers for testing rules, the same ones fuser's own test suite uses.

    from fuser.testing import assert_declined, assert_rewritten, model_from_text

    model = model_from_text('''
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 8] x) => (float[N, 8] y) {
            h = HardSigmoid <alpha = 0.1666667, beta = 0.5> (x)
            y = Mul (x, h)
        }
    ''')
    assert_rewritten(model, hard_swish, counts={"hard-swish": 1}, expected_ops=["HardSwish"])
    assert_declined(other_model, hard_swish, "alpha is 0.2")

Building models: `model_from_text` (the ONNX text format, `onnx.parser.parse_model`; the
`<ir_version, opset_import>` header may be left out) and `make_model` (nodes, inputs and
outputs as `(name, dtype, shape)` tuples). Both run the full ONNX checker.

Asserting: `assert_rewritten` (the rule fired: counts, op sequence, `onnx.checker`, graph
interface unchanged, fuser's numerics check in onnxruntime with its graph optimizations off,
and optionally your own feeds) and `assert_declined` (nothing changed, and the rule declined
for the reason you expect). Both raise AssertionError with what was found instead.

Looking into models: `op_types`, `nodes_of`, `attrs_of`, `opsets_of`, `initializer`,
`initializer_value`; running them: `ort_session`, `run`, `assert_same_outputs`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fuser.rule import Rule

IR_VERSION = 8
DEFAULT_OPSET = 17

__all__ = [
    "IR_VERSION",
    "assert_declined",
    "assert_rewritten",
    "assert_same_outputs",
    "attrs_of",
    "initializer",
    "initializer_value",
    "make_model",
    "model_from_text",
    "nodes_of",
    "op_types",
    "opsets_of",
    "ort_session",
    "rules_named",
    "run",
]


def _expect(condition: bool, message) -> None:
    # Not `assert`: these checks must hold under `python -O` too.
    if not condition:
        raise AssertionError(message() if callable(message) else message)


# ------------------------------------------------------------------------ building models


def model_from_text(
    text: str,
    *,
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = DEFAULT_OPSET,
    ir_version: int = IR_VERSION,
    check: bool = True,
) -> onnx.ModelProto:
    """A model from the ONNX text format (see `onnx.parser`).

    Without a `<...>` header the model gets `ir_version` and the default domain at `opset`.
    initializers: {name: array} added to the main graph (the text format can also declare
    them inline, `float[2] w = {1.0, 2.0}`). The full ONNX checker runs unless check=False.
    """
    source = text.strip()
    if not source.startswith("<"):
        source = f'<ir_version: {ir_version}, opset_import: ["" : {opset}]>\n{source}'
    try:
        model = onnx.parser.parse_model(source)
    except onnx.parser.ParseError as error:
        raise ValueError(f"not valid ONNX text: {error}") from error
    for name, value in (initializers or {}).items():
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def make_model(
    nodes,
    inputs,
    outputs,
    initializers=(),
    opset: int = DEFAULT_OPSET,
    extra_opsets: dict[str, int] | None = None,
    ir_version: int = IR_VERSION,
    *,
    check: bool = True,
) -> onnx.ModelProto:
    """A model from `onnx.helper` nodes; inputs/outputs: (name, numpy dtype, shape) tuples,
    a shape entry may be a string (a symbolic dimension) or None; initializers: {name: array}
    or (name, array) pairs; extra_opsets: {domain: version} beyond the default domain.

    The model is run through the full ONNX checker; check=False skips it, for deliberately
    invalid models (mismatched dtypes, unknown shapes the full check wants, ...).
    """

    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)

    inits = initializers.items() if isinstance(initializers, dict) else initializers
    graph = helper.make_graph(
        list(nodes),
        "test",
        [info(*i) for i in inputs],
        [info(*o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in inits],
    )
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="fuser-tests")
    model.ir_version = ir_version
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


# ------------------------------------------------------------------------ running models


def ort_session(model: onnx.ModelProto):
    """An onnxruntime CPU session for `model` with every graph optimization disabled, so that
    onnxruntime's own fusions neither hide nor imitate the rewrite under test."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """The outputs of `model` on `feeds`, in onnxruntime with its graph optimizations off."""
    return ort_session(model).run(None, feeds)


def assert_same_outputs(before, after, feeds, rtol=0.0, atol=0.0) -> None:
    """Run both models in onnxruntime on `feeds`; rtol=atol=0 means bit-identical."""
    expected = run(before, feeds)
    actual = run(after, feeds)
    _expect(len(expected) == len(actual), f"{len(expected)} outputs before, {len(actual)} after")
    for e, a in zip(expected, actual):
        _expect(e.dtype == a.dtype and e.shape == a.shape, f"{e.dtype}{list(e.shape)} became {a.dtype}{list(a.shape)}")
        if rtol == 0 and atol == 0:
            np.testing.assert_array_equal(a, e)
        else:
            np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)


# --------------------------------------------------------------------- looking into models


def op_types(model: onnx.ModelProto) -> list[str]:
    """The main graph's op types, in graph order."""
    return [n.op_type for n in model.graph.node]


def nodes_of(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    """The main graph's nodes of one op type, in graph order."""
    return [n for n in model.graph.node if n.op_type == op_type]


def attrs_of(node: onnx.NodeProto) -> dict:
    """A node's attributes as {name: Python value}; a string attribute comes back as str."""
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def opsets_of(model: onnx.ModelProto) -> dict[str, int]:
    """The model's opset imports as {domain: version} ("" is the default ONNX domain)."""
    return {o.domain: o.version for o in model.opset_import}


def initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    """The main graph's initializer called `name`; fails unless there is exactly one."""
    found = [t for t in model.graph.initializer if t.name == name]
    _expect(len(found) == 1, f"expected exactly one initializer '{name}', found {len(found)}")
    return found[0]


def initializer_value(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The value of the main graph's initializer `name` (exactly one must exist) as an array."""
    return numpy_helper.to_array(initializer(model, name))


# ------------------------------------------------------------------------- rule tests


def rules_named(rules) -> list[Rule]:
    """Rule objects from a Rule, a registered rule's name (built-in or plugin), or a list of them."""
    if isinstance(rules, (Rule, str)):
        rules = [rules]
    found = []
    for item in rules:
        if isinstance(item, Rule):
            found.append(item)
            continue
        if not isinstance(item, str):
            raise TypeError(f"{item!r} is neither a Rule nor a rule's name")
        from fuser.registry import all_rules

        registered = {r.name: r for r in all_rules()}
        if item not in registered:
            raise ValueError(f"no registered rule is named '{item}' (see `fuser rules`)")
        found.append(registered[item])
    return found


def _describe_declines(report) -> list[str]:
    return [f"{d.rule} at {d.node}: {d.reason}" for d in report.engine.declined]


def assert_rewritten(
    model,
    rules,
    *,
    counts: dict[str, int] | None = None,
    expected_ops: Iterable[str] | None = None,
    check: bool = True,
    feeds: dict | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    all_outputs_ok: bool = False,
    **optimize_kwargs,
):
    """Optimize `model` with exactly `rules` (a Rule, a rule's name, or a list of them) and
    check that the rewrite happened as expected.

    Checks: report.counts == counts (per-rule rewrite counts; when None, at least one rewrite
    happened); the optimized op sequence is `expected_ops` (when given); the optimized model
    passes the full ONNX checker; the graph interface is unchanged (input and output names, in
    order); with check=True fuser's numerics check ran in onnxruntime (graph optimizations
    off) and passed (with all_outputs_ok=True every output's status is also "ok", i.e. none
    merely "stabilized"). Given `feeds`, the outputs of both models in onnxruntime must also
    agree within rtol/atol (0/0: bit-identical; see assert_same_outputs).
    optimize_kwargs go to fuser.optimize (target=..., trace=...). Returns (after, report).
    """
    import fuser

    after, report = fuser.optimize(model, rules=rules_named(rules), check=check, **optimize_kwargs)
    if counts is None:
        _expect(report.rewrites, lambda: f"nothing was rewritten; declines: {_describe_declines(report)}")
    else:
        _expect(
            report.counts == counts,
            lambda: f"counts {report.counts}, expected {counts}; declines: {_describe_declines(report)}",
        )
    if expected_ops is not None:
        _expect(op_types(after) == list(expected_ops), lambda: f"the optimized ops are {op_types(after)}")
    onnx.checker.check_model(after, full_check=True)
    _expect(
        [i.name for i in after.graph.input] == [i.name for i in model.graph.input],
        "the graph inputs changed",
    )
    _expect(
        [o.name for o in after.graph.output] == [o.name for o in model.graph.output],
        "the graph outputs changed",
    )
    if check:
        _expect(report.verdict is not None and report.verdict.passed, lambda: f"numerics: {report.verdict}")
        if all_outputs_ok:
            _expect(all(o.status == "ok" for o in report.verdict.outputs), lambda: str(report.verdict.outputs))
    if feeds is not None:
        assert_same_outputs(model, after, feeds, rtol=rtol, atol=atol)
    return after, report


def assert_declined(model, rule, reason, *, node=None, scope=None, rules=None, check=True, **optimize_kwargs):
    """Optimize `model` with `rule` (a Rule or a rule's name; or with `rules`, which should
    include it) and check that nothing was rewritten: no counts, no rewrites, the op sequence
    unchanged.

    reason: a substring that at least one of `rule`'s declines must contain; None when the
    pattern itself must not match, so that `rule` declines nothing either. With a reason,
    `node` / `scope` (when given) are the node name / graph scope every one of `rule`'s
    declines must be at. optimize_kwargs go to fuser.optimize (target=...); the optimization
    is traced so that declines are recorded. Returns (after, report).
    """
    import fuser

    (the_rule,) = rules_named(rule)
    chosen = rules_named(rules) if rules is not None else [the_rule]
    after, report = fuser.optimize(model, rules=chosen, trace=True, check=check, **optimize_kwargs)
    _expect(report.counts == {}, lambda: f"the model was rewritten: {report.counts}")
    _expect(report.rewrites == [], lambda: f"the model was rewritten: {report.rewrites}")
    _expect(op_types(after) == op_types(model), lambda: f"the ops changed to {op_types(after)}")
    declined = [d for d in report.engine.declined if d.rule == the_rule.name]
    if reason is None:
        _expect(declined == [], lambda: f"expected no decline, found {[d.reason for d in declined]}")
    else:
        _expect(declined, "expected the rule to decline the match")
        if node is not None:
            _expect(all(d.node == node for d in declined), lambda: str([d.node for d in declined]))
        if scope is not None:
            _expect(all(d.scope == scope for d in declined), lambda: str([d.scope for d in declined]))
        _expect(any(reason in d.reason for d in declined), lambda: str([d.reason for d in declined]))
    return after, report
