"""The rewrite loop: candidates by root op type, one rewrite at a time, to a fixed point.

The engine knows nothing about particular rules. For each graph scope it keeps a
worklist of nodes ordered by position; a node is tried against the rules whose pattern
is rooted at its op type, in rule order, and the first match that passes the engine's
safety checks and the rule's own (the `m.require` calls in its function) is applied. After
a rewrite only the touched neighbourhood goes back on the worklist.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from dataclasses import dataclass, field

from onnx import NodeProto

from fuser.context import Context, resolve_context
from fuser.errors import RewriteLimitExceeded, RuleError
from fuser.graph import SUBGRAPH_SLOT, Graph, node_fingerprint, paused_gc
from fuser.match import Decline, Match, NotACandidate, TypeInfo, find_matches, matches_where_it_may, may_match
from fuser.model import Model
from fuser.pattern import OpPattern
from fuser.progress import Progress, Ticker
from fuser.qdq import is_qdq_op, quantized_unit, quantizes
from fuser.rule import Builder, Change, Rule, as_outputs


@dataclass(slots=True)  # no dict per instance: a large model's log holds hundreds of thousands
class Rewrite:
    """One applied rewrite: which rule, where, what it replaced and what it created."""

    index: int
    rule: str
    scope: str
    matched: list[str]
    created: list[str]
    failure: str | None = None  # why blame left it out (blamed and dropped rewrites only)

    @property
    def key(self) -> tuple:
        """Identifies the rewrite across runs of the same rules on the same model."""
        return (self.rule, self.scope, tuple(self.matched))

    def to_dict(self) -> dict:
        fields = {
            "index": self.index,
            "rule": self.rule,
            "scope": self.scope,
            "matched": self.matched,
            "created": self.created,
        }
        return fields if self.failure is None else {**fields, "failure": self.failure}


@dataclass
class Opportunity:
    """A match a rule would rewrite (check mode)."""

    rule: str
    scope: str
    nodes: list[str]

    def to_dict(self) -> dict:
        return {"rule": self.rule, "scope": self.scope, "nodes": self.nodes}


@dataclass
class Advice:
    """A pattern an advisory rule found and left alone, with the reason for the user."""

    rule: str
    scope: str
    nodes: list[str]
    message: str

    def to_dict(self) -> dict:
        return {"rule": self.rule, "scope": self.scope, "nodes": self.nodes, "message": self.message}


@dataclass
class Declined:
    """A match a rule (or the engine's safety checks) refused, with the reason."""

    rule: str
    scope: str
    node: str
    reason: str
    nodes: list[str] = field(default_factory=list)
    source: str | None = None  # the rule's file:line

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "scope": self.scope,
            "node": self.node,
            "nodes": self.nodes,
            "reason": self.reason,
            "source": self.source,
        }


@dataclass
class EngineResult:
    rewrites: list[Rewrite] = field(default_factory=list)
    opportunities: list[Opportunity] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    skipped_rules: dict[str, str] = field(default_factory=dict)
    # skipped rules that need a newer opset and whose patterns match in the rewritten main graph
    need_newer_opset: list[str] = field(default_factory=list)
    advice: list[Advice] = field(default_factory=list)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """Rewrites made, per rule."""
        return dict(Counter(r.rule for r in self.rewrites))

    def opportunity_counts(self) -> dict[str, int]:
        """Rewrites a run that rewrites nothing (fuser.find_opportunities) found to make, per rule."""
        return dict(Counter(o.rule for o in self.opportunities))

    def unique_declines(self) -> list[Declined]:
        """Each decline once, though the worklist may revisit a match."""
        seen: dict[tuple, Declined] = {}
        for d in self.declined:
            seen.setdefault((d.rule, d.scope, tuple(d.nodes) or d.node, d.reason), d)
        return list(seen.values())


def _has_ops_for(graph: Graph, rule: Rule) -> bool:
    """Whether `graph` has the op types one of the rule's patterns needs: the root's and every
    required node's below it (a rotary embedding needs more than a Concat)."""
    return any(
        any(graph.nodes_of_type(t, pattern.domain) for t in pattern.op_types)
        and all(graph.has_op(types, domain) for types, domain in pattern.needs())
        for pattern in rule.alternatives
    )


# How often one phase runs again because inferring shapes anew taught it more.
PHASE_ROUNDS = 4
# A pass over the nodes below earlier changes names each rule's candidates (a look at the whole
# graph) when it visits at least 1/NOMINATE_ABOVE of the graph's nodes.
NOMINATE_ABOVE = 4
# A rewrite that stops reading one output of a node with several looks for that output's sole
# remaining reader only if the node has at most this many readers: the look lists them all.
SOLE_READER_SCAN_LIMIT = 64


