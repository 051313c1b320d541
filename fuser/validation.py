"""onnx's full check of a model as it is read, and the types its shape inference finds.

A model passes onnx's full check (structure, then a strict type and shape inference) before
anything comes of it, so that a broken file is an input error and not a rule's failure. That
inference is made with data propagation, as the rewrite's own is, and its types are the
rewrite's first table (InferredTypes), so the rewrite need not infer the whole graph again.

onnx's checker and shape inference hold Python's lock while they run, and on a large graph
they take longer than building fuser's graph of it (1.6 and 2.6 s against 1.2 and 1.6 s for
the 100k-node MLP and ResNet stacks of `bench/scale.py`). So a large model is checked in a
child process forked once the file is parsed, while this one builds the graph and starts the
rewrite; the child leaves the verdict and the types in a file and exits. A fork is made only
where it is safe and pays: on Linux, from a process running no other thread, for a model of
CHILD_NODES nodes or more. Where no second core or not the memory the two processes would hold
together is available, this process waits for the child before it builds the graph: the
check's memory then goes back whole when the child exits, where checking here left the
allocator holding some of it through the rewrite (0.3 GB more at the peak for a 300k-node
stack, 0.55 GB for a million nodes). Anywhere else the check runs here, first.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import threading
from typing import IO

import onnx
from onnx import ModelProto

from fuser.errors import InputError
from fuser.graph import all_graph_protos, topological_positions, valueless_long_vectors, weightless_model
from fuser.match import InferredTypes, inferred_types
from fuser.skim import infer_serialized

# A model with this many nodes (all scopes) or more is checked in a child process. Below it,
# forking (a copy of this process's page tables, a new interpreter's exit) costs more than
# the overlap gains: the 10k-node MLP stack's check takes 0.2 s.
CHILD_NODES = 20_000
# The child holds the check's memory while this process builds the graph (it exits when done,
# its outcome left in a file): what the check adds at its peak (a skeleton, onnx's two parses
# of it, the inferred model and its types: 1.8 GB for the million-node MLP stack, 0.18 and 0.33
# GB for the 100k-node stacks) and what the graph then adds here (3.4 GB for the million
# nodes), per node. On a machine without that much memory available this process waits for
# the child before it builds the graph, so that the two never hold memory together.
CHILD_BYTES_PER_NODE = 2_000
GRAPH_BYTES_PER_NODE = 4_000
# The cores this process may use (None: the machine's); a worker of `fuser optimize -j N` is
# given its share. The child gains only with a core of its own beside this process's.
CORES: int | None = None

_FAILURES = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError, RuntimeError)


class Validation:
    """The check of one model read from `path`, started when made: `verdict()` raises
    InputError for a model the check refuses, `take_types()` gives the types its inference
    found (None when the inference could not serve the rewrite), once."""

    def __init__(self, model: ModelProto, path, apart: bool = True) -> None:
        """apart: check a large model in a child process where that is safe (see above)."""
        self._path = path
        self._outcome: tuple[str, object, Exception | None] | None = None
        self._wants_types = True
        self._child: tuple[int, IO[bytes]] | None = None  # (pid, the file it writes its outcome to)
        nodes = _nodes(model) if apart else 0
        beside = False
        if apart and _may_fork(nodes):
            beside = _room_beside(nodes)  # asked before the child's check takes memory
            self._child = _fork_check(model)
        self._model = model if self._child is not None else None  # to check here should the child fail
        if self._child is None:
            self._outcome = _check(model)
        elif not beside:
            self._outcome = self._collect()

    def verdict(self) -> None:
        """Return once the check passed (waiting for the child, if it still runs); InputError if it failed."""
        if self._outcome is None:
            self._outcome = self._collect()
        kind, value, cause = self._outcome
        if kind == "invalid":
            raise InputError(f"{self._path}: invalid ONNX model: {value}") from cause

    def take_types(self) -> InferredTypes | None:
        """The types, once the check passed; later calls give None."""
        self.verdict()
        kind, types, cause = self._outcome
        self._outcome = (kind, None, cause)
        return types

    def gave_no_types(self) -> bool:
        """Whether the check is done and has no types to give (any more)."""
        return self._outcome is not None and self._outcome[1] is None

    def forget_types(self) -> None:
        """Nobody will take the types: drop them, now or as they come."""
        self._wants_types = False
        if self._outcome is not None and self._outcome[0] != "invalid":  # an invalid one's is the reason
            self._outcome = (self._outcome[0], None, self._outcome[2])

    def close(self) -> None:
        """Stop and reap the child, if it still runs (the load failed, or was interrupted)."""
        if self._child is None:
            return
        pid, outcome = self._child
        self._child = None
        self._model = None
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        outcome.close()

    def __del__(self) -> None:
        self.close()

    def _collect(self) -> tuple[str, object, Exception | None]:
        pid, outcome = self._child
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            status = -1
        except BaseException:  # interrupted while waiting (SIGTERM to this process alone): the child goes too
            self.close()
            raise
        self._child = None
        model, self._model = self._model, None
        with outcome:
            outcome.seek(0)
            try:
                kind, value = pickle.load(outcome) if status == 0 else (None, None)
            except (EOFError, pickle.UnpicklingError):
                kind = None
            if kind is None:  # the child died before it told (killed when memory ran out): check here
                return _check(model)
            if kind != "types":
                return kind, value, None
            # The types follow the verdict, read only if wanted.
            return kind, (_interned(pickle.load(outcome)) if self._wants_types else None), None


def _check(model: ModelProto, disposable: bool = False) -> tuple[str, object, Exception | None]:
    """("types", InferredTypes or None, None) for a valid model; ("invalid", the error's first
    line, the error) for an invalid one. disposable: `model` may be changed (in the child, which
    has no use for it after the check: it may already be the skeleton when the check fails)."""
    try:
        return "types", checked_inference(model, disposable), None
    except _FAILURES as error:
        if valid_for_onnxruntime(model, error) or valid_once_sorted(model, error):
            return "types", None, None
        return "invalid", _headline(error), error


def _headline(error: Exception) -> str:
    """onnx's reason on one line: up to its context, which repeats the failing node (its
    first line alone, "... however input 'x' of node:", would not name the node)."""
    text = str(error).split("==> Context")[0]
    return " ".join(text.split()) or type(error).__name__


def valid_once_sorted(model: ModelProto, error: Exception) -> bool:
    """Whether `error` is only that the nodes are out of topological order, which onnxruntime
    accepts (its float16 converter appends the casts of kept float32 inputs at the end), and a
    copy with every graph's nodes sorted passes the full check. fuser writes its models sorted."""
    if "topologically sorted" not in str(error):
        return False
    copy = weightless_model(model)
    for graph in all_graph_protos(copy.graph):
        order = topological_positions(graph)
        if order is None:
            return False  # a cycle, or an input no node makes: not a matter of order
        nodes = [graph.node[i] for i in order]
        sorted_nodes = [type(node)() for node in nodes]
        for target, node in zip(sorted_nodes, nodes):
            target.CopyFrom(node)
        del graph.node[:]
        graph.node.extend(sorted_nodes)
    try:
        onnx.checker.check_model(copy, full_check=True)
    except _FAILURES:
        return False
    return True


