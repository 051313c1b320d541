"""onnx's full check of a model as it is read (fuser/validation.py): a large model is checked in
a child process while the graph is built, with the outcome a check here gives, and a model
the check refuses is refused even when the rewrite ran beside its check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from fuser import report, validation
from fuser.errors import InputError
from fuser.float32_twin import computed_in_sixteen_bit_float
from fuser.graph import LONG_VECTOR, valueless_long_vectors, weightless_model
from fuser.match import TypeInfo
from fuser.model import Model
from fuser.validation import Validation
from tests.helpers import in_process_cli

TRANSFORMERS = Path(__file__).parent / "data" / "transformers"
SAMPLES = Path(__file__).resolve().parents[1] / "models"


@pytest.fixture
def apart(monkeypatch):
    """Every model is large enough to be checked in a child process, on a machine of two cores."""
    monkeypatch.setattr(validation, "CHILD_NODES", 0)
    monkeypatch.setattr(validation, "CORES", 2)


@pytest.fixture
def cli(monkeypatch, capfd):
    return in_process_cli(monkeypatch, capfd)


def invalid_model() -> onnx.ModelProto:
    """Structurally sound; the strict inference refuses an Add of float and int64."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "n"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("n", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("name", ["gpt2_dynamo", "llama_legacy"])
def test_a_check_in_a_child_gives_the_types_a_check_here_gives(apart, name):
    model = onnx.load(TRANSFORMERS / f"{name}.onnx")
    beside = Validation(model, "m.onnx")
    assert beside._child is not None  # the check runs in a child process
    here = Validation(model, "m.onnx", apart=False)
    assert here._child is None
    found, expected = beside.take_types(), here.take_types()
    assert found is not None and found.table == expected.table
    assert found.input_symbols == expected.input_symbols and found.untyped == expected.untyped
    assert beside.take_types() is None  # given once


def test_an_interruption_while_waiting_for_the_child_ends_the_child_too(apart, monkeypatch):
    # SIGTERM to fuser alone reaches the wait, not the child: the child must not run on alone.
    beside = Validation(onnx.load(TRANSFORMERS / "gpt2_dynamo.onnx"), "m.onnx")
    pid = beside._child[0]
    real_wait = os.waitpid
    waits = []

    def interrupted_once(*args):
        waits.append(args)
        if len(waits) == 1:
            raise KeyboardInterrupt
        return real_wait(*args)

    monkeypatch.setattr(validation.os, "waitpid", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        beside.verdict()
    with pytest.raises(ChildProcessError):  # killed and reaped
        real_wait(pid, os.WNOHANG)


def test_the_names_sent_back_are_the_graphs_own_strings(apart):
    """The table from the child holds the names the graph interned, not copies of them."""
    loaded = Model.load(SAMPLES / "mlp.onnx", validated=False)
    types = loaded.take_inferred_types()()
    name = next(info.output_names[0] for info in loaded.graph.nodes())
    assert next(key for key in types.table if key == name) is name


def test_a_model_the_check_refuses_in_a_child_is_refused_with_the_message_of_a_check_here(apart, tmp_path):
    onnx.save(invalid_model(), tmp_path / "m.onnx")
    with pytest.raises(InputError) as beside:
        Model.load(tmp_path / "m.onnx")
    with pytest.raises(InputError) as here:
        Validation(invalid_model(), tmp_path / "m.onnx", apart=False).verdict()
    assert str(beside.value) == str(here.value)
    assert str(beside.value).startswith(f"{tmp_path / 'm.onnx'}: invalid ONNX model: ")


@pytest.mark.parametrize("in_a_child", [True, False])
@pytest.mark.parametrize(
    "command", [("optimize", "m.onnx", "--no-check"), ("optimize", "m.onnx"), ("compare", "m.onnx", "m.onnx")]
)
def test_the_commands_say_why_the_check_refused_a_model(cli, monkeypatch, tmp_path, command, in_a_child):
    if in_a_child:
        monkeypatch.setattr(validation, "CHILD_NODES", 0)
        monkeypatch.setattr(validation, "CORES", 2)
    onnx.save(invalid_model(), tmp_path / "m.onnx")
    with pytest.raises(InputError) as refused:
        Validation(invalid_model(), tmp_path / "m.onnx", apart=False).verdict()
    reason = str(refused.value).removeprefix(f"{tmp_path / 'm.onnx'}: invalid ONNX model: ")
    assert reason and reason != "None"
    result = cli(tmp_path, *command)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"fuser: error: m.onnx: invalid ONNX model: {reason}"


def test_a_child_that_dies_before_it_tells_is_replaced_by_a_check_here(apart):
    model = onnx.load(TRANSFORMERS / "gpt2_dynamo.onnx")
    beside = Validation(model, "m.onnx")
    os.kill(beside._child[0], signal.SIGKILL)  # as the system does when memory runs out
    found = beside.take_types()
    assert found is not None and found.table == Validation(model, "m.onnx", apart=False).take_types().table


def test_the_child_exits_when_done_not_when_asked(apart):
    """Its memory goes as soon as the check is done: the outcome waits in a file, not in the child."""
    model = onnx.load(TRANSFORMERS / "gpt2_dynamo.onnx")
    beside = Validation(model, "m.onnx")
    pid = beside._child[0]
    for _ in range(6000):  # a zombie, once it has exited: nobody has asked it anything yet
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.01)
    else:
        pytest.fail("the child did not exit")
    assert beside.take_types().table == Validation(model, "m.onnx", apart=False).take_types().table


