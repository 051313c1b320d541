"""The original's side of a large model's check, run in a fresh interpreter beside the rewrite.

onnxruntime starts a session in a time that grows faster than the model: the 100k-node MLP
stack of bench/scale.py takes 6.9 s whole and 2.6 s in the pieces of fuser/pieces.py. Cutting a
model into pieces is Python work, though, and done in this process beside the rewrite it took
Python's lock from the rewrite for longer than the pieces saved. So where the original is large
and a core is free, a child interpreter of its own (started anew, never forked: this process
runs threads) is handed the serialized original; it starts its session in pieces, runs it on the
check's inputs, and hands back an OriginalRuns: the inputs and the outputs. This process keeps
the serialized copy, should a mismatch need the original run again.

Whatever keeps the child from answering (it cannot start, it dies, its answer is garbled) leaves
the work to this process, as if it had never been tried; what it raises for the model or the
options (an InputError: inputs the original cannot run on) is raised here as it is.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import onnx

from fuser.errors import FuserError
from fuser.graph import all_graph_protos
from fuser.tensors import nbytes

# The fewest nodes for which the child pays. It starts Python and imports onnx and onnxruntime
# (0.8 s) before it starts the pieces, and the check waits for it if the rewrite ends first;
# onnxruntime's start of a whole model grows faster than that. `fuser optimize` of the MLP stacks
# of bench/scale.py, three runs each, interleaved: 25k nodes 3.56 to 3.71 s with the child, 3.13
# to 3.30 s without; 50k nodes 5.26 to 5.74 s, 5.33 to 5.80 s; 100k nodes 9.63 to 9.69 s, 10.19
# to 11.64 s (the ResNet stack's 13.47 to 13.73 s, 13.95 to 14.80 s).
APART_NODES = 60_000
# The child holds a copy of the weights beside this process's. Above this much of the weights
# the sessions here would share (verify.feedable), the original's session shares them with the
# optimized model's here instead (verify.WeightFeeds). Smaller weights are every session's own
# copy wherever it runs: the million-node MLP stack's 393 MB of them.
APART_WEIGHT_BYTES = 256 << 20
# What the child holds per node (the parsed model, the pieces, their sessions): 0.78 and 0.99 GB
# at its peak for the 100k-node MLP and ResNet stacks, beside the graph this process builds
# (validation.GRAPH_BYTES_PER_NODE).
APART_BYTES_PER_NODE = 12_000


class ChildFailed(Exception):
    """The child gave no answer; this process does the work itself."""


def worth_apart(model: onnx.ModelProto) -> bool:
    """Whether to run `model`'s side of the check in a child: many nodes, few enough weights the
    sessions here would share (the child holds them again), a core of its own, and the memory it needs."""
    from fuser import validation
    from fuser.jobs import available_cores, available_memory
    from fuser.verify import feedable

    nodes = sum(len(graph.node) for graph in all_graph_protos(model.graph))
    if nodes < APART_NODES or (validation.CORES or available_cores()) < 2:
        return False
    weights = shared = 0
    for tensor in model.graph.initializer:
        size = nbytes(tensor)
        weights += size
        if feedable(tensor):
            shared += size
    if shared > APART_WEIGHT_BYTES:
        return False
    available = available_memory()
    need = nodes * (APART_BYTES_PER_NODE + validation.GRAPH_BYTES_PER_NODE) + 2 * weights
    return available is not None and available >= need


class OriginalApart:
    """A child interpreter building the check's OriginalRuns of one serialized model."""

    def __init__(self, data: bytes, options, base_dir) -> None:
        """Start the child; it is handed `data` (the serialized original) by result()."""
        from fuser import verify

        # The settings of this process's sessions: their threads (a -j worker's share of the
        # cores) and how much onnxruntime logs (--debug).
        settings = {"SESSION_THREADS": verify.SESSION_THREADS, "LOG_SEVERITY": verify.LOG_SEVERITY}
        self._request = (options, None if base_dir is None else str(base_dir), settings)
        self._data = data
        self.stopped = False  # by stop(), before its answer was read
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", "import fuser.check_apart as c; c.serve()", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
        except OSError as error:
            raise ChildFailed(str(error)) from error

    def result(self):
        """The child's OriginalRuns; the FuserError it raised is raised here. ChildFailed where
        there is no answer."""
        try:
            pickle.dump(self._request, self._process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._process.stdin.write(self._data)
            self._process.stdin.close()
            answer = self._process.stdout.read()
        except OSError as error:  # the child is gone: a broken pipe
            raise ChildFailed(str(error)) from error
        finally:
            self._data = None
            self._end()
        try:
            kind, value = pickle.loads(answer)
        except Exception as error:  # noqa: BLE001 - a child killed half-way leaves anything
            raise ChildFailed(f"no answer from the check's child (exit {self._process.returncode})") from error
        if kind == "error":
            raise value
        if kind != "runs":
            raise ChildFailed(value)
        return value

    def stop(self) -> None:
        """End the child, its answer no longer wanted: result() then ends, with ChildFailed."""
        self.stopped = True
        if self._process.poll() is None:
            self._process.kill()

    def _end(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except OSError:
                    pass


def serve() -> None:
    """The child's whole life: answer its parent, then end at once, its sessions not freed one by
    one (the system takes the memory back)."""
    status = 1
    try:
        _serve(int(sys.argv[1]))
        status = 0
    except BaseException:  # noqa: BLE001 - the parent, with no answer, does the work and says what fails
        pass
    finally:
        os._exit(status)


def _serve(parent: int) -> None:
    """Read the request from stdin, answer on stdout, pickled."""
    from fuser import validation

    # Killed with its parent (a CI job's hard timeout, Ctrl-C, the out-of-memory killer), it
    # would go on building sessions for nobody.
    end_with_parent = validation._death_signal_setter()
    if end_with_parent is not None:
        end_with_parent()
    if os.getppid() != parent:
        return
    answer_to = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what a library prints goes to stderr, not into the answer
    request = sys.stdin.buffer
    options, base_dir, settings = pickle.load(request)
    model = onnx.load_from_string(request.read())
    answer = _answer(model, options, base_dir, settings)
    answer_to.write(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
    answer_to.flush()


def _answer(model: onnx.ModelProto, options, base_dir, settings: dict) -> tuple[str, object]:
    from fuser import pieces, verify
    from fuser.verify import Checker

    for name, value in settings.items():
        setattr(verify, name, value)
    # The pieces start one at a time: the parent's rewrite holds the other core.
    pieces.AT_ONCE = 1
    try:
        return "runs", Checker(model, options, base_dir=base_dir, own=True).runs
    except FuserError as error:
        return "error", error
    except Exception as error:  # noqa: BLE001 - the parent does the work again, and reports what goes wrong
        return "failed", f"{type(error).__name__}: {error}"
