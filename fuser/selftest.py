"""Rule self-test: run a rule on random instances of its own pattern and check every rewrite.

For each instance the pattern is turned into a small model: its var()s become graph inputs,
its const()s initializers with random values, its op nodes nodes whose attributes, shapes
and dtypes are drawn at random but consistent with the pattern's attribute constraints, the
operator's inputs (a Conv's filter matches its input's channels, a BatchNormalization's
statistics are per channel, a binary op's second operand broadcasts) and the rule's opsets.
Optional inputs are present or absent at random. An instance onnxruntime itself refuses to
run is counted as not runnable and not tried further.

The rule then runs alone on the instance, with fuser's numerics check, and the instance is
counted as rewritten, declined (by reason), advised, a numerics failure (the model is saved:
it is the pattern alone, the smallest model that fails) or an error in the rule. The random
choices come from --seed and the rule's name only, so a run is reproducible and one rule's
instances do not depend on which other rules are tested.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fuser.errors import FuserError, NumericsMismatch, RuleError
from fuser.pattern import Const, OpPattern
from fuser.rule import Rule

CONV_OPS = {"Conv", "ConvTranspose", "FusedConv"}
POOL_OPS = {"MaxPool", "AveragePool"}
GLOBAL_POOL_OPS = {"GlobalMaxPool", "GlobalAveragePool"}
BINARY_OPS = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean", "Pow"}
FUSED_ACTIVATIONS = (("Relu", None), ("Tanh", None), ("Sigmoid", None), ("LeakyRelu", [0.01]))
# float32 mostly: onnxruntime's CPU kernels cover it for every operator the rules use.
DTYPES = (np.float32, np.float32, np.float32, np.float32, np.float16, np.float64)


class NotSynthesizable(Exception):
    """This random draw does not give a model (the next instance draws again)."""


@dataclass
class RuleSelfTest:
    rule: str
    source: str | None
    tried: int = 0
    rewritten: int = 0
    advised: int = 0
    not_runnable: int = 0
    unsynthesizable: Counter = field(default_factory=Counter)  # why no model could be drawn
    declined: Counter = field(default_factory=Counter)  # reason -> instances
    failures: list[str] = field(default_factory=list)  # saved failing models
    errors: list[str] = field(default_factory=list)  # the rule crashed

    @property
    def passed(self) -> bool:
        return not self.failures and not self.errors

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "source": self.source,
            "tried": self.tried,
            "rewritten": self.rewritten,
            "advised": self.advised,
            "not_runnable": self.not_runnable,
            "unsynthesizable": dict(self.unsynthesizable),
            "declined": dict(self.declined.most_common()),
            "numerics_failures": self.failures,
            "errors": self.errors,
        }

    def summary(self) -> str:
        parts = [f"tried {self.tried}", f"rewritten {self.rewritten}", f"declined {sum(self.declined.values())}"]
        if self.advised:
            parts.append(f"advised {self.advised}")
        if self.not_runnable:
            parts.append(f"not runnable {self.not_runnable}")
        if not self.tried and self.unsynthesizable:
            parts.append(f"no instance: {', '.join(self.unsynthesizable)}")
        parts.append(f"numerics failures {len(self.failures)}")
        if self.errors:
            parts.append(f"errors {len(self.errors)}")
        return ", ".join(parts)


def selftest(
    rules: list[Rule], *, seed: int = 0, instances: int = 4, save_dir: str | Path = "fuser-selftest"
) -> list[RuleSelfTest]:
    """Self-test every rule; failing models are written to `save_dir` (created when needed)."""
    return [selftest_rule(r, seed=seed, instances=instances, save_dir=Path(save_dir)) for r in rules]


def selftest_rule(rule: Rule, *, seed: int = 0, instances: int = 4, save_dir: Path = Path("fuser-selftest")):
    import fuser

    result = RuleSelfTest(rule.name, str(rule.source) if rule.source else None)
    if rule.sweep is not None:
        result.unsynthesizable["a sweep has no pattern to draw instances of"] += 1
        return result
    rng = np.random.default_rng([seed, zlib.crc32(rule.name.encode())])
    attempts = 0
    while result.tried < instances and attempts < 8 * instances:
        attempts += 1
        try:
            model, feeds = Instance(rule, rng).build()
        except NotSynthesizable as why:
            result.unsynthesizable[str(why)] += 1
            continue
        if not _runs(model, feeds):
            result.not_runnable += 1
            continue
        result.tried += 1
        try:
            _, report = fuser.optimize(model, rules=[rule], target=rule.target, trace=True, inputs=feeds, seed=seed)
        except NumericsMismatch as error:
            result.failures.append(f"{_save(model, save_dir, rule, result.tried)}: {error}")
            continue
        except RuleError as error:
            result.errors.append(f"{_save(model, save_dir, rule, result.tried)}: {error}")
            continue
        except FuserError as error:
            result.errors.append(f"{_save(model, save_dir, rule, result.tried)}: {error}")
            continue
        if report.rewrites:
            result.rewritten += 1
        elif report.engine.advice:
            result.advised += 1
        else:
            reasons = sorted({d.reason for d in report.engine.declined if d.rule == rule.name})
            result.declined[reasons[0] if reasons else "the pattern did not match the synthesized instance"] += 1
    return result


def _save(model: onnx.ModelProto, folder: Path, rule: Rule, index: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{rule.name}-{index}.onnx"
    onnx.save(model, str(path))
    return path


def _runs(model: onnx.ModelProto, feeds: dict) -> bool:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4  # a refused draw is expected, not worth a log line
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
    except Exception:  # noqa: BLE001 - onnxruntime refuses this draw: not a test of the rule
        return False
    return True


def _max_inputs(op_type: str, domain: str, opset: int) -> int:
    import onnx.defs

    try:
        return onnx.defs.get_schema(op_type, opset, domain).max_input
    except onnx.defs.SchemaError:  # onnxruntime's own operators: the pattern knows best
        return 1 << 16


class Instance:
    """One random model of a rule's pattern."""

    def __init__(self, rule: Rule, rng: np.random.Generator):
        self.rule = rule
        self.rng = rng
        self.dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
        low, high = rule.opsets or (7, None)
        choices = [v for v in (13, 17) if v >= low and (high is None or v <= high)]
        self.opset = int(rng.choice(choices)) if choices else int(high if high is not None else low)
        self.channels = int(rng.choice([8, 16, 32]))
        self.spatial = [int(rng.integers(3, 7))] * 2
        # A rule may list several spellings of one computation: each instance draws one.
        self.pattern = rule.alternatives[int(rng.integers(len(rule.alternatives)))]
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.tensors: dict[str, tuple[str, list[int]]] = {}  # pattern name -> (tensor, shape)
        self.built: dict[str, tuple[str, list[int]]] = {}  # pattern node name -> (output, shape)

    def build(self) -> tuple[onnx.ModelProto, dict]:
        output, shape = self._node(self.pattern)
        graph = helper.make_graph(
            self.nodes,
            f"selftest_{self.rule.name}",
            self.inputs,
            [helper.make_tensor_value_info(output, helper.np_dtype_to_tensor_dtype(self.dtype), shape)],
            self.initializers,
        )
        domains = {p.domain for p in self.pattern.walk() if isinstance(p, OpPattern) and p.domain}
        opsets = [helper.make_opsetid("", self.opset)] + [helper.make_opsetid(d, 1) for d in sorted(domains)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="fuser-selftest")
        model.ir_version = 8
        return model, self.feeds

    # ------------------------------------------------------------------ tensors

    def _random(self, shape, positive=False) -> np.ndarray:
        value = self.rng.standard_normal(size=shape)
        return (np.abs(value) + 0.5 if positive else value).astype(self.dtype)

    def _leaf(self, pattern, shape: list[int], value: np.ndarray | None = None) -> str:
        """Bind a var() or const() to a new graph input or initializer of `shape`."""
        name = f"{pattern.name}"
        if value is None:
            value = self._random(shape)
        if isinstance(pattern, Const):
            self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        else:
            tensor_type = helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)
            self.inputs.append(helper.make_tensor_value_info(name, tensor_type, list(np.shape(value))))
            self.feeds[name] = np.asarray(value)
        self.tensors[pattern.name] = (name, list(np.shape(value)))
        return name

    def _main_shape(self, op_type: str, domain: str = "") -> list[int]:
        if op_type in ("ReorderInput", "ReorderOutput") or (
            op_type == "Conv" and domain
        ):  # whole blocks for either block size, 8 or 16
            return [1, int(self.rng.choice([16, 32])), *self.spatial]
        if op_type in CONV_OPS | POOL_OPS | GLOBAL_POOL_OPS | {"BatchNormalization"}:
            return [1, self.channels, *self.spatial]
        if op_type in ("MatMul", "Gemm"):
            return [int(self.rng.integers(1, 5)), self.channels]
        rank = int(self.rng.integers(1, 5))
        return [2, self.channels, *self.spatial][:rank] if rank > 1 else [self.channels]

    def _broadcast_shape(self, shape: list[int]) -> list[int]:
        """A shape that broadcasts to `shape`: itself, per channel, a scalar, [1] or its last axis."""
        options = [list(shape), list(shape), [], [1], shape[-1:]]
        if len(shape) >= 2:  # per channel, the case folding rules look for
            per_channel = [shape[1]] + [1] * (len(shape) - 2)
            options += [per_channel, per_channel, [1, *per_channel]]
        return options[int(self.rng.integers(len(options)))]

    # -------------------------------------------------------------------- nodes

    def _node(self, pattern: OpPattern) -> tuple[str, list[int]]:
        if pattern.name in self.built:
            return self.built[pattern.name]
        op_type = pattern.op_types[int(self.rng.integers(len(pattern.op_types)))]
        attrs = {k: v for k, v in pattern.attrs if not callable(v)}
        known: list[tuple[str, list[int]] | None] = []
        present: list[bool] = []
        most = _max_inputs(op_type, pattern.domain, self.opset)
        for index, child in enumerate(pattern.inputs):
            if index >= most:  # an alternative with fewer inputs (Relu where Clip takes bounds)
                if not child.optional:
                    raise NotSynthesizable(f"{op_type} takes at most {most} inputs")
                break
            # Once an optional input is left out the later ones are too: ONNX operators take
            # optional inputs as a trailing run, and most kernels reject a gap.
            include = not child.optional or ((not present or present[-1]) and bool(self.rng.integers(2)))
            present.append(include)
            if not include:
                known.append(None)
            elif isinstance(child, OpPattern):
                known.append(self._node(child))
            else:
                known.append(None)  # looked up below, once every operator input is built
        for index, child in enumerate(pattern.inputs[: len(present)]):
            if present[index] and not isinstance(child, OpPattern):
                known[index] = self.tensors.get(child.name)
        while present and not present[-1]:  # trailing absent inputs are left out, not ""
            present.pop()
            known.pop()
        names, shape = self._inputs(op_type, pattern, known, present, attrs)
        output = f"{pattern.name}_out"
        outputs = [f"{output}{i}" if i != pattern.output else output for i in range(pattern.output + 1)]
        self.nodes.append(helper.make_node(op_type, names, outputs, name=pattern.name, domain=pattern.domain, **attrs))
        self.built[pattern.name] = (output, shape)
        return output, shape

    def _inputs(self, op_type, pattern, known, present, attrs) -> tuple[list[str], list[int]]:
        """Names of the node's inputs (new leaves where needed) and the node's output shape."""
        leaves = pattern.inputs
        names: list[str] = []
        first = known[0] if known else None
        main = first[1] if first else self._main_shape(op_type, pattern.domain)
        if op_type == "ReorderOutput":
            attrs.setdefault("channels", main[1])
        if first is None and leaves:
            names.append(self._leaf(leaves[0], main))
        elif first is not None:
            names.append(first[0])

        def leaf(index: int, shape, value=None) -> str:
            if index >= len(present) or not present[index]:
                return ""
            if known[index] is not None:
                return known[index][0]
            return self._leaf(leaves[index], shape, value)

        count = len(present)
        out = list(main)
        if op_type in ("Conv", "FusedConv", "ConvTranspose"):
            # An NCHWc Conv reads and writes whole blocks; its weights' layout does not matter
            # here, the instance and its rewrite read the same ones.
            blocked = pattern.domain == "com.microsoft.nchwc"
            if len(main) < 3:
                raise NotSynthesizable(f"{op_type}'s input comes out of the pattern with rank {len(main)}, not 3 or more")
            channels_in = main[1]
            kernel = int(self.rng.choice([1, 3]))
            depthwise = op_type != "ConvTranspose" and not blocked and bool(self.rng.integers(4) == 0)
            group = channels_in if depthwise else 1
            channels_out = channels_in if depthwise else int(self.rng.choice([16, 32] if blocked else [8, 16, 24]))
            if op_type == "ConvTranspose":
                weight = [channels_in, channels_out, kernel, kernel]
                out = [main[0], channels_out] + [d + kernel - 1 for d in main[2:]]
            else:
                pad = kernel // 2 if self.rng.integers(2) else 0
                attrs.setdefault("pads", [pad] * 4)
                out = [main[0], channels_out] + [d + 2 * pad - kernel + 1 for d in main[2:]]
            attrs.setdefault("kernel_shape", [kernel, kernel])
            if group > 1:
                attrs.setdefault("group", group)
                weight = [channels_out, 1, kernel, kernel]
            elif op_type != "ConvTranspose":
                weight = [channels_out, channels_in, kernel, kernel]
            if op_type == "FusedConv":
                activation, params = FUSED_ACTIVATIONS[int(self.rng.integers(len(FUSED_ACTIVATIONS)))]
                attrs.setdefault("activation", activation)
                if params:
                    attrs.setdefault("activation_params", params)
            names += [leaf(1, weight)]
            if count > 2:
                names.append(leaf(2, [channels_out]))
            if count > 3:
                names.append(leaf(3, out))
        elif op_type == "BatchNormalization":
            channels = [main[1]]
            names += [leaf(1, channels), leaf(2, channels), leaf(3, channels)]
            names.append(leaf(4, channels, self._random(channels, positive=True)))
        elif op_type == "Gemm":
            n = int(self.rng.choice([4, 8]))
            names.append(leaf(1, [main[1], n]))
            if count > 2:
                names.append(leaf(2, self._broadcast_shape([main[0], n])))
            out = [main[0], n]
        elif op_type == "MatMul":
            n = int(self.rng.choice([4, 8]))
            names.append(leaf(1, [main[-1], n]))
            out = main[:-1] + [n]
        elif op_type in BINARY_OPS:
            for index in range(1, count):
                names.append(leaf(index, self._broadcast_shape(main)))
        elif op_type in ("ReduceSum", "ReduceMean", "ReduceMax"):
            axis = int(self.rng.integers(len(main)))
            keepdims = attrs.setdefault("keepdims", int(self.rng.integers(2)))
            if count > 1:
                value = np.array([axis], np.int64)
                if self.opset >= 13:
                    names.append(leaf(1, [1], value))
                else:
                    raise NotSynthesizable("axes as an input before opset 13")
                reduced = {axis}
            else:
                reduced = set(range(len(main)))
            out = [1 if i in reduced else d for i, d in enumerate(main) if keepdims or i not in reduced]
        elif op_type in ("Softmax", "LogSoftmax"):
            attrs.setdefault("axis", int(self.rng.integers(-len(main), len(main))))
        elif op_type == "Clip":
            bound = float(self.rng.uniform(0.1, 6))
            if count > 1:
                names.append(leaf(1, [], np.array(-bound if self.rng.integers(2) else 0.0, self.dtype)))
            if count > 2:
                names.append(leaf(2, [], np.array(bound, self.dtype)))
        elif op_type == "Dropout":
            if count > 1:
                names.append(leaf(1, [], np.array(self.rng.uniform(0, 0.5), self.dtype)))
            if count > 2:
                names.append(leaf(2, [], np.array(bool(self.rng.integers(2)))))
        elif op_type in POOL_OPS:
            kernel = int(self.rng.choice([2, 3]))
            stride = int(self.rng.choice([1, 2]))
            attrs.setdefault("kernel_shape", [kernel, kernel])
            attrs.setdefault("strides", [stride, stride])
            out = main[:2] + [(d - kernel) // stride + 1 for d in main[2:]]
        elif op_type in GLOBAL_POOL_OPS:
            out = main[:2] + [1] * (len(main) - 2)
        elif op_type == "Concat":
            axis = attrs.setdefault("axis", 1)
            for index in range(1, count):
                names.append(leaf(index, main))
            parts = [known[i][1] if known[i] else main for i in range(count) if present[i]]
            if any(len(part) <= axis for part in parts):
                raise NotSynthesizable(f"Concat along axis {axis} of parts with fewer dimensions")
            total = sum(part[axis] for part in parts)
            out[axis] = total
        elif op_type == "ReorderOutput":
            out = main[:1] + [attrs.get("channels", main[1])] + main[2:]
        elif op_type == "ReorderInput":
            pass  # whole blocks: the blocked shape is the plain one
        elif pattern.domain == "com.microsoft.nchwc":
            raise NotSynthesizable(f"{op_type} needs blocked weights")
        else:  # unary and elementwise operators: every input shaped like the first
            for index in range(1, count):
                names.append(leaf(index, main))
        return names, out