def test_closing_stops_and_reaps_the_child(apart):
    beside = Validation(onnx.load(TRANSFORMERS / "llama_legacy.onnx"), "m.onnx")
    pid = beside._child[0]
    beside.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: no zombie left behind
    beside.close()  # again: nothing to do


def test_no_child_is_forked_beside_other_threads(apart):
    """A fork copies other threads' locks half-way: a process running threads checks here."""
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert Validation(onnx.load(SAMPLES / "mlp.onnx"), "m.onnx")._child is None
    finally:
        release.set()
        other.join()


# A process that checks a model in a child it forks, whose check writes the child's pid to a
# file and then sleeps, as a check of a million nodes runs for 20 s.
SLOW_CHILD = """
import os, sys, time, onnx
from fuser import validation
validation.CHILD_NODES, validation.CORES = 0, 2
parent, check = os.getpid(), validation._check

def slow_check(model, disposable=False):
    if os.getpid() != parent:
        with open(sys.argv[2] + ".part", "w") as handle:
            handle.write(str(os.getpid()))
        os.rename(sys.argv[2] + ".part", sys.argv[2])
        time.sleep(600)
    return check(model, disposable)

validation._check = slow_check
validation.Validation(onnx.load(sys.argv[1]), "m.onnx").verdict()
"""


