"""Rules: a pattern, and a function that checks the match's conditions and builds the replacement.

    @rule("conv-bn-fold", pattern=op.BatchNormalization(op.Conv(var("x"), const("w")), ...))
    def conv_bn_fold(m: Match, b: Builder):
        '''Conv -> BatchNormalization  =>  Conv with rescaled weights and bias.'''
        m.require(m.attr("bn", "training_mode", 0) == 0, "BatchNormalization is in training mode")
        return b.Conv(m["x"], new_weight, new_bias, **m.attrs("conv"))

The function returns the tensor(s) that take the place of the root node's outputs; the
engine gives them the root's output names, so graph outputs and downstream consumers
survive. None in place of an output drops it (declined if anything uses it). Rules only
describe the replacement; the engine alone changes the graph.

What no pattern can find (nodes nothing reads, initializers holding equal bytes) is found by
a sweep: ``@sweep("dead-code")`` decorates a function that looks at a whole graph scope and
proposes `Change`s, which the engine checks, applies and logs like any rewrite.
"""

from __future__ import annotations

import functools
import operator
import re
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import NodeProto, TensorProto

from fuser.errors import RuleError
from fuser.graph import Graph, NodeInfo, op_may_hold_graphs
from fuser.operators import DEFAULT_DOMAINS, unknown_op
from fuser.pattern import OpPattern, PatternError, SourceLocation, caller_location, validate
from fuser.tensors import from_array

