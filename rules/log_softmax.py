"""Log(Softmax(x))  =>  LogSoftmax(x), same axis.

LogSoftmax computes x - max - log(sum(exp(x - max))) and never takes the log of an
underflowed 0, so it is finite where Log(Softmax) gives -inf. Both ops share their axis
semantics at every opset (before 13 both flatten the input to 2-D at `axis`, default 1;
from 13 both work along one axis, default -1), so the attribute carries over as it is.
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var


@rule("log-softmax", pattern=op.Log(op.Softmax(var("x"), name="softmax"), name="log"), stabilizes=True)
def log_softmax(m: Match, b: Builder):
    """Log(Softmax(x))  =>  LogSoftmax(x)."""
    return b.LogSoftmax(m["x"], **m.attrs("softmax"))