def _ended(pid: int) -> bool:
    """Gone, or a zombie its new parent has not reaped (a container's first process may never)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


# Skipped elsewhere on purpose: the load forks its check only on Linux (validation._may_fork),
# so there is no child to end.
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the check forks only on Linux")
def test_the_child_ends_when_the_process_that_forked_it_is_killed(tmp_path):
    """SIGKILL (a CI job's hard timeout, the out-of-memory killer) gives fuser no chance to stop
    the child: the system ends it, rather than letting it check on alone for nobody."""
    told = tmp_path / "child.pid"
    fuser = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, str(TRANSFORMERS / "gpt2_dynamo.onnx"), str(told)])
    try:
        for _ in range(6000):
            if told.exists() or fuser.poll() is not None:
                break
            time.sleep(0.01)
        assert told.exists(), "the child never started its check"
        child = int(told.read_text())
        os.kill(fuser.pid, signal.SIGKILL)
        fuser.wait()
        for _ in range(3000):
            if _ended(child):
                break
            time.sleep(0.01)
        ended = _ended(child)
        if not ended:
            os.kill(child, signal.SIGKILL)
        assert ended, "the child checks on after the process that forked it was killed"
    finally:
        if fuser.poll() is None:
            fuser.kill()
            fuser.wait()


@pytest.mark.parametrize("check", [[], ["--no-check"]])
def test_optimize_loads_its_model_in_a_process_of_one_thread(apart, cli, tmp_path, monkeypatch, check):
    """Whatever optimize runs beside its work (the hash of the input for the report, the
    original's check session) starts after the load: another thread would stop the fork."""
    forked = []

    def fork_check(model):
        forked.append(threading.active_count())
        return fork(model)

    def slow_entry(path):  # still hashing when the load counts threads, whatever the machine
        time.sleep(0.5)
        return entry(path)

    fork, entry = validation._fork_check, report.file_entry
    monkeypatch.setattr(validation, "_fork_check", fork_check)
    monkeypatch.setattr(report, "file_entry", slow_entry)
    result = cli(tmp_path, "optimize", SAMPLES / "mlp.onnx", "-o", "out.onnx", "-q", *check)
    assert result.returncode == 0, result.stderr
    assert forked == [1]


def checked_here(monkeypatch) -> list:
    """The models this process checks itself (a forked child's checks are not seen here)."""
    calls: list = []
    check = validation._check

    def recorded(model, disposable=False):
        calls.append(model)
        return check(model, disposable)

    monkeypatch.setattr(validation, "_check", recorded)
    return calls


def test_without_the_memory_both_processes_hold_the_child_is_waited_for(apart, monkeypatch):
    """The child's check holds its memory while the graph is built: with too little available,
    this process waits for the child, whose memory is all handed back when it exits."""
    import fuser.jobs

    model = onnx.load(TRANSFORMERS / "gpt2_dynamo.onnx")
    nodes = len(model.graph.node)
    needed = nodes * (validation.CHILD_BYTES_PER_NODE + validation.GRAPH_BYTES_PER_NODE)
    here = checked_here(monkeypatch)
    monkeypatch.setattr(fuser.jobs, "available_memory", lambda: needed - 1)
    waited = Validation(model, "m.onnx")
    assert waited._child is None and waited._outcome is not None  # done before the graph is built
    assert here == []  # by the child
    assert waited.take_types().table == Validation(model, "m.onnx", apart=False).take_types().table
    monkeypatch.setattr(fuser.jobs, "available_memory", lambda: needed)
    beside = Validation(model, "m.onnx")
    assert beside._child is not None and beside._outcome is None
    beside.close()


def test_without_a_second_core_the_child_is_waited_for(apart, monkeypatch):
    """A worker of `-j N` given one core's share, or a machine of one, gains nothing from a
    child beside it, but still the memory the child hands back when it exits."""
    model = onnx.load(TRANSFORMERS / "gpt2_dynamo.onnx")
    here = checked_here(monkeypatch)
    monkeypatch.setattr(validation, "CORES", 1)
    waited = Validation(model, "m.onnx")
    assert waited._child is None and waited._outcome is not None
    assert here == []


def test_a_model_refused_by_a_child_waited_for_is_refused(apart, monkeypatch):
    here = checked_here(monkeypatch)
    monkeypatch.setattr(validation, "CORES", 1)
    waited = Validation(invalid_model(), "m.onnx")
    assert here == []  # refused by the child
    with pytest.raises(InputError, match="invalid ONNX model"):
        waited.verdict()


def test_the_types_wait_for_the_check_until_a_rule_asks(apart):
    """TypeInfo's first table is a function called at the first question; what the graph
    changed before that is applied to it as if it had been there from the start."""
    loaded = Model.load(SAMPLES / "mlp.onnx", validated=False)
    calls = []

    def seed():
        calls.append(1)
        return loaded._validation.take_types()

    types = TypeInfo(lambda: loaded.to_proto(weights=False), seed=seed)
    types.invalidate(produced=["made-by-a-rewrite"])
    assert calls == []
    first_output = next(info.output_names[0] for info in loaded.graph.nodes())
    assert types.shape(first_output) is not None
    assert calls == [1]
    assert "made-by-a-rewrite" not in types._untyped


def test_optimize_refuses_a_model_the_check_refuses_though_a_rule_crashed_on_it(apart, cli, tmp_path):
    """The rewrite runs while the check does; a rule that trips on the invalid model is not
    what the command reports, the model's refusal is (exit 2), and nothing is written."""
    (tmp_path / "crash.py").write_text(
        "from fuser import op, rule, var\n"
        "@rule('crash', pattern=op.Relu(var('x')))\n"
        "def crash(m, b):\n"
        '    """Relu(x)  =>  nothing: it trips."""\n'
        "    raise ZeroDivisionError('a rule that trips')\n"
    )
    onnx.save(invalid_model(), tmp_path / "m.onnx")
    result = cli(tmp_path, "optimize", "m.onnx", "--rules", "crash.py", "--no-check")
    assert result.returncode == 2, result.stderr
    assert "invalid ONNX model" in result.stderr and "trips" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crash.py", "m.onnx"]

    valid = onnx.load(SAMPLES / "mlp.onnx")
    onnx.save(valid, tmp_path / "valid.onnx")
    crashed = cli(tmp_path, "optimize", "valid.onnx", "--rules", "crash.py", "--no-check")
    assert "trips" in crashed.stderr and crashed.returncode not in (0, 2)  # on a valid model the crash is reported


def test_optimize_of_a_model_checked_in_a_child_writes_what_a_check_here_lets_it_write(
    apart, cli, tmp_path, monkeypatch
):
    source = TRANSFORMERS / "gpt2_legacy.onnx"
    assert cli(tmp_path, "optimize", source, "-o", "beside.onnx", "--no-check", "-q").returncode == 0
    monkeypatch.setattr(validation, "CHILD_NODES", 10**9)
    assert cli(tmp_path, "optimize", source, "-o", "here.onnx", "--no-check", "-q").returncode == 0
    assert (tmp_path / "beside.onnx").read_bytes() == (tmp_path / "here.onnx").read_bytes()


def packed_vector_model(elements: int) -> onnx.ModelProto:
    """y = Slice(weights, start, end) + x: a model that packs its weights in one long vector."""
    import numpy as np

    from tests.helpers import make_model

    return make_model(
        [
            helper.make_node("Slice", ["weights", "start", "end"], ["part"]),
            helper.make_node("Add", ["part", "x"], ["y"]),
        ],
        [("x", np.float32, [4])],
        [("y", np.float32, [4])],
        {
            "weights": np.arange(elements, dtype=np.float32),
            "start": np.array([8], np.int64),
            "end": np.array([12], np.int64),
        },
    )


def test_long_vectors_get_stand_ins_whose_values_inference_does_not_follow():
    import numpy as np

    # onnx's data propagation follows a fixed-length vector element by element wherever a Slice
    # reads it: a 760 MB packed weight exhausted 24 GB before the stand-ins.
    long = LONG_VECTOR
    skeleton = weightless_model(packed_vector_model(long))
    stand_ins = onnx.ModelProto.FromString(valueless_long_vectors(skeleton.graph))
    assert [(t.name, list(t.dims), t.data_location) for t in stand_ins.graph.initializer] == [
        ("weights", [long], TensorProto.EXTERNAL)
    ]
    assert valueless_long_vectors(weightless_model(packed_vector_model(long - 1)).graph) == b""
    table = packed_vector_model(long)
    table.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.arange(long, dtype=np.int64), "weights"))
    assert valueless_long_vectors(weightless_model(table).graph) == b""  # propagation reads int64 data


