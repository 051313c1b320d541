"""Dropout at inference  =>  its input.

Outside training, Dropout passes its input through unchanged; exporters still leave it in
the graph, where it costs a copy and splits the chains other rules fuse (a Dropout
between two convolutions keeps onnxruntime's NCHWc layout from carrying across it).
"""

from __future__ import annotations

from fuser import Builder, Match, const, op, rule, var


@rule(
    "dropout-elimination",
    pattern=op.Dropout(var("x"), var("ratio", optional=True), const("training_mode", optional=True)),
    exact=True,
)
def dropout_elimination(m: Match, b: Builder):
    """Dropout (inference)  =>  its input; the unused mask output is dropped."""
    if m.opset < 7:
        m.require(m.attr("Dropout", "is_test", 0) == 1, "Dropout before opset 7 without is_test=1 is in training mode")
    training = m.value("training_mode")
    m.require(training is None or not bool(training.reshape(-1)[0]), "Dropout runs in training mode")
    outputs = [o for o in m.node("Dropout").outputs if o]
    return [m["x"]] + [None] * (len(outputs) - 1)