TARGETS = ("onnx", "onnxruntime")
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def _opset_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class Rule:
    """A rewrite rule. Build one with the `rule` decorator."""

    name: str
    description: str
    pattern: OpPattern | tuple[OpPattern, ...] | None
    build: Callable
    target: str = "onnx"
    emits: dict[str, int] = field(default_factory=dict)
    opsets: tuple[int, int | None] | None = None
    exact: bool = False
    enabled_by_default: bool = True
    shared_interior: bool = False
    advisory: bool = False
    stabilizes: bool = False
    phase: int = 0
    note: str | Callable[[], str] | None = None
    source: SourceLocation | None = None
    sweep: Callable[[Graph], Iterable[Change]] | None = None
    candidates: Callable[[Graph], Iterable[int]] | None = None
    walks: int = 0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise PatternError(f"rule name '{self.name}' must be kebab-case, like 'conv-bn-fold'")
        if self.target not in TARGETS:
            raise PatternError(f"rule '{self.name}': target must be one of {', '.join(TARGETS)}")
        if not self.description:
            raise PatternError(f"rule '{self.name}' needs a description (or a docstring)")
        if (self.pattern is None) == (self.sweep is None):
            raise PatternError(f"rule '{self.name}' needs either a pattern or a sweep, not both")
        if self.candidates is not None and (self.sweep is not None or not callable(self.candidates)):
            raise PatternError(f"rule '{self.name}': candidates must be a function of a graph, for a pattern rule")
        if isinstance(self.pattern, (list, tuple)) and not self.pattern:
            raise PatternError(f"rule '{self.name}' has an empty list of patterns")
        if not isinstance(self.walks, int) or self.walks < 0:
            raise PatternError(f"rule '{self.name}': walks must be a depth (an int, 0 or more), not {self.walks!r}")
        for alternative in self.alternatives:
            validate(alternative)
        self._check_opsets()
        self._check_emits()
        self._check_pattern_ops()

    def _check_opsets(self) -> None:
        """(low, high) with low <= high, or (low, None): a range no opset is in would skip the rule everywhere."""
        if self.opsets is None:
            return
        fits = isinstance(self.opsets, (tuple, list)) and len(self.opsets) == 2
        if fits:
            low, high = self.opsets
            fits = _opset_number(low) and (high is None or (_opset_number(high) and low <= high))
        if not fits:
            where = f" ({self.source})" if self.source else ""
            raise PatternError(
                f"rule '{self.name}'{where}: opsets must be (low, high) with 1 <= low <= high, "
                f"or (low, None), not {self.opsets!r}"
            )

    def _check_emits(self) -> None:
        where = f" ({self.source})" if self.source else ""
        for domain, version in self.emits.items():
            if domain in DEFAULT_DOMAINS:
                raise PatternError(
                    f"rule '{self.name}'{where}: emits= names the default domain, whose opset is the model's; "
                    "declare the opsets the rule needs with opsets=(low, high) instead"
                )
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise PatternError(
                    f"rule '{self.name}'{where}: emits={{{domain!r}: {version!r}}} needs an opset version >= 1"
                )

    def _check_pattern_ops(self) -> None:
        """A pattern naming an operator that does not exist would silently never match."""
        newest = self.opsets[1] if self.opsets else None
        for item in (i for p in self.alternatives for i in p.walk()):
            if not isinstance(item, OpPattern):
                continue
            for op_type in item.op_types:
                why = unknown_op(op_type, item.domain, newest if item.domain in ("", "ai.onnx") else None)
                if why:
                    where = f" ({self.source})" if self.source else ""
                    raise PatternError(f"rule '{self.name}'{where}: its pattern cannot match: {why}")

    @property
    def builtin(self) -> bool:
        """Shipped with fuser (the fuser.rules package), not a user's rule file or plugin."""
        if self.source is None:
            return False
        package = sys.modules.get("fuser.rules")
        folders = [Path(f).resolve() for f in getattr(package, "__path__", ())]
        return any(Path(self.source.path).resolve().is_relative_to(f) for f in folders)

    @functools.cached_property
    def declared_domains(self) -> frozenset[str]:
        """The opset domains a replacement may use besides the default one: the rule's `emits`,
        and those of the operators its pattern matches (rebuilding a matched node's kind)."""
        matched = {i.domain for p in self.alternatives for i in p.walk() if isinstance(i, OpPattern)}
        return frozenset(set(self.emits) | matched) - set(DEFAULT_DOMAINS)

    @functools.cached_property
    def alternatives(self) -> tuple[OpPattern, ...]:
        """The patterns the rule matches: one, or several spellings of the same computation."""
        if self.pattern is None:
            return ()
        return tuple(self.pattern) if isinstance(self.pattern, (list, tuple)) else (self.pattern,)

    @property
    def roots(self) -> list[tuple[str, str]]:
        """(op type, domain) of every node a pattern of the rule can be rooted at."""
        found = [(t, p.domain) for p in self.alternatives for t in p.op_types]
        return list(dict.fromkeys(found))

    @property
    def depth(self) -> int:
        return max((p.depth for p in self.alternatives), default=0)

    @functools.cached_property
    def buildable(self) -> set[tuple]:
        """(op type, domain, the model's opset of it, the rule's emits of it) that Builder found the
        rule may build."""
        return set()

    @functools.cached_property
    def needs(self) -> tuple[tuple[tuple[tuple[str, ...], str], ...], ...]:
        """Per pattern, the op types it needs below its root (OpPattern.needs)."""
        return tuple(p.needs() for p in self.alternatives)

    def note_text(self) -> str | None:
        return self.note() if callable(self.note) else self.note

    def supports_opset(self, opset: int) -> bool:
        if self.opsets is None:
            return True
        low, high = self.opsets
        return low <= opset and (high is None or opset <= high)

    def __repr__(self) -> str:
        return f"Rule({self.name!r})"