class Engine:
    def __init__(
        self,
        model: Model,
        rules: list[Rule],
        *,
        max_rewrites: int | None = None,
        trace: bool = False,
        limit: int | None = None,
        vetoed: dict[tuple, str] | None = None,
        progress: Progress | None = None,
        context: Context | None = None,
    ):
        """limit: stop after this many rewrites (a prefix of the full run, for blame);
        vetoed: keys of rewrites (Rewrite.key) never to apply, each with why; progress: told the nodes visited;
        context: what the rules may know about the machine (default: this machine's, fuser/context.py)."""
        self.model = model
        self._visits = Ticker(progress, "rewrite")
        self.context = context if context is not None else resolve_context()
        self.trace = trace
        self.limit = limit
        self.vetoed = dict(vetoed or {})
        self._advised: set[tuple] = set()
        self._declined_keys: set[tuple] = set()
        self._swept: dict[tuple, int] = {}  # (scope graph, phase) -> rewrites logged when its sweeps last ran
        self.result = EngineResult()
        self._needing_newer_opset: list[Rule] = []  # skipped for the opset, with the op types to match
        opset = model.opsets.get("", 1)
        self.rules: list[Rule] = []
        for candidate in rules:
            if candidate.supports_opset(opset):
                self.rules.append(candidate)
            else:
                low, high = candidate.opsets
                supported = f"{low} and later" if high is None else f"{low} to {high}"
                self.result.skipped_rules[candidate.name] = (
                    f"the model uses opset {opset}; the rule supports {supported}"
                )
                if opset < low and _has_ops_for(model.graph, candidate):
                    self._needing_newer_opset.append(candidate)
        self._phases = sorted({r.phase for r in self.rules})
        self._by_root: dict[str, list[Rule]] = {}
        # (id(scope graph), op type) -> (the graph, its op_types_version, the running phase's
        # rules rooted at that op type with a pattern whose needed op types the scope has).
        self._rooted: dict[tuple[int, str], tuple[Graph, int, list[Rule]]] = {}
        # The running phase's patterns as (depth, root op types and domain, op types needed below
        # the root), and per scope the depth of the deepest that can match there (_reach).
        self._phase_patterns: list[tuple[int, tuple, tuple]] = []
        self._phase_advisories: list[Rule] = []  # the running phase's advisory rules
        self._reaches: dict[int, tuple[int, int]] = {}  # id(graph) -> (its op_types_version, reach)
        self._types = TypeInfo(lambda: model.to_proto(weights=False), seed=model.take_inferred_types())
        self._max_rewrites = max_rewrites
        # id(scope graph) -> (the graph, its op_types_version, {op types needed: in it}): the
        # answers change only when an op type appears in the scope or leaves it.
        self._present: dict[int, tuple[Graph, int, dict]] = {}
        # Whether the model quantizes anything (or a rewrite made it): a model that does not has
        # no quantized group to keep whole, and the check is skipped at every rewrite.
        self._quantized = any(quantizes(g) for g in model.graph.all_graphs())
        # During a pass over a whole scope: the nodes each rule with `candidates` is tried at, and
        # the nodes a rewrite of the pass touched, which every rule is tried at again.
        self._nominated: dict[int, set[int]] = {}  # id(rule) -> node ids
        self._released: set[int] = set()
        # Rules from outside fuser (rule files, plugins, Python), whose matched nodes are compared
        # before and after the rule runs: an edit in place would reach the output unlogged.
        self._unvetted = {id(r) for r in self.rules if not r.builtin}

    # ------------------------------------------------------------------ driving

    def run(self, apply: bool = True) -> EngineResult:
        with paused_gc():
            return self._run(apply)

    def _run(self, apply: bool) -> EngineResult:
        started = time.perf_counter()
        if self._max_rewrites is None:
            self._max_rewrites = 8 * self.model.node_count() + 1000
        scopes = [(self.model.graph, "main")]
        while scopes and not self._limit_reached():
            graph, scope = scopes.pop(0)
            self._run_scope(graph, scope, apply)
            for info in graph.nodes_with_subgraphs():
                for attr, graphs in info.subgraphs.items():
                    for index, sub in enumerate(graphs):
                        suffix = f"[{index}]" if len(graphs) > 1 else ""
                        scopes.append((sub, f"{scope}/{info.name or info.op_type}.{attr}{suffix}"))
        self._visits.finish()
        self.result.need_newer_opset = self._still_matching(self._needing_newer_opset)
        self.result.seconds = time.perf_counter() - started
        return self.result

    def _still_matching(self, skipped: list[Rule]) -> list[str]:
        """The names of the `skipped` rules whose patterns match somewhere in the main graph
        once the rewrite is done: a rule whose pattern another rule fused already (onnxruntime's
        RotaryEmbedding in place of the decomposed rotation) would find nothing after an upgrade.
        In check mode the graph is unchanged: a root some applicable rule would rewrite does not count."""
        graph = self.model.graph
        taken = {label for o in self.result.opportunities if o.scope == "main" for label in o.nodes}
        still = []
        for candidate in skipped:
            for pattern in candidate.alternatives:
                roots = (n for t in pattern.op_types for n in graph.nodes_of_type(t, pattern.domain))
                if any(
                    graph.node(n).label not in taken and next(find_matches(graph, pattern, n), None) is not None
                    for n in roots
                ):
                    still.append(candidate.name)
                    break
        return still

    def _run_scope(self, graph: Graph, scope: str, apply: bool) -> None:
        # A later phase's rewrites can give an earlier phase's rules work again (attention
        # fusion leaves a Reshape that simplification folds): the phases sweep again, each over
        # the nodes that other phases changed since it last ran, until a round changes nothing.
        changes: list[set[int]] = []  # the nodes each phase run changed, in run order
        seen_changes: dict[int, int] = {}  # phase -> how many entries of `changes` it has seen
        seen_rewrites: dict[int, int] = {}  # phase -> the rewrite count when it last ran
        inferred_at = 0  # how many rewrites the type table has seen
        for _ in range(PHASE_ROUNDS):
            round_start = len(self.result.rewrites)
            for phase in self._phases:
                if phase in seen_rewrites and seen_rewrites[phase] == len(self.result.rewrites):
                    continue  # nothing changed since this phase reached its fixed point
                seeds = set().union(*changes[seen_changes[phase] :]) if phase in seen_changes else None
                if len(self.result.rewrites) != inferred_at:
                    self._types.refresh()  # a later phase sees the shapes the earlier rewrites fixed
                    inferred_at = len(self.result.rewrites)
                self._enter_phase(phase)
                # Shapes inferred anew after a round of rewrites (a folded Reshape target fixes
                # the dims below it) can let the phase's rules do more: its fixed point includes them.
                # So can what its own sweeps change (dead code removed after a fold leaves a tensor
                # one reader): the next run looks at the nodes they touched.
                touched: set[int] = set()
                pass_seeds = seeds
                for _ in range(PHASE_ROUNDS):
                    before = len(self.result.rewrites)
                    swept = self._run_sweeps(graph, scope, apply, phase)
                    touched |= swept
                    touched |= self._run_phase(graph, scope, apply, None if pass_seeds is None else pass_seeds | swept)
                    swept = self._run_sweeps(graph, scope, apply, phase)
                    touched |= swept
                    if len(self.result.rewrites) == before or self._limit_reached():
                        break
                    inferred_at = len(self.result.rewrites)
                    # A rewrite can make a node far below it rewritable without touching it (a
                    # folded Shape makes constant what is computed from it), where a rule tried
                    # only the candidates it named as the pass started: named anew, they are
                    # tried again by every pass that does not cover the whole scope.
                    naming = [r for r in self.rules if r.phase == phase and r.candidates is not None]
                    learns = self._types.learns_more()
                    if not (learns or swept or naming):
                        break
                    if learns and seeds is None:
                        pass_seeds = None
                    else:
                        renamed = set().union(*(self._candidates(graph, r) for r in naming))
                        pass_seeds = swept | renamed | (seeds if learns else set())
                self._advise_scope(graph, scope, apply)
                changes.append(touched)
                seen_changes[phase] = len(changes)  # its own changes it has revisited already
                seen_rewrites[phase] = len(self.result.rewrites)
            if not apply or len(self.result.rewrites) == round_start or self._limit_reached():
                return

    def _enter_phase(self, phase: int) -> None:
        """Make `phase` the running one: its pattern rules by root op type, and its patterns
        as _reach weighs them."""
        self._by_root = {}
        self._rooted = {}
        # Advisory rules are not visited with the others: they look at the scope once the phase
        # has rewritten it (_advise_scope).
        rewriting = [c for c in self.rules if c.phase == phase and not c.advisory]
        self._phase_advisories = [c for c in self.rules if c.phase == phase and c.advisory]
        for candidate in rewriting:
            for op_type, _ in candidate.roots:
                if candidate not in self._by_root.get(op_type, ()):
                    self._by_root.setdefault(op_type, []).append(candidate)
        self._phase_patterns = [
            (max(pattern.depth, candidate.walks), (pattern.op_types, pattern.domain), needs)
            for candidate in rewriting
            for pattern, needs in zip(candidate.alternatives, candidate.needs)
        ]
        self._reaches = {}

    def _run_sweeps(self, graph: Graph, scope: str, apply: bool, phase: int) -> set[int]:
        """Run the phase's sweeps over the scope, unless nothing changed since they last did;
        returns the nodes their changes touched."""
        key = (id(graph), phase)
        if self._swept.get(key) == len(self.result.rewrites):
            return set()
        touched: set[int] = set()
        for candidate in self.rules:
            if candidate.sweep is None or candidate.phase != phase:
                continue
            try:
                changes = list(candidate.sweep(graph))
            except RuleError:
                raise
            except Exception as error:  # noqa: BLE001 - any crash in a rule is reported as that rule's bug
                raise RuleError(candidate, f"{type(error).__name__}: {error}", error) from error
            for change in changes:
                if not isinstance(change, Change):
                    raise RuleError(candidate, f"its sweep yielded {change!r}, not a fuser.Change")
                if self._limit_reached():
                    return touched
                touched |= self._apply_change(graph, scope, candidate, change, apply)
        self._swept[key] = len(self.result.rewrites)
        return touched

    def _apply_change(self, graph: Graph, scope: str, candidate: Rule, change: Change, apply: bool) -> set[int]:
        """Check one change a sweep proposes and, with apply, make it; returns the nodes to revisit."""
        nodes = [n for n in change.nodes if graph.has_node(n)]
        matched = (
            [graph.node(n).label for n in nodes] + [old for old, _ in change.redirects] + list(change.initializers)
        )
        created = [new for _, new in change.redirects] + [value.name for value in change.values]
        failure = self.vetoed.get((candidate.name, scope, tuple(matched))) if self.vetoed else None
        if failure is not None:
            self._record_decline(candidate, scope, matched, f"dropped: {failure}")
            return set()
        problem = _change_problem(graph, change)
        if problem is not None:
            if self.trace:
                self._record_decline(candidate, scope, matched, problem)
            return set()
        if not apply:
            self.result.opportunities.append(Opportunity(candidate.name, scope, matched))
            return set()
        touched: set[int] = set()
        graph.take_lost_readers()
        for old, new in change.redirects:
            touched.update(graph.op_consumers(old))
            graph.redirect(old, new)
            graph.remove_if_unused(old)
        if nodes:
            # Their producers lose consumers: a rule that wants a sole consumer may match now.
            producers = {graph.producer(i) for n in nodes for i in graph.node(n).inputs if i}
            touched.update(producers - set(nodes) - {None})
            # The readers of an output an initializer now holds read a constant.
            touched.update(c for value in change.values for c in graph.op_consumers(value.name))
            graph.replace_nodes(nodes, [], list(change.values), (), candidate.name)
        for name in change.initializers:
            graph.remove_if_unused(name)
        touched |= _sole_reader_gained(graph, graph.take_lost_readers())
        self._types.invalidate()
        self._log(Rewrite(len(self.result.rewrites), candidate.name, scope, matched, created))
        return {n for n in touched if graph.has_node(n)}

    def _run_phase(self, graph: Graph, scope: str, apply: bool, seeds: set[int] | None = None) -> set[int]:
        """Run the current phase's rules over every node of their root types, or over `seeds` and
        the nodes below them within the phase's pattern depth; returns the nodes its rewrites
        created or touched."""
        queue = _VisitQueue()
        queued: set[int] = set()
        touched_all: set[int] = set()

        def push(node_id: int, release: bool = True) -> None:
            if release:
                self._released.add(node_id)
            if node_id not in queued and graph.op_type_of(node_id) in self._by_root:
                queued.add(node_id)
                queue.push(graph.sort_key(node_id), node_id)

        self._nominated, self._released = {}, set()
        phase_rules = list({id(r): r for rules in self._by_root.values() for r in rules}.values())
        naming = [r for r in phase_rules if r.candidates is not None]
        if seeds is not None:
            present = {n for n in seeds if graph.has_node(n)}
            # Naming candidates takes a look at the whole graph: worth it when the pass covers
            # much of it (a fusion phase that changed every layer), not for a few nodes. The
            # nodes below the seeds include the seeds: enough of those settle it at once.
            wide = NOMINATE_ABOVE * len(present) >= graph.node_count()
            below = None if wide else self._downstream(graph, present)
            if wide or NOMINATE_ABOVE * len(below) >= graph.node_count():
                for rule in naming:
                    self._nominated[id(rule)] = self._candidates(graph, rule)
            # Once candidates are named, a visit tries a rule only at them and at the nodes of a
            # rule naming none: where there are none of either (an earlier phase run again after
            # a fusion phase changed every layer), the nodes below are not even listed.
            worth = self._maybe_tried(graph, phase_rules) if self._nominated else None
            if worth is None or worth:
                if below is None:
                    below = self._downstream(graph, present)
                for node_id in below if worth is None or len(below) <= len(worth) else worth & below:
                    if not self._nominated or self._tried_at(graph, node_id):
                        push(node_id, release=False)
        else:
            starts: set[int] = set()  # each node once, however many rules are rooted at its type
            for rule in phase_rules:
                if rule.candidates is not None:
                    self._nominated[id(rule)] = nominated = self._candidates(graph, rule)
                    starts |= nominated
                    continue
                for root_type, domain in rule.roots:
                    # Not where none of its patterns can match: one needs an op type the scope lacks.
                    if rule in self._rules_at(graph, root_type):
                        starts.update(graph.nodes_of_type(root_type, domain))
            for node_id in starts:
                push(node_id, release=False)
        queue.settle()
        # A rewrite re-queues the readers of every tensor its replacement reads; in a deep model
        # a tensor every layer reads (a mask, a rotary cache) puts all earlier layers back at
        # the front of the queue after each layer's rewrite. Touched nodes behind the current
        # one, and the nodes below them, wait until the queue drains: each is looked at once
        # however many rewrites touched it. A touched node ahead is looked below at every
        # rewrite: positions need not be topological (an input listed out of order, a
        # replacement reading a later tensor), so what lies below it may sort earlier and have
        # been visited already; such nodes wait behind too.
        behind: set[int] = set()
        while not self._limit_reached():
            if not queue:
                if not behind:
                    break
                for node_id in self._downstream(graph, {n for n in behind if graph.has_node(n)}):
                    push(node_id)
                behind.clear()
                continue
            position, node_id = queue.pop()
            queued.discard(node_id)
            if not graph.has_node(node_id):
                continue
            self._visits.tick(len(queue) + len(behind))
            touched = self._visit(graph, scope, node_id, apply)
            if touched:  # most visits change nothing
                touched_all.update(touched)
                ahead = {n for n in touched if graph.sort_key(n) >= position}
                earlier = touched - ahead
                for other in self._downstream(graph, ahead):
                    if graph.sort_key(other) >= position:
                        push(other)
                    else:
                        earlier.add(other)
                behind |= earlier
                self._released |= earlier
        self._nominated, self._released = {}, set()
        return touched_all

    def _tried_at(self, graph: Graph, node_id: int) -> bool:
        """Whether a visit to `node_id` would try a rule: one rooted at its op type that can
        match in `graph` and names no candidates, or names it."""
        for rule in self._rules_at(graph, graph.node(node_id).op_type):
            nominated = self._nominated.get(id(rule))
            if nominated is None or node_id in nominated:
                return True
        return False

    def _maybe_tried(self, graph: Graph, phase_rules: list[Rule]) -> set[int]:
        """The nodes _tried_at may find a rule for, and maybe more: the candidates named,
        and the nodes of the root types of the rules naming none."""
        found: set[int] = set().union(*self._nominated.values())
        # By op type alone, in any domain, as _tried_at and _visit look rules up.
        everywhere = {
            root_type for rule in phase_rules if id(rule) not in self._nominated for root_type, _ in rule.roots
        }
        for domain, op_type in graph.op_type_counts():
            if op_type in everywhere:
                found.update(graph.nodes_of_type(op_type, domain))
        return found

    def _candidates(self, graph: Graph, rule: Rule) -> set[int]:
        """The nodes of `graph` a pass over all of it tries `rule` at (Rule.candidates)."""
        try:
            return {node_id for node_id in rule.candidates(graph) if graph.has_node(node_id)}
        except RuleError:
            raise
        except Exception as error:  # noqa: BLE001 - any crash in a rule is reported as that rule's bug
            raise RuleError(rule, f"its candidates raised {type(error).__name__}: {error}", error) from error

    def _visit(self, graph: Graph, scope: str, node_id: int, apply: bool) -> set[int]:
        op_type = graph.node(node_id).op_type
        for candidate in self._rules_at(graph, op_type):
            nominated = self._nominated.get(id(candidate))
            if nominated is not None and node_id not in nominated and node_id not in self._released:
                continue
            patterns = _fitting_patterns(graph, candidate, node_id, self._present)
            if not patterns:  # what most tries of most nodes end with
                continue
            for match in self._matches(graph, scope, candidate, node_id, patterns):
                try:
                    keep, escaping = self._checked_interior(graph, candidate, match)
                    builder = Builder(graph, match.root.name or candidate.name, rule=candidate)
                    try:
                        outputs = as_outputs(self._build(candidate, match, builder), match.root.outputs)
                    except Decline:
                        _require_no_escape(escaping, {})  # the interior's reason comes first
                        raise
                    if match.absorbed:
                        # Nodes the rule walked to beyond its pattern are removed with the match,
                        # so they must pass the same check; the rewrite is known by all its nodes.
                        keep, escaping = self._interior_check(graph, candidate, match)
                        if self._vetoed(candidate, scope, match):
                            continue
                    _require_no_escape(escaping, builder.stand_ins)
                    if self._quantized:
                        _require_unquantized(graph, candidate, match, keep, builder.nodes)
                except Decline as decline:
                    if self.trace and not isinstance(decline, NotACandidate):
                        self._decline(candidate, scope, match, str(decline))
                    continue
                except RuleError:
                    raise
                except Exception as error:  # noqa: BLE001 - any crash in a rule is reported as that rule's bug
                    raise RuleError(candidate, f"{type(error).__name__}: {error}", error) from error
                try:
                    touched = self._apply(graph, scope, candidate, match, builder, outputs, keep, commit=apply)
                except Decline as decline:
                    if self.trace:
                        self._decline(candidate, scope, match, str(decline))
                    continue
                if not apply:  # check mode lists what optimize would do: the same checks passed
                    self.result.opportunities.append(Opportunity(candidate.name, scope, [n.label for n in match.nodes]))
                return touched
        return set()

    def _build(self, candidate: Rule, match: Match, builder: Builder | None):
        """What the rule builds for `match` (an advisory rule: its message); RuleError if it
        changed a matched or absorbed node in place."""
        if id(candidate) not in self._unvetted:
            return candidate.build(match, builder)
        match.watched = {n.id: node_fingerprint(n.proto) for n in match.nodes}
        try:
            return candidate.build(match, builder)
        finally:
            watched, match.watched = match.watched, None
            for node_id, was in watched.items():
                node = match.graph.node(node_id)
                if node_fingerprint(node.proto) != was:
                    raise RuleError(
                        candidate,
                        f"it changed node '{node.label}' in place: the matched nodes are the model as "
                        "read, which the check compares against; build the replacement with the Builder",
                    )

    def _rules_at(self, graph: Graph, op_type: str) -> list[Rule]:
        """The running phase's rules rooted at `op_type` that can match in `graph`: a pattern of
        theirs rooted there needs no op type the scope lacks. Most rules need one (a Conv, a
        Softmax) that most models lack; asked per node, leaving them out is most of a visit."""
        key = (id(graph), op_type)
        version = graph.op_types_version
        cached = self._rooted.get(key)
        if cached is None or cached[0] is not graph or cached[1] != version:
            known = _present_in(graph, self._present)
            rules = [
                candidate
                for candidate in self._by_root.get(op_type, ())
                if any(
                    op_type in pattern.op_types and all(_present(graph, need, known) for need in needs)
                    for pattern, needs in zip(candidate.alternatives, candidate.needs)
                )
            ]
            cached = self._rooted[key] = (graph, version, rules)
        return cached[2]

    def _decline(self, candidate: Rule, scope: str, match: Match, reason: str) -> None:
        """Record a decline once: later sweeps and re-queued nodes revisit the same matches."""
        self._record_decline(candidate, scope, [n.label for n in match.nodes], reason, match.root.label)

    def _record_decline(self, candidate: Rule, scope: str, nodes: list[str], reason: str, node: str = "") -> None:
        key = (candidate.name, scope, tuple(nodes), reason)
        if key in self._declined_keys:
            return
        self._declined_keys.add(key)
        source = str(candidate.source) if candidate.source else None
        # A sweep's change whose nodes are gone by the time it is checked names nothing.
        where = node or (nodes[0] if nodes else "")
        self.result.declined.append(Declined(candidate.name, scope, where, reason, nodes, source))

    def _vetoed(self, candidate: Rule, scope: str, match: Match) -> bool:
        failure = self.vetoed.get((candidate.name, scope, tuple(n.label for n in match.nodes))) if self.vetoed else None
        if failure is None:
            return False
        self._decline(candidate, scope, match, f"dropped: {failure}")
        return True

    def _advise_scope(self, graph: Graph, scope: str, apply: bool) -> None:
        """The running phase's advisory rules, at every node of their root types, once the phase
        has reached its fixed point: what they report is what its rewrites left (not a pattern a
        later rewrite of the phase fused), and they add nothing to its passes, where a pattern
        deeper than the rewriting rules' had every rewrite revisit the nodes further below it
        (the residual advisory was 9% of the instructions of the rewrite of a ResNet stack).
        In check mode nothing is rewritten: a node some rule would rewrite is not advised on."""
        if not self._phase_advisories:
            return
        taken = set() if apply else {label for o in self.result.opportunities if o.scope == scope for label in o.nodes}
        for candidate in self._phase_advisories:
            roots = {n for op_type, domain in candidate.roots for n in graph.nodes_of_type(op_type, domain)}
            for node_id in sorted(roots, key=graph.sort_key):
                if graph.node(node_id).label not in taken:
                    self._advise_at(graph, scope, candidate, node_id)

    def _matches(self, graph: Graph, scope: str, candidate: Rule, node_id: int, patterns: list[OpPattern]):
        """The matches of `patterns` rooted at `node_id` that no blame has vetoed."""
        for pattern, bindings in _guarded_matches(graph, candidate, node_id, patterns):
            match = Match(graph, pattern, bindings, self._types, self.context)
            if not self._vetoed(candidate, scope, match):
                yield match

    def _checked_interior(self, graph: Graph, candidate: Rule, match: Match) -> tuple[set[int], dict[str, str]]:
        """_inputs_check, then _interior_check's nodes to keep and escaping outputs."""
        if len(match.bindings.nodes) == 1:  # a lone root has no interior to check
            return set(), {}
        self._inputs_check(match)
        return self._interior_check(graph, candidate, match)

    def _advise_at(self, graph: Graph, scope: str, candidate: Rule, node_id: int) -> None:
        patterns = _fitting_patterns(graph, candidate, node_id, self._present)
        for match in self._matches(graph, scope, candidate, node_id, patterns):
            try:
                _require_no_escape(self._checked_interior(graph, candidate, match)[1], {})
                self._advise(candidate, scope, match)
            except Decline as decline:
                if self.trace and not isinstance(decline, NotACandidate):
                    self._decline(candidate, scope, match, str(decline))
            except RuleError:
                raise
            except Exception as error:  # noqa: BLE001 - any crash in a rule is reported as that rule's bug
                raise RuleError(candidate, f"{type(error).__name__}: {error}", error) from error

    def _advise(self, candidate: Rule, scope: str, match: Match) -> None:
        key = (candidate.name, scope, match.root.id)  # one note per root, however many ways it matched
        if key in self._advised:
            return
        self._advised.add(key)
        nodes = [n.label for n in match.nodes]
        message = self._build(candidate, match, None)
        if not isinstance(message, str):
            raise RuleError(candidate, "an advisory rule must return its message as a string")
        self.result.advice.append(Advice(candidate.name, scope, nodes, message))

    def _limit_reached(self) -> bool:
        return self.limit is not None and len(self.result.rewrites) >= self.limit

    # ----------------------------------------------------------------- applying

    def _inputs_check(self, match: Match) -> None:
        """A tensor bound by var()/const() must come from outside the match: the matched
        nodes are removed, so a replacement reading one of their outputs would dangle."""
        interior = {o for n in match.nodes if n.id != match.root.id for o in n.output_names if o}
        for name, tensor in match.bindings.tensors.items():
            if tensor in interior:
                raise Decline(f"'{name}' is bound to '{tensor}', which the match itself computes")

    def _interior_check(self, graph: Graph, candidate: Rule, match: Match) -> tuple[set[int], dict[str, str]]:
        """Matched nodes other than the root must feed only the match, unless the rule keeps
        them (shared_interior) or its replacement stands in for their outputs (checked once
        it is built). Returns the nodes to keep and {escaping output: why it may not go}."""
        matched = set(match.node_ids)
        keep: set[int] = set()
        escaping: dict[str, str] = {}
        for info in match.nodes:
            if info.id == match.root.id:
                continue
            for output in info.output_names:
                if not output:
                    continue
                for consumer, slot in graph.consumers(output):
                    if consumer in matched and slot != SUBGRAPH_SLOT:
                        continue
                    if candidate.shared_interior:
                        keep.add(info.id)
                        break
                    where = "used outside the match" if graph.has_node(consumer) else "a graph output"
                    escaping.setdefault(output, f"'{output}' (output of {info.name or info.op_type}) is {where}")
        # A kept node still needs the matched nodes it reads from.
        pending = list(keep)
        while pending:
            node_id = pending.pop()
            for name in graph.node(node_id).inputs:
                producer = graph.producer(name) if name else None
                if producer in matched and producer != match.root.id and producer not in keep:
                    keep.add(producer)
                    pending.append(producer)
        return keep, escaping

    def _apply(
        self,
        graph: Graph,
        scope: str,
        candidate: Rule,
        match: Match,
        builder: Builder,
        outputs: list[str],
        keep: set[int],
        commit: bool = True,
    ) -> set[int]:
        """Check the replacement and, with commit, put it in the graph; returns the nodes it created or changed."""
        root = match.root
        root_outputs = [o for o in root.output_names if o]
        removed = [i for i in match.node_ids if i not in keep]
        removed_outputs = {o for i in removed for o in graph.node(i).output_names if o}
        for interior, tensor in builder.stand_ins.items():
            if interior not in removed_outputs or interior in root_outputs:
                raise RuleError(candidate, f"it stands in for '{interior}', which no removed interior node computes")
            root_outputs.append(interior)
            outputs = [*outputs, tensor]
        produced = {o for node in builder.nodes for o in node.output[:]}
        created_initializers = {t.name for t in builder.initializers}
        for old, new in zip(root_outputs, outputs):
            if new is None:
                if graph.consumers(old):
                    raise Decline(f"'{old}', which the replacement drops, is still used")
                continue
            if new in produced or new in created_initializers:
                continue
            if new == old:
                raise RuleError(candidate, f"the replacement returns '{old}' unchanged")
            if new in removed_outputs:
                raise RuleError(candidate, f"the replacement returns '{new}', which the rewrite removes")
            if not _visible(graph, new):
                raise RuleError(candidate, f"the replacement returns '{new}', which does not exist")
        rename: dict[str, str] = {}
        redirects: list[tuple[str, str]] = []
        dropped = {old for old, new in zip(root_outputs, outputs) if new is None}
        root_outputs = [o for o in root_outputs if o not in dropped]
        outputs = [o for o in outputs if o is not None]
        for old, new in zip(root_outputs, outputs):
            if new in produced and new not in rename:
                rename[new] = old
            elif graph.is_graph_output(old) or any(s == SUBGRAPH_SLOT for _, s in graph.consumers(old)):
                # The name must survive as it is: copy the value into it.
                builder.nodes.append(_identity(rename.get(new, new), old, builder, graph))
            else:
                redirects.append((old, new))
        for node in builder.nodes:
            for index, name in enumerate(node.input):
                if name in rename:
                    node.input[index] = rename[name]
            for index, name in enumerate(node.output):
                if name in rename:
                    node.output[index] = rename[name]
        if _same_nodes(builder.nodes, [graph.node(i).proto for i in removed]):
            raise Decline("the replacement is identical to the match")
        # The new nodes' tensors, read from protobuf once (each read makes new strings).
        read_by_new = [i for node in builder.nodes for i in node.input[:] if i]
        produced = {o for node in builder.nodes for o in node.output[:]}
        self._check_replacement(
            graph,
            candidate,
            removed,
            read_by_new,
            produced | created_initializers,
            produced,
            root_outputs,
            redirected={o for o, _ in redirects},
        )
        if not commit:
            return set()
        # The graph changes only once every check has passed; new initializers come first,
        # as a replacement may be one of them (a folded constant) that consumers now read.
        for tensor in builder.initializers:
            graph.add_initializer(tensor)
        for old, new in redirects:
            graph.redirect(old, new)
        # Consumers now reading another tensor (a folded constant, say) may match rules anew.
        redirected_readers = {c for _, new in redirects for c in graph.op_consumers(new)}
        if candidate.emits:
            for domain in {node.domain for node in builder.nodes} & set(candidate.emits):
                self.model.require_opset(domain, candidate.emits[domain])
        matched_names = [n.label for n in match.nodes]
        # A tensor the replacement reads is still read: its sole reader, if any, is new and visited anyway.
        read_by_new = set(read_by_new)
        neighbours = {c for i in read_by_new for c in graph.op_consumers(i)}
        graph.take_lost_readers()  # whatever earlier changes left there has been looked at
        created = graph.replace_nodes(removed, builder.nodes, [], graph.sort_key(root.id), candidate.name)
        created_nodes = [graph.node(i) for i in created]
        self._quantized = self._quantized or any(is_qdq_op(n.op_type, n.domain) for n in created_nodes)
        graph.shared.update({key: rename.get(name, name) for key, name in builder.shared_created.items()})
        self._types.invalidate(produced=[o for n in created_nodes for o in n.output_names])
        rewrite = Rewrite(
            index=len(self.result.rewrites),
            rule=candidate.name,
            scope=scope,
            matched=matched_names,
            created=[n.label for n in created_nodes],
        )
        self._log(rewrite)
        freed = _sole_reader_gained(graph, graph.take_lost_readers() - read_by_new)
        touched = set(created) | neighbours | redirected_readers | freed
        return {n for n in touched if graph.has_node(n)}

    def _log(self, rewrite: Rewrite) -> None:
        self.result.rewrites.append(rewrite)
        if len(self.result.rewrites) > self._max_rewrites:
            recent = Counter(r.rule for r in self.result.rewrites[-50:])
            names = ", ".join(f"'{n}'" for n, _ in recent.most_common(3))
            raise RewriteLimitExceeded(
                f"no fixed point after {self._max_rewrites} rewrites; rules {names} keep rewriting "
                "each other's output (please report this with the model attached)"
            )

    def _check_replacement(
        self,
        graph: Graph,
        candidate: Rule,
        removed: list[int],
        read: list[str],
        known: set[str],
        produced: set[str],
        root_outputs: list[str],
        redirected: set[str],
    ) -> None:
        """The replacement reads only tensors it makes (`known`: its nodes' outputs, `produced`,
        and its initializers) or that exist and stay, and makes every root output still used."""
        vanishing = {o for i in removed for o in graph.node(i).output_names if o} - produced
        for name in read:
            if name in known:
                continue
            if name in vanishing:
                raise RuleError(candidate, f"the replacement reads '{name}', which it removes")
            if not _visible(graph, name):
                raise RuleError(candidate, f"the replacement reads '{name}', which does not exist")
        missing = [o for o in root_outputs if o not in produced and o not in redirected and graph.consumers(o)]
        if missing:
            raise RuleError(candidate, f"the replacement does not produce '{missing[0]}'")

    def _downstream(self, graph: Graph, start: set[int]) -> set[int]:
        """`start` and the op nodes below it up to the depth of the running phase's deepest
        pattern that can match in `graph` (_reach): a rule rooted further down cannot see the change."""
        seen = set(start)
        frontier = set(start)
        for _ in range(self._reach(graph)):
            following = set()
            for node_id in frontier:
                following |= graph.op_successors(node_id) - seen
            seen |= following
            frontier = following
        return seen

    def _reach(self, graph: Graph) -> int:
        """The depth of the running phase's deepest pattern that can match in `graph`: one whose
        root and needed op types it has. A pattern that needs an op type the scope lacks cannot
        match below a change; a rewrite that brings the type in changes the answer, and the
        nodes below it are looked at as deep as the pattern then reaches."""
        version = graph.op_types_version
        known = self._reaches.get(id(graph))
        if known is not None and known[0] == version:
            return known[1]
        reach = max(
            (
                depth
                for depth, root, needs in self._phase_patterns
                if graph.has_op(*root) and all(graph.has_op(*need) for need in needs)
            ),
            default=0,
        )
        self._reaches[id(graph)] = (version, reach)
        return reach


