"""binary(ReorderOutput(a), ReorderOutput(b))  =>  ReorderOutput(binary(a, b)) (onnxruntime target).

Two tensors of one shape in the same blocked layout combine element by element as they are:
a HardSwish written x * HardSigmoid(x), a gate, a sum of two branches. The two reorders
become one, after the operator, and that one cancels against the next NCHWc operator's.
Broadcasting is another matter: a [1, C, 1, 1] scale read against a blocked [1, C, H, W]
tensor would meet the wrong channels, so both inputs and the result must have one shape.
"""

from __future__ import annotations

from fuser import Builder, Match, op, rule, var
from fuser.rules._nchwc import EMITS, channels_of, nchwc, reorder_output


@rule(
    "nchwc-binary",
    pattern=(op.Add | op.Sub | op.Mul | op.Max | op.Min | op.Sum)(
        nchwc.ReorderOutput(var("a"), name="a_plain"), nchwc.ReorderOutput(var("b"), name="b_plain"), name="binary"
    ),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
    shared_interior=True,
)
def nchwc_binary(m: Match, b: Builder):
    """binary(ReorderOutput(a), ReorderOutput(b)) of one shape  =>  ReorderOutput(binary(a, b))."""
    channels = channels_of(m, "a_plain")
    m.require(channels_of(m, "b_plain") == channels, "the two inputs have different channel counts")
    shapes = {m.shape("a_plain"), m.shape("b_plain"), m.shape("binary")}
    shape = next(iter(shapes))
    m.require(
        len(shapes) == 1 and shape is not None and len(shape) == 4 and all(isinstance(d, int) for d in shape),
        f"the inputs and the result do not all have one known shape: {sorted(map(str, shapes))}",
    )
    blocked = b.op(m.node("binary").op_type, m["a"], m["b"], **m.attrs("binary"))
    return reorder_output(b, blocked, channels)
