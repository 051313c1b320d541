"""ReorderInput(ReorderOutput(x))  =>  x (onnxruntime target, NCHWc layout).

Between two NCHWc operators the round trip through plain NCHW is pure copying; the
blocked tensor can be passed on as it is. The two differ only in padding channels,
which no NCHWc consumer reads. ReorderOutput stays while plain-layout consumers remain.
"""

from __future__ import annotations

from fuser import Builder, Match, rule, var
from fuser.rules._nchwc import channels_of, nchwc


@rule(
    "nchwc-reorder-cancel",
    pattern=nchwc.ReorderInput(nchwc.ReorderOutput(var("x"), name="to_plain"), name="to_blocked"),
    target="onnxruntime",
    phase=1,
    shared_interior=True,
)
def nchwc_reorder_cancel(m: Match, b: Builder):
    """ReorderInput(ReorderOutput(x))  =>  x."""
    m.require(m.attr("to_blocked", "channels_last", 0) == 0, "the input reorder reads channels-last data")
    channels_of(m, "to_plain")
    return m["x"]