class _VisitQueue:
    """The nodes a pass visits, smallest graph position first. A pass starts with many nodes
    and pushes few more: those it starts with are sorted once (settle) and read in order, the
    later ones go on a heap, so most visits take no heap operation."""

    def __init__(self) -> None:
        self._run: list[tuple[tuple, int]] = []
        self._next = 0  # the position in _run of its first entry not yet popped
        self._heap: list[tuple[tuple, int]] = []

    def push(self, position: tuple, node_id: int) -> None:
        heapq.heappush(self._heap, (position, node_id))

    def settle(self) -> None:
        """Move what has been pushed so far into the sorted run."""
        self._run = sorted(self._run[self._next :] + self._heap)
        self._next, self._heap = 0, []

    def pop(self) -> tuple[tuple, int]:
        run, heap = self._run, self._heap
        if self._next < len(run) and (not heap or run[self._next] <= heap[0]):
            self._next += 1
            return run[self._next - 1]
        return heapq.heappop(heap)

    def __len__(self) -> int:
        return len(self._run) - self._next + len(self._heap)


def _same_nodes(nodes: list[NodeProto], others: list[NodeProto]) -> bool:
    """Whether two lists of nodes compute the same, in any order. Attributes are serialized only
    when the rest agrees: almost every replacement differs in its op types or tensors."""

    def wiring(node: NodeProto) -> tuple:
        return node.domain or "", node.op_type, tuple(node.input[:]), tuple(node.output[:])

    def signature(node: NodeProto) -> tuple:
        return (*wiring(node), tuple(a.SerializeToString() for a in node.attribute))

    if len(nodes) != len(others) or sorted(map(wiring, nodes)) != sorted(map(wiring, others)):
        return False
    return sorted(map(signature, nodes)) == sorted(map(signature, others))


