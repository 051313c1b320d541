"""The numerics check's settings travel as one CheckOptions from the command line or the Python
API to the checker; fuser.optimize keeps taking them as keywords too."""

from __future__ import annotations

import numpy as np
import pytest

import fuser
from fuser.errors import UsageError
from tests.helpers import model_from_text

# Neg(Neg(x)) -> x, a rewrite the check verifies on inputs with a symbolic batch dimension.
DOUBLE_NEG = """
agraph (float[N, 4] x) => (float[N, 4] y) {
    n = Neg(x)
    y = Neg(n)
}
"""


@fuser.rule("test-double-neg", pattern=fuser.op.Neg(fuser.op.Neg(fuser.var("x"), name="inner")), exact=True)
def double_neg(m, b):
    """Neg(Neg(x)) -> x."""
    return b.Identity(m["x"])


def test_keywords_and_options_object_give_the_same_check():
    model = model_from_text(DOUBLE_NEG)
    _, by_keywords = fuser.optimize(model, rules=[double_neg], seed=3, runs=2, dims={"N": 5})
    options = fuser.CheckOptions(seed=3, runs=2, dims={"N": 5})
    _, by_options = fuser.optimize(model, rules=[double_neg], check_options=options)
    assert by_keywords.verdict.input_shapes == by_options.verdict.input_shapes == {"x": (5, 4)}
    assert by_keywords.verdict.to_dict() == by_options.verdict.to_dict()


def test_real_inputs_through_options():
    model = model_from_text(DOUBLE_NEG)
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    _, report = fuser.optimize(model, rules=[double_neg], check_options=fuser.CheckOptions(inputs=feeds))
    assert report.verdict.passed and report.verdict.input_shapes == {"x": (3, 4)}


def test_options_and_keywords_together_are_refused():
    model = model_from_text(DOUBLE_NEG)
    with pytest.raises(UsageError, match="not both"):
        fuser.optimize(model, rules=[double_neg], check_options=fuser.CheckOptions(), seed=1)


def test_a_misspelled_keyword_is_an_error():
    model = model_from_text(DOUBLE_NEG)
    with pytest.raises(TypeError, match="sead"):
        fuser.optimize(model, rules=[double_neg], sead=1)


def test_options_are_immutable():
    options = fuser.CheckOptions(seed=1)
    with pytest.raises(AttributeError):
        options.seed = 2
    assert options.replace(runs=3) == fuser.CheckOptions(seed=1, runs=3)
