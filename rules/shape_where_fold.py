"""Where(Equal(s, -1), ones, s) of a shape s that holds no -1  =>  s (any compared constant, any fill).

torch's legacy exporter writes `expand(..., shape)` as Expand(x, Where(Equal(s, -1), ones, s)),
in case an entry of s is -1 ("keep this dim"). When s is concatenated from constants that are
not -1 and dims read with Shape (never negative), the Where gives s back. Left in place, it
hides s from shape inference, and with it the Expand's output shape, which attention-standard
needs to see that grouped-query attention repeats each K and V head in turn.
"""

from __future__ import annotations

import numpy as np
from fuser.rules._simplify import SIMPLIFY_PHASE, concat_entries

from fuser import Builder, Match, const, op, rule, var


@rule(
    "shape-where-fold",
    pattern=op.Where(op.Equal(var("shape"), const("sentinel"), name="equal"), var("fill"), var("shape"), name="where"),
    phase=SIMPLIFY_PHASE,
    exact=True,
)
def shape_where_fold(m: Match, b: Builder):
    """Where(Equal(s, c), fill, s) where no entry of s can equal c  =>  s."""
    sentinel = m.value("sentinel")
    m.require(np.issubdtype(sentinel.dtype, np.integer), "the compared value is not integers")
    m.require(sentinel.ndim <= 1, f"the compared value is {sentinel.ndim}-D, not a scalar or a vector")
    entries = concat_entries(m, m["shape"])
    m.require(entries is not None and None not in entries, "not every entry of the shape is known")
    m.require(sentinel.size in (1, len(entries)), "the compared value does not match the shape entry by entry")
    compared = np.broadcast_to(sentinel.reshape(-1), (len(entries),))
    for entry, value in zip(entries, compared):
        if isinstance(entry, int):
            m.require(entry != value, f"an entry of the shape is {entry}, the value compared with")
        else:
            m.require(value < 0, f"a dim read at run time may be {value}")
    # The condition and the fill broadcast with the shape: the Where must give its 1-D shape.
    result = m.shape("where")
    m.require(result == (len(entries),), f"the Where gives shape {result}, not [{len(entries)}]")
    return m["shape"]