def _fitting_patterns(graph: Graph, candidate: Rule, node_id: int, present: dict) -> list[OpPattern]:
    """The rule's patterns whose root and required producers fit the node (may_match), with a
    crash reported as the rule's bug. `present` caches which op types the graph has: a pattern
    needing one it lacks is not tried (the node that would complete it is new when it comes,
    and the engine revisits the nodes below a new node)."""
    fitting = []
    known = None
    for pattern, needs in zip(candidate.alternatives, candidate.needs):
        if needs:
            if known is None:
                known = _present_in(graph, present)
            if not all(_present(graph, need, known) for need in needs):
                continue
        try:
            if may_match(graph, pattern, node_id):
                fitting.append(pattern)
        except Exception as error:  # noqa: BLE001
            raise RuleError(candidate, f"its pattern raised {type(error).__name__}: {error}", error) from error
    return fitting


def _guarded_matches(graph: Graph, candidate: Rule, node_id: int, patterns: list[OpPattern]):
    """(pattern, bindings) for every match of each of `patterns` (_fitting_patterns), with a
    crash in its attribute predicates reported as the rule's bug."""
    for pattern in patterns:
        matches = matches_where_it_may(graph, pattern, node_id)
        while True:
            try:
                yield pattern, next(matches)
            except StopIteration:
                break
            except Exception as error:  # noqa: BLE001
                raise RuleError(candidate, f"its pattern raised {type(error).__name__}: {error}", error) from error


