"""The original's side of a large model's check, run in a child interpreter (fuser/check_apart.py).

The child is real: a fresh Python process running onnxruntime. Lowering APART_NODES makes small
models go to it; the child itself cuts a model of 2,000 nodes or more into pieces."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import onnx
import pytest
from fuser.rules.conv_bn_fold import conv_bn_fold
from onnx import helper

import fuser
from fuser import check_apart, jobs, validation, verify
from fuser.errors import InputError, NumericsMismatch, UsageError
from fuser.verify import Checker, CheckOptions, PreparedChecker
from tests.helpers import in_process_cli, make_model
from tests.test_blame import BAD_BLOCKS, chain_model


@pytest.fixture
def apart(monkeypatch):
    """Any model's original goes to the child, even on a machine of one core (CI's may be)."""
    monkeypatch.setattr(check_apart, "APART_NODES", 1)
    monkeypatch.setattr(validation, "CORES", 2)


@pytest.fixture
def pieces_cut(monkeypatch) -> list:
    """How many pieces each session started since is made of (None: started whole, or not cut)."""
    cut = []
    started_in_pieces = verify.started_in_pieces

    def observed(proto, *args):
        pieces = started_in_pieces(proto, *args)
        cut.append(None if pieces is None else pieces.pieces)
        return pieces

    monkeypatch.setattr(verify, "started_in_pieces", observed)
    return cut


def long_chain(blocks: int = 700) -> onnx.ModelProto:
    """Mul-Add-Tanh blocks with weights of their own: 2,100 nodes, cut into pieces by the child."""
    rng = np.random.default_rng(3)
    nodes, weights, current = [], {}, "x"
    for i in range(blocks):
        weights[f"s{i}"] = rng.uniform(0.5, 1.5, 8).astype(np.float32)
        weights[f"b{i}"] = rng.normal(0, 0.1, 8).astype(np.float32)
        nodes.append(helper.make_node("Mul", [current, f"s{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]))
        nodes.append(helper.make_node("Tanh", [f"a{i}"], [f"t{i}"]))
        current = f"t{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"]))
    return make_model(nodes, [("x", np.float32, ["batch", 8])], [("y", np.float32, ["batch", 8])], weights)


def test_the_child_gives_the_inputs_and_outputs_this_process_would(apart):
    model = long_chain()
    options = CheckOptions(runs=2)
    prepared = PreparedChecker(model, options)
    assert prepared._apart is not None
    apart_checker = prepared.get()
    assert prepared.answered_apart
    here = Checker(model, options)
    assert apart_checker.input_shapes == here.input_shapes == {"x": (1, 8)}
    assert apart_checker.input_names == here.input_names == ["x"]
    assert apart_checker.warnings == here.warnings
    assert len(apart_checker.feeds) == len(here.feeds) == 2
    for feeds, expected, feeds_here, expected_here in zip(
        apart_checker.feeds, apart_checker.expected, here.feeds, here.expected
    ):
        assert feeds.keys() == feeds_here.keys() and all(np.array_equal(feeds[n], feeds_here[n]) for n in feeds)
        assert expected.keys() == {"y"} and np.array_equal(expected["y"], expected_here["y"])
    assert apart_checker.check(model, exact=True).passed
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    changed.graph.node[-2].op_type = "Sigmoid"  # the last Tanh
    assert not apart_checker.check(changed, exact=True).passed


def test_what_the_child_raises_for_the_model_is_raised_here(apart):
    model = long_chain(10)
    misfit = CheckOptions(inputs={"x": np.zeros(5, np.float32)})
    with pytest.raises(InputError) as here:
        Checker(model, misfit)
    prepared = PreparedChecker(model, misfit)
    with pytest.raises(InputError) as raised:
        prepared.get()
    assert str(raised.value) == str(here.value) and "cannot run on these inputs" in str(raised.value)
    unknown = CheckOptions(inputs={"nothing": np.zeros(5, np.float32)})
    with pytest.raises(UsageError, match="has no input nothing"):
        PreparedChecker(model, unknown).get()


def test_a_child_that_gives_no_answer_leaves_the_work_to_this_process(apart, monkeypatch):
    monkeypatch.setattr(sys, "executable", shutil.which("false"))  # exits at once, saying nothing
    model = long_chain(10)
    prepared = PreparedChecker(model, CheckOptions())
    assert prepared._apart is not None
    checker = prepared.get()
    assert not prepared.answered_apart
    assert checker.check(model, exact=True).passed
    assert checker.input_shapes == Checker(model).input_shapes


def test_a_child_whose_answer_is_not_wanted_is_ended(apart):
    prepared = PreparedChecker(long_chain(), CheckOptions())
    prepared.discard()
    assert prepared._apart.stopped
    assert prepared._apart._process.returncode is not None  # ended and reaped


def test_a_check_against_the_childs_answer_blames_the_wrong_rewrites(apart, tmp_path_factory):
    from tests.test_blame import WRONG_RULE, _rule_file

    _, wrong = _rule_file(tmp_path_factory, "wrong_rule", WRONG_RULE)
    with pytest.raises(NumericsMismatch) as raised:
        fuser.optimize(chain_model(), rules=[wrong, conv_bn_fold])
    report = raised.value.evidence["report"]
    assert {r.rule for r in report.blamed} == {"bn-fold-wrong-epsilon"}
    assert len(report.blamed) == BAD_BLOCKS
    _, report = fuser.optimize(chain_model(), rules=[conv_bn_fold])
    assert report.verdict.passed and report.counts == {"conv-bn-fold": 27}


def test_many_small_weights_go_to_the_child_and_large_shared_ones_stay(apart, monkeypatch):
    # Memory to spare on any machine (available_memory reads /proc/meminfo, Linux's alone), so
    # that the weights alone decide.
    monkeypatch.setattr(jobs, "available_memory", lambda: 64 << 30)
    # The sessions here would each hold a copy of a small weight anyway; a large one they share.
    monkeypatch.setattr(check_apart, "APART_WEIGHT_BYTES", 100)
    small = long_chain(10)  # twenty weights of 32 bytes
    assert sum(onnx.numpy_helper.to_array(t).nbytes for t in small.graph.initializer) > 100
    assert check_apart.worth_apart(small)
    monkeypatch.setattr(jobs, "available_memory", lambda: 1_000)
    assert not check_apart.worth_apart(small)  # the memory it needs still counts
    monkeypatch.setattr(jobs, "available_memory", lambda: 64 << 30)
    large = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [("x", np.float32, ["batch", 8])],
        [("y", np.float32, ["batch", 2048])],
        {"w": np.ones((8, 2048), np.float32)},  # 64 KiB: fed to the sessions here, held once
    )
    assert verify.feedable(large.graph.initializer[0])
    assert not check_apart.worth_apart(large)


@pytest.mark.parametrize(("memory", "cut_into"), [(1_000, 2), (64 << 30, None)])
def test_an_original_checked_here_starts_in_pieces_where_its_whole_session_may_not_fit(
    monkeypatch, pieces_cut, memory, cut_into
):
    monkeypatch.setattr(check_apart, "APART_NODES", 10**9)  # no child
    monkeypatch.setattr(jobs, "available_memory", lambda: memory)
    model = long_chain()  # 2,101 nodes: far below PIECES_HERE_NODES
    checker = PreparedChecker(model, CheckOptions(runs=2)).get()
    assert pieces_cut == ([cut_into] if cut_into else [])  # whole, it is not offered to the cut at all
    assert checker.check(model, exact=True).passed


def test_compare_starts_both_models_in_pieces(monkeypatch, capfd, tmp_path, pieces_cut):
    """fuser compare is what checks a model too large to check where it was optimized: its
    reference starts in pieces as the candidate does (a whole session of a large model starts
    slower and holds more), and the verdict is the whole models'."""
    model = long_chain()
    onnx.save(model, tmp_path / "a.onnx")
    model.graph.node[-2].op_type = "Sigmoid"
    onnx.save(model, tmp_path / "b.onnx")
    cli = in_process_cli(monkeypatch, capfd)
    same = cli(tmp_path, "compare", "a.onnx", "a.onnx", "--exact")
    assert same.returncode == 0, same.stderr
    assert pieces_cut == [2, 2]  # the reference's session, then the candidate's
    pieces_cut.clear()
    differ = cli(tmp_path, "compare", "a.onnx", "b.onnx")
    assert differ.returncode == 3 and "mismatch" in differ.stderr
    assert pieces_cut == [2, 2]