def test_a_model_slicing_a_long_vector_is_checked_with_its_types(cli, tmp_path):
    import numpy as np

    from tests.helpers import run

    model = packed_vector_model(LONG_VECTOR)
    types = validation.checked_inference(model)
    assert types is not None and types.table["part"] == (TensorProto.FLOAT, (4,))
    onnx.save(model, tmp_path / "m.onnx")
    result = cli(tmp_path, "optimize", tmp_path / "m.onnx", "-o", tmp_path / "out.onnx")
    assert result.returncode == 0, result.stderr
    x = np.ones(4, np.float32)
    assert run(onnx.load(tmp_path / "out.onnx"), {"x": x})[0].tolist() == [9.0, 10.0, 11.0, 12.0]


def test_a_thread_that_only_waits_does_not_keep_the_check_from_forking():
    # A -j worker keeps a thread waiting on its pipe to fuser (fuser/jobs.py); the load of a large
    # model must still fork its check beside the graph's build. Any other thread keeps it here.
    from fuser.validation import _running_alone

    assert _running_alone()
    release = threading.Event()
    for waits_only in (True, False):
        thread = threading.Thread(target=release.wait, daemon=True)
        thread.waits_only = waits_only
        thread.start()
        try:
            assert _running_alone() is waits_only
        finally:
            release.set()
            thread.join()
            release.clear()


def unsorted_model() -> onnx.ModelProto:
    """x (float32) -> Cast to float16 -> Relu -> Cast back: the first Cast written last, as
    onnxruntime's float16 converter (keep_io_types) appends the casts of the inputs it keeps."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x_half"], ["r"], name="relu"),
            helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT, name="out_cast"),
            helper.make_node("Cast", ["x"], ["x_half"], to=TensorProto.FLOAT16, name="in_cast"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("in_a_child", [True, False])
def test_nodes_out_of_order_are_taken_and_written_in_order(cli, monkeypatch, tmp_path, in_a_child):
    if in_a_child:
        monkeypatch.setattr(validation, "CHILD_NODES", 0)
        monkeypatch.setattr(validation, "CORES", 2)
    model = unsorted_model()
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp_path / "m.onnx")
    result = cli(tmp_path, "optimize", "m.onnx", "-o", "out.onnx", "--report", "r.json")
    assert result.returncode == 0, result.stderr
    written = onnx.load(tmp_path / "out.onnx")
    onnx.checker.check_model(written, full_check=True)
    assert [n.name for n in written.graph.node] == ["in_cast", "relu", "out_cast"]
    # float16 reaches the output whatever the order: the check would compare it at float16's tolerance
    assert computed_in_sixteen_bit_float(model) == {"y": "float16"}


def test_a_node_reading_what_no_node_makes_is_refused_with_the_node_named(cli, tmp_path):
    model = unsorted_model()
    model.graph.node[2].output[0] = "elsewhere"
    onnx.save(model, tmp_path / "m.onnx")
    result = cli(tmp_path, "optimize", "m.onnx")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "topologically sorted" in line and "name: relu OpType: Relu" in line, line