def _present_in(graph: Graph, present: dict) -> dict:
    """The cache of `graph`'s answers to has_op, while its set of op types is the same."""
    version = graph.op_types_version
    cached = present.get(id(graph))
    if cached is None or cached[0] is not graph or cached[1] != version:
        cached = present[id(graph)] = (graph, version, {})
    return cached[2]


def _present(graph: Graph, need: tuple[tuple[str, ...], str], known: dict) -> bool:
    found = known.get(need)
    if found is None:
        found = known[need] = graph.has_op(*need)
    return found


def _change_problem(graph: Graph, change: Change) -> str | None:
    """Why a sweep's change would be unsafe, or None: what goes must be unused once it has gone."""
    removed = set(change.nodes)
    held = {value.name for value in change.values}
    if len(held) != len(change.values):
        return "two of its initializers have the same name"
    outputs = set()
    for node_id in change.nodes:
        if not graph.has_node(node_id):
            return f"node {node_id} is not in this graph"
        info = graph.node(node_id)
        for output in info.outputs:
            outputs.add(output)
            if output and graph.is_graph_output(output):
                return f"'{output}' (output of {info.label}) is a graph output"
            if output in held:
                continue
            for consumer in graph.op_consumers(output) if output else ():
                if consumer not in removed:
                    return f"'{output}' (output of {info.label}) is read by {graph.node(consumer).label}, which stays"
    for name in held - outputs:
        return f"the initializer '{name}' is named after no output of the nodes it replaces"
    for old, new in change.redirects:
        for name in (old, new):
            if graph.initializer(name) is None or not graph.defines(name):
                return f"'{name}' is not an initializer of this graph (a graph input may override it)"
        if old == new:
            return f"'{old}' would read itself"
        if graph.is_graph_output(old):
            return f"'{old}' is a graph output, whose name must survive"
        if any(slot == SUBGRAPH_SLOT for _, slot in graph.consumers(old)):
            return f"'{old}' is read inside a subgraph, where it cannot be renamed"
    for name in change.initializers:
        if graph.initializer(name) is None or not graph.defines(name):
            return f"'{name}' is not an initializer of this graph (a graph input may override it)"
        if graph.consumers(name):
            return f"'{name}' is still read"
    return None