def rule(
    name: str,
    *,
    pattern: OpPattern | tuple[OpPattern, ...],
    description: str | None = None,
    target: str = "onnx",
    emits: dict[str, int] | None = None,
    opsets: tuple[int, int | None] | None = None,
    exact: bool = False,
    enabled: bool = True,
    shared_interior: bool = False,
    advisory: bool = False,
    stabilizes: bool = False,
    phase: int = 0,
    note: str | Callable[[], str] | None = None,
    candidates: Callable[[Graph], Iterable[int]] | None = None,
    walks: int = 0,
) -> Callable[[Callable], Rule]:
    """Declare a rule; the decorated function builds the replacement.

    pattern: what the rule matches; a tuple of patterns for several spellings of one
        computation (``(x * 0.5) * y`` and ``x * (0.5 * y)``), tried in order.

    exact: True for pure rewiring that must give bit-identical outputs; False for
        folding, which is equal up to rounding (verified with dtype tolerances).
    target: "onnx" (standard operators only) or "onnxruntime" (may emit com.microsoft ops).
    emits: the domains besides the default one that the replacement may build operators in,
        with the opset version to import when the model lacks it, e.g. {"com.microsoft": 1};
        building in an undeclared domain is the rule's error. (A rule may also rebuild
        operators of the domains its pattern matches.)
    opsets: the default-domain opset range (low, high) the rule understands, high None for
        "and later"; outside it the rule is skipped.
    shared_interior: allow interior nodes whose outputs have other consumers; they are
        then kept alongside the replacement instead of the match being declined.
    stabilizes: the replacement may be finite where the original overflows to inf/NaN (e.g.
        LogSoftmax for Log(Softmax)); only then does the check accept such outputs, as
        "stabilized", instead of calling them a mismatch.
    phase: rules of a higher phase see a graph only after every lower-phase rule has
        reached its fixed point there: for rewrites (a data layout change, say) that would
        hide the patterns other rules look for.
    note: a sentence for the report whenever the rule has rewritten something (or a
        function returning it), for what the user must know about the result.
    advisory: the rule never rewrites; its function is called as f(m, None) and returns a
        sentence telling the user why the matched pattern stays as it is (shown in reports).
        It looks at every node of its root types once its phase has rewritten the scope.
    candidates: for a pattern that matches nearly every node (any op, say) while the rule
        rewrites few, a function of a graph scope that finds those few in one look at the whole
        scope: the ids of the nodes worth trying when a pass over the scope (or much of it)
        starts. It must include every node the rule could rewrite at that moment; the nodes a
        rewrite touches later are tried whatever it returned. A rewrite far above a node can
        make it rewritable without touching it (constants evaluated through many nodes): after
        a pass that rewrote something, the engine names the candidates anew and tries them
        again, until a pass rewrites nothing; naming them generously saves those passes.
    walks: for a rule whose function reads the graph beyond its pattern (walking up from it,
        Match.absorb), how deep that reads, counted as a pattern's depth is: after a rewrite,
        the engine looks again at nodes that far below it (otherwise as far as the deepest
        pattern that can match).
    """
    location = caller_location()

    def decorate(function: Callable) -> Rule:
        return Rule(
            name=name,
            description=description or _summary(function),
            pattern=pattern,
            build=function,
            target=target,
            emits=dict(emits or {}),
            opsets=opsets,
            exact=exact,
            enabled_by_default=enabled,
            shared_interior=shared_interior,
            advisory=advisory,
            stabilizes=stabilizes,
            phase=phase,
            note=note,
            source=location,
            candidates=candidates,
            walks=walks,
        )

    return decorate


def _summary(function: Callable) -> str:
    """The first line of a rule function's docstring: its description unless one is given."""
    doc = (function.__doc__ or "").strip().splitlines()
    return doc[0].strip() if doc else ""


@dataclass(frozen=True)
class Change:
    """One rewrite a sweep proposes; the engine checks it, applies it and logs it.

    nodes: op nodes to remove; every use of their outputs must be among them (no graph output),
        unless `values` holds the output.
    redirects: (initializer, replacement initializer) pairs of one scope: the first one's readers
        read the second instead, and the first goes; not for a graph output or a subgraph's read.
    initializers: initializers nothing reads, to remove.
    values: new initializers, each named after an output of `nodes` (not a graph output), which
        then holds that output's value: its readers read the initializer, under the same name.
        It must have the output's dtype and shape (what the engine cannot see, the check does).
    """

    nodes: tuple[int, ...] = ()
    redirects: tuple[tuple[str, str], ...] = ()
    initializers: tuple[str, ...] = ()
    values: tuple[TensorProto, ...] = ()


def sweep(
    name: str,
    *,
    description: str | None = None,
    target: str = "onnx",
    exact: bool = True,
    enabled: bool = True,
    phase: int = 0,
    note: str | Callable[[], str] | None = None,
) -> Callable[[Callable], Rule]:
    """Declare a rule that looks at a whole graph scope rather than matching a pattern.

    The decorated function takes a Graph and yields `Change`s. The engine runs it once when its
    phase starts and again after the phase's pattern rules changed the graph; each Change is one
    entry of the rewrite log (declined with the engine's reason when it is unsafe), so blame,
    --on-mismatch drop and check mode treat it like any rewrite.
    """
    location = caller_location()

    def decorate(function: Callable) -> Rule:
        return Rule(
            name=name,
            description=description or _summary(function),
            pattern=None,
            build=function,
            target=target,
            exact=exact,
            enabled_by_default=enabled,
            phase=phase,
            note=note,
            source=location,
            sweep=function,
        )

    return decorate