def _nodes(model: ModelProto) -> int:
    return sum(len(graph.node) for graph in all_graph_protos(model.graph))


def _running_alone() -> bool:
    """Whether this process runs no thread besides this one but threads marked `waits_only`:
    they only wait in a system call, holding no lock a forked child could need (the watch a
    `-j` worker keeps on fuser, fuser/jobs.py), and a fork copies none of them."""
    current = threading.current_thread()
    return all(thread is current or getattr(thread, "waits_only", False) for thread in threading.enumerate())


def _may_fork(nodes: int) -> bool:
    """Whether to check a model of `nodes` nodes in a child process: large enough, on Linux,
    from a process running no other thread."""
    return nodes >= CHILD_NODES and sys.platform.startswith("linux") and _running_alone()


def _room_beside(nodes: int) -> bool:
    """Whether the child may check a model of `nodes` nodes while this process builds its
    graph: a second core, and the memory both processes need."""
    from fuser.jobs import available_cores, available_memory

    if (CORES or available_cores()) < 2:
        return False
    available = available_memory()
    return available is not None and available >= nodes * (CHILD_BYTES_PER_NODE + GRAPH_BYTES_PER_NODE)


def _fork_check(model: ModelProto) -> tuple[int, IO[bytes]] | None:
    """Fork a child that checks `model`, writes its outcome, pickled, to a temporary file and
    exits, its memory freed as soon as it is done; (its pid, that file), or None where the
    fork failed."""
    try:
        outcome = tempfile.TemporaryFile()
    except OSError:  # no temporary folder to write to: check here
        return None
    parent = os.getpid()
    end_with_parent = _death_signal_setter()
    try:
        pid = os.fork()
    except OSError:
        outcome.close()
        return None
    if pid == 0:  # the child: never returns into the caller's code
        status = 1
        try:
            # Killed with this process (a CI job's hard timeout, the out-of-memory killer), the
            # child would check on alone for up to 20 s, holding GBs, for nobody.
            if end_with_parent is not None:
                end_with_parent()
            checked = None
            if os.getppid() == parent:  # else gone already, before the signal was asked for
                try:
                    checked = _check(model, disposable=True)  # this process's copy, never used again
                except BaseException:  # noqa: BLE001 - the parent checks again, and reports it there
                    checked = None
            if checked is not None:
                kind, value = checked[:2]
                verdict = (kind, None) if kind == "types" else (kind, value)
                outcome.write(pickle.dumps(verdict, protocol=pickle.HIGHEST_PROTOCOL))
                if kind == "types":
                    outcome.write(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
                outcome.flush()
                status = 0
        finally:
            os._exit(status)
    return pid, outcome


def _death_signal_setter():
    """A function that has the system kill the calling process once its parent is gone (Linux's
    prctl PR_SET_PDEATHSIG), or None where there is none. Looked up before the fork: a child
    loads no library."""
    import ctypes  # here: only a process that forks the check needs it

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4  # declared: its arguments are variadic
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _interned(found: InferredTypes | None) -> InferredTypes | None:
    """The types with their tensor names interned, as the graph holds them: a table sent from
    the child holds copies of the names, one string more per tensor."""
    if found is None:
        return None
    intern = sys.intern
    return InferredTypes(
        {intern(name): entry for name, entry in found.table.items()}, found.input_symbols, found.untyped
    )


def checked_inference(model: ModelProto, disposable: bool = False) -> InferredTypes | None:
    """Check `model` as onnx.checker's full check does, and return the types shape inference
    found in it: what the rewrite's first inference would find while nothing has changed the
    model (None when it is not that).

    The weights were checked already (TensorStore.check); the checker sees the model without
    them, which keeps a multi-GB model from being copied again. The full check is the
    structural one and a strict type and shape inference, which catches attributes of the
    wrong type (float `axes`) before a rule reads them. That inference is made here with data
    propagation, as the rewrite's is. Where it fails, the full check itself decides whether the
    model is valid. disposable: `model` itself may become the skeleton (no copy of its nodes).
    """
    skeleton_model = weightless_model(model, in_place=disposable)
    skeleton = skeleton_model.SerializeToString()
    if model.ir_version >= 4:  # an older model's skeleton keeps initializers the rewrite's lists as inputs
        onnx.checker.check_model(skeleton)
        try:
            inferred = infer_serialized(
                skeleton + valueless_long_vectors(skeleton_model.graph),
                check_type=True,
                strict_mode=True,
                data_prop=True,
            )
        except Exception:  # noqa: BLE001 - whatever it is, the full check below tells
            inferred = None
        if inferred is not None:
            # Read now, while the inferred model exists anyway: kept as a model until a rule
            # asks, it was parsed again beside the graph, which for a million nodes took 8.6 s
            # and set the run's peak memory, 1.2 GB above the graph's.
            return inferred_types(inferred)
    onnx.checker.check_model(skeleton, full_check=True)
    return None


# A private domain for checking a copy of a model: onnx.checker skips domains it does not know.
_RUNTIME_DOMAIN = "fuser.onnxruntime-default-domain"


def valid_for_onnxruntime(model: ModelProto, error: Exception) -> bool:
    """Whether `error` is only onnx.checker not knowing operators that onnxruntime registers in
    the default domain (SimplifiedLayerNormalization, or LayerNormalization below opset 17, as
    onnxruntime's tools and fuser's onnxruntime target write them) and a copy with those nodes
    moved to a private domain passes the full check: everything else is still checked."""
    if "No Op registered for" not in str(error):
        return False
    from fuser.verify import onnxruntime_default_domain_ops

    runtime_ops = onnxruntime_default_domain_ops()
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    copy = weightless_model(model)  # as read_model checks it: external data is not the checker's to read
    moved = 0
    for graph in all_graph_protos(copy.graph):
        for node in graph.node:
            if (
                node.domain in ("", "ai.onnx")
                and node.op_type in runtime_ops
                and not _onnx_knows(node.op_type, version)
            ):
                node.domain = _RUNTIME_DOMAIN
                moved += 1
    if not moved:
        return False
    copy.opset_import.append(onnx.helper.make_opsetid(_RUNTIME_DOMAIN, 1))
    try:
        onnx.checker.check_model(copy, full_check=True)
    except _FAILURES:
        return False
    return True


def _onnx_knows(op_type: str, version: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, version, "")
    except onnx.defs.SchemaError:
        return False
    return True