def _require_no_escape(escaping: dict[str, str], stand_ins: dict[str, str]) -> None:
    """Decline when an interior output used outside the match has nothing standing in for it."""
    for output, reason in escaping.items():
        if output not in stand_ins:
            raise Decline(reason)


def _require_unquantized(
    graph: Graph, candidate: Rule, match: Match, keep: set[int], replacement: list[NodeProto]
) -> None:
    """Decline a rewrite that would replace the float operator of a quantized (QDQ) group."""
    replaced = (n for n in match.node_ids if n not in keep)
    reason = quantized_unit(graph, replaced, replacement, exact=candidate.exact)
    if reason is not None:
        raise Decline(reason)


def _visible(graph: Graph | None, name: str) -> bool:
    while graph is not None:
        if graph.defines(name):
            return True
        graph = graph.outer
    return False


def _sole_reader_gained(graph: Graph, lost_readers: set[str]) -> set[int]:
    """The nodes to look at again when removed nodes no longer read `lost_readers`: a tensor
    left with one reader may now be fused into it (a rule wanting its producer's sole consumer),
    so that reader and the tensor's producer are revisited.

    Tensors still read by several are not: a weight shared by thousands of nodes would put them
    all back at every rewrite. Their readers are not even listed unless the producer has several
    outputs (one of a Split's may have one reader while the node has many) and few readers."""
    revisit: set[int] = set()
    for tensor in lost_readers:
        bound = graph.readers_at_most(tensor)
        producer = graph.producer(tensor)
        if not bound and producer is None:  # gone with the rewrite, as a folded weight is, or unread
            continue
        single_output = producer is None or len(graph.node(producer).outputs) == 1
        if bound > 1 and (single_output or bound > SOLE_READER_SCAN_LIMIT):
            continue
        readers = graph.op_consumers(tensor)
        if len(readers) <= 1:
            revisit.update(readers)
            if producer is not None:
                revisit.add(producer)
    return revisit


def _identity(source: str, target: str, builder: Builder, graph: Graph):
    import onnx

    return onnx.helper.make_node("Identity", [source], [target], name=graph.names.fresh(f"{target}/identity"))