# The rewrites of a large model build the same attributes over and over (each folded Conv's
# kernel_shape, pads, strides): each is encoded once, and copied into the nodes after.
ATTRIBUTE_CACHE_LIMIT = 4096
ATTRIBUTE_CACHE_LENGTH = 64  # items of a list, characters of a text
# Keywords of Builder.op that set the NodeProto's own fields, as onnx.helper.make_node takes them.
NODE_FIELDS = ("doc_string", "overload")
_BODY_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
_encoded_attributes: dict[tuple, onnx.AttributeProto] = {}
_attribute_name = operator.attrgetter("name")


def _attribute(name: str, value) -> onnx.AttributeProto:
    """onnx.helper.make_attribute(name, value), encoded once per distinct value."""
    key = _attribute_key(value)
    if key is None:
        return onnx.helper.make_attribute(name, value)
    key = (name, key)
    encoded = _encoded_attributes.get(key)
    if encoded is None:
        if len(_encoded_attributes) >= ATTRIBUTE_CACHE_LIMIT:
            _encoded_attributes.clear()
        encoded = _encoded_attributes[key] = onnx.helper.make_attribute(name, value)
    return encoded


def _attribute_key(value):
    """A key that two values share only when make_attribute encodes them alike (None: not
    cached, as a long list or text is not: the cache holds small values). Types are part of it
    (a float's bits may equal a bytes value, True encodes as 1), and floats are keyed by their
    bits: -0.0 == 0.0, and a NaN equals nothing."""
    if isinstance(value, float):
        return type(value), struct.pack("<d", value)
    if isinstance(value, int):
        return type(value), value
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > ATTRIBUTE_CACHE_LENGTH:
        return None
    if isinstance(value, (str, bytes)):
        return type(value), value
    if isinstance(value, (list, tuple)):
        items = tuple(map(_attribute_key, value))
        return None if None in items else (type(value), items)
    return None