def test_a_large_original_checked_here_is_started_in_pieces(monkeypatch):
    monkeypatch.setattr(check_apart, "APART_NODES", 10**9)  # no child
    monkeypatch.setattr(verify, "PIECES_HERE_NODES", 2_000)
    cut = []
    started_in_pieces = verify.started_in_pieces

    def observed(proto, *args):
        pieces = started_in_pieces(proto, *args)
        cut.append((len(proto.graph.node), None if pieces is None else pieces.pieces))
        return pieces

    monkeypatch.setattr(verify, "started_in_pieces", observed)
    model = long_chain()
    options = CheckOptions(runs=2)
    checker = PreparedChecker(model, options).get()
    assert cut == [(2_101, 2)]
    here = Checker(model, options)  # the whole model's session
    assert len(checker.feeds) == len(here.feeds) == 2
    for feeds, expected, feeds_here, expected_here in zip(checker.feeds, checker.expected, here.feeds, here.expected):
        assert all(np.array_equal(feeds[n], feeds_here[n]) for n in feeds_here)
        assert np.array_equal(expected["y"], expected_here["y"])
    assert checker.check(model, exact=True).passed
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    changed.graph.node[-2].op_type = "Sigmoid"
    assert not checker.check(changed, exact=True).passed
    assert checker.unsteady_outputs() == []  # the original, run again from the copy kept of it
