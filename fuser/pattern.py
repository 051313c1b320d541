"""Patterns written the way the graph reads: ``op.Relu(op.Conv(var("x"), const("w")))``.

A pattern is a tree rooted at the node a rule rewrites. Leaves are ``var`` (any tensor)
and ``const`` (a tensor whose value the model fixes); inner nodes are ``op.<OpType>(...)``
with optional attribute constraints and a name the rule uses to reach the matched node.

    op.Relu | op.LeakyRelu          alternatives for one node
    const("b", optional=True)       an optional input (Conv's bias); absent binds None
    op.Add(a, b)                    Add, Mul, Max, Min, ... match their operands in either order
    op.BatchNormalization(..., name="bn", training_mode=0)
                                    attribute constraint (a value, or a predicate)
    op.Concat(a, b, op.Relu(var("c"), optional=True))
                                    an optional node input: absent or matching

Patterns are checked when built: names must be unique per kind and a name used for a
node cannot also name a tensor.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

COMMUTATIVE_OPS = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal"})


class PatternError(ValueError):
    """A pattern that can never be matched as written (raised when it is built)."""


@dataclass(frozen=True)
class Var:
    """Any tensor; the same name used twice must bind the same tensor."""

    name: str
    optional: bool = False


@dataclass(frozen=True)
class Const:
    """A tensor whose value is fixed by the model (initializer, Constant, constant subgraph)."""

    name: str
    optional: bool = False


@dataclass(frozen=True)
class OpPattern:
    """One node: its op type(s), inputs in slot order, attribute constraints and binding name."""

    op_types: tuple[str, ...]
    inputs: tuple
    name: str
    domain: str = ""
    attrs: tuple = ()
    output: int = 0
    commutative: bool = False
    optional: bool = False

    @property
    def depth(self) -> int:
        return 1 + max((i.depth for i in self.inputs if isinstance(i, OpPattern)), default=0)

    def needs(self) -> tuple[tuple[tuple[str, ...], str], ...]:
        """(op types, domain) of each node below the root a match must have: a graph with no
        node of one of them cannot match the pattern anywhere."""
        found = []
        for child in self.inputs:
            if isinstance(child, OpPattern) and not child.optional:
                found.append((child.op_types, child.domain))
                found.extend(child.needs())
        return tuple(dict.fromkeys(found))

    def walk(self):
        yield self
        for child in self.inputs:
            if isinstance(child, OpPattern):
                yield from child.walk()
            else:
                yield child


def var(name: str, optional: bool = False) -> Var:
    return Var(name, optional)


def const(name: str, optional: bool = False) -> Const:
    return Const(name, optional)


@dataclass(frozen=True)
class OpBuilder:
    """``op.Conv`` before it is called with inputs; ``|`` makes alternatives."""

    op_types: tuple[str, ...]
    domain: str = ""

    def __or__(self, other: OpBuilder) -> OpBuilder:
        if not isinstance(other, OpBuilder):
            return NotImplemented
        if other.domain != self.domain:
            raise PatternError("alternatives must share one domain")
        return OpBuilder(self.op_types + other.op_types, self.domain)

    def __call__(
        self,
        *inputs,
        name: str | None = None,
        output: int = 0,
        commutative: bool | None = None,
        optional: bool = False,
        **attrs,
    ) -> OpPattern:
        for value in inputs:
            if not isinstance(value, (Var, Const, OpPattern)):
                raise PatternError(
                    f"input {value!r} of {self.op_types[0]} is not a pattern: use var(), const() or op.X(...)"
                )
        seen_optional = False
        for value in inputs:
            is_optional = getattr(value, "optional", False)
            if seen_optional and not is_optional:
                raise PatternError(f"{self.op_types[0]}: a required input follows an optional one")
            seen_optional = seen_optional or is_optional
        if commutative is None:
            commutative = len(inputs) == 2 and all(t in COMMUTATIVE_OPS for t in self.op_types)
        return OpPattern(
            op_types=self.op_types,
            inputs=tuple(inputs),
            name=name or self.op_types[0],
            domain=self.domain,
            attrs=tuple(sorted(attrs.items())),
            output=output,
            commutative=commutative,
            optional=optional,
        )


class _OpNamespace:
    """``op.Conv``, ``op.Relu``...; ``op.domain("com.microsoft").FusedConv`` for other domains."""

    def __init__(self, domain: str = ""):
        self._domain = domain

    def __getattr__(self, op_type: str) -> OpBuilder:
        if op_type.startswith("_"):
            raise AttributeError(op_type)
        return OpBuilder((op_type,), self._domain)

    def domain(self, domain: str) -> _OpNamespace:
        return _OpNamespace(domain)


op = _OpNamespace()


def validate(pattern: OpPattern) -> None:
    """Reject patterns whose names clash; called when a rule is defined."""
    if not isinstance(pattern, OpPattern):
        raise PatternError("a rule's pattern must be rooted at an op: op.X(...)")
    node_names: dict[str, OpPattern] = {}
    tensor_names: dict[str, object] = {}
    for item in pattern.walk():
        if isinstance(item, OpPattern):
            previous = node_names.get(item.name)
            if previous is not None and previous is not item and previous != item:
                raise PatternError(f"two different nodes are named '{item.name}'; give them distinct name= values")
            node_names[item.name] = item
        else:
            previous = tensor_names.get(item.name)
            if previous is not None and type(previous) is not type(item):
                raise PatternError(f"'{item.name}' is used both as var() and const()")
            tensor_names[item.name] = item
    clash = set(node_names) & set(tensor_names)
    if clash:
        raise PatternError(f"'{sorted(clash)[0]}' names both a node and a tensor")


@dataclass
class SourceLocation:
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def caller_location(depth: int = 2) -> SourceLocation:
    frame = sys._getframe(depth)
    return SourceLocation(frame.f_code.co_filename, frame.f_lineno)