class Builder:
    """Creates the replacement's nodes and initializers with names that never collide.

    ``b.Conv(x, w, bias, group=2)`` returns the new node's output tensor name;
    numpy arrays given as inputs become new initializers; None leaves an optional input empty.
    """

    def __init__(self, graph: Graph, anchor: str, rule: Rule | None = None):
        self._graph = graph
        self._anchor = anchor
        self._rule = rule
        self.nodes: list[NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.opsets: dict[str, int] = {}
        self.shared_created: dict[str, str] = {}
        self.stand_ins: dict[str, str] = {}

    def __getattr__(self, op_type: str):
        if op_type.startswith("_"):
            raise AttributeError(op_type)

        def make(*inputs, **attrs):
            return self.op(op_type, *inputs, **attrs)

        return make

    def op(
        self,
        op_type: str,
        *inputs,
        domain: str = "",
        outputs: int = 1,
        **attrs,
    ) -> str | list[str]:
        if self._rule is not None:
            self._check_op(op_type, domain)
        names = self._graph.names
        input_names = [self._input(value, op_type) for value in inputs]
        while input_names and input_names[-1] == "":
            input_names.pop()
        node_name = names.fresh(f"{self._anchor}/{op_type}")
        output_names = [names.fresh(f"{node_name}:{i}") for i in range(outputs)]
        if attrs:
            fields = {field: attrs.pop(field) for field in NODE_FIELDS if field in attrs}  # make_node's, not attributes
            node = onnx.helper.make_node(op_type, input_names, output_names, name=node_name, domain=domain, **fields)
            node.attribute.extend(_attribute(k, v) for k, v in sorted(attrs.items()) if v is not None)
        else:  # make_node's node, made in one call: a large model's rewrites build hundreds of thousands
            node = NodeProto(op_type=op_type, input=input_names, output=output_names, name=node_name, domain=domain)
        self.nodes.append(node)
        return output_names[0] if outputs == 1 else output_names

    def like(self, node: NodeInfo, *inputs, outputs: int = 1, **attrs) -> str | list[str]:
        """A node of `node`'s op type and domain, with its attributes (those in `attrs` replaced),
        reading `inputs`: a convolution with folded weights is `b.like(conv, x, weight, bias)`.
        The attributes are copied as they are, not decoded and encoded again. If/Loop/Scan
        bodies are not copied: a node holding one needs its bodies given (or None)."""
        if op_may_hold_graphs(node.op_type, node.domain):  # read the attributes' types only where they may be bodies
            bodies = [a.name for a in node.proto.attribute[:] if a.type in _BODY_ATTRIBUTES and a.name not in attrs]
            if bodies:
                raise ValueError(f"b.like does not copy the bodies of {node.op_type} ({', '.join(bodies)}): give them")
        result = self.op(node.op_type, *inputs, domain=node.domain, outputs=outputs, **attrs)
        built = self.nodes[-1]
        kept = [a for a in node.proto.attribute[:] if a.name not in attrs] if attrs else node.proto.attribute[:]
        if not kept:
            return result
        if built.attribute:
            kept = [*built.attribute, *kept]
            del built.attribute[:]
        built.attribute.extend(sorted(kept, key=_attribute_name) if len(kept) > 1 else kept)  # in op()'s order, by name
        return result

    def replaces(self, interior: str, tensor: str) -> None:
        """The replacement also provides `interior`, an output of a matched node other than
        the root that is used outside the match, as `tensor`: the node need not be kept.
        (A residual Add feeding a normalization and the next block: the fused op's
        sum output stands in for the Add.)"""
        self.stand_ins[interior] = tensor

    def _check_op(self, op_type: str, domain: str) -> None:
        """An operator the model cannot run is the rule's error, found when it is built rather
        than as a model onnxruntime refuses. Every domain besides the default one must be
        declared (in emits=, or by the pattern matching that domain's operators), so that a
        rule working on models that happen to import the domain does not break on others."""
        rule = self._rule
        default = domain in DEFAULT_DOMAINS
        key = "" if default else domain
        # The answer depends on the op, the rule and the versions of the domain in play: found
        # once, not at every rewrite of a large model.
        settled = (op_type, key, self._graph.opset(key), rule.emits.get(key))
        if settled in rule.buildable:
            return
        if not default and domain not in rule.declared_domains:
            why = f"it builds '{op_type}' in domain '{domain}', which the rule does not declare in emits="
        elif not default and domain not in rule.emits and self._graph.opset(domain) is None:
            why = (
                f"it builds '{op_type}' in domain '{domain}', which this model does not import; "
                "declare the domain's version in emits="
            )
        else:
            versions = [v for v in (self._graph.opset(key), rule.emits.get(key)) if v is not None]
            why = unknown_op(op_type, domain, max(versions) if versions else None)
            why = why and f"it builds an operator the model cannot run: {why}"
        if why:
            raise RuleError(rule, why, at=_caller_outside(__file__))
        rule.buildable.add(settled)

    def once(self, key: str, make: Callable[[Builder], str]) -> str:
        """A tensor every rewrite in this graph shares: `make(builder)` builds it the first
        time a rewrite asks for `key`; later rewrites get the same tensor name back."""
        existing = self._graph.shared.get(key)
        if existing is not None and self._graph.defines(existing):
            return existing
        if key not in self.shared_created:
            self.shared_created[key] = make(self)
        return self.shared_created[key]

    def constant(self, value: np.ndarray, hint: str = "const") -> str:
        """A new initializer holding `value`; returns its (fresh) name."""
        name = self._graph.names.fresh(f"{self._anchor}/{hint}")
        self.initializers.append(from_array(np.asarray(value, order="C"), name))
        return name

    def _input(self, value, op_type: str) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, (np.ndarray, np.generic)):
            return self.constant(value, f"{op_type.lower()}_input")
        raise TypeError(f"input {value!r} to {op_type} is neither a tensor name, an array nor None")


def _caller_outside(path: str) -> str | None:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == path:
        frame = frame.f_back
    return None if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def as_outputs(result, root_outputs: Sequence[str]) -> list[str]:
    if isinstance(result, str):
        result = [result]
    if not isinstance(result, (list, tuple)) or not all(isinstance(r, str) or r is None for r in result):
        raise TypeError("a rule must return the replacement's output tensor name(s)")
    if all(r is None for r in result):
        raise TypeError("a rule must return at least one output tensor name")
    if len(result) != len([o for o in root_outputs if o]):
        raise TypeError(
            f"the rule returned {len(result)} output(s) but the matched root node has "
            f"{len([o for o in root_outputs if o])}"
        )
    return list(result)
