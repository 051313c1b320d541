"""A NCHWc tensor to or from a sequence of pixel tokens  =>  the reorder's channels-last form.

Vision transformers with convolutions (SegFormer, PVT, CvT) turn a feature map into tokens
with x.flatten(2).transpose(1, 2), [N, C, H, W] -> [N, H*W, C], and back with
x.transpose(1, 2).reshape(N, C, H, W). Next to a NCHWc convolution each is a reorder, a
Reshape and a Transpose; the Transpose is the channels-last half of the reorder
(nchwc-channels-last-*), once the Reshape moves to the other side of it:

    Transpose(Reshape(ReorderOutput(x), [N, C, H*W]), [0, 2, 1])  =>  Reshape(ReorderOutput(x, channels_last), [N, H*W, C])
    ReorderInput(Reshape(Transpose(t, [0, 2, 1]), [N, C, H, W]))   =>  ReorderInput(Reshape(t, [N, H, W, C]), channels_last)
"""

from __future__ import annotations

import numpy as np

from fuser import Builder, Match, op, rule, var
from fuser.rules._nchwc import EMITS, NCHWC, channels_of, nchwc

SWAP_LAST_TWO = [0, 2, 1]


def _require_swap(m: Match) -> None:
    m.require(list(m.attr("transpose", "perm", [])) == SWAP_LAST_TWO, "the Transpose does not swap tokens and channels")


@rule(
    "nchwc-tokens-output",
    pattern=op.Transpose(
        op.Reshape(nchwc.ReorderOutput(var("x"), name="to_plain"), var("shape"), name="flatten"), name="transpose"
    ),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
)
def nchwc_tokens_output(m: Match, b: Builder):
    """Transpose(Reshape(ReorderOutput(x), [N, C, H*W]), [0, 2, 1])  =>  Reshape(ReorderOutput(x, channels_last=1), [N, H*W, C])."""
    _require_swap(m)
    channels = channels_of(m, "to_plain")
    image, tokens = m.shape("to_plain"), m.shape("flatten")
    m.require(
        image is not None and tokens is not None and len(image) == 4 and len(tokens) == 3,
        f"not a feature map flattened to tokens: {image} -> {tokens}",
    )
    m.require(tokens[0] == image[0] and tokens[1] == channels, f"{image} -> {tokens} does not keep batch and channels")
    nhwc = b.op("ReorderOutput", m["x"], domain=NCHWC, channels=channels, channels_last=1)
    return b.Reshape(nhwc, np.array([0, -1, channels], np.int64))


@rule(
    "nchwc-tokens-input",
    pattern=nchwc.ReorderInput(
        op.Reshape(op.Transpose(var("t"), name="transpose"), var("shape"), name="unflatten"), name="to_blocked"
    ),
    target="onnxruntime",
    emits=EMITS,
    phase=1,
)
def nchwc_tokens_input(m: Match, b: Builder):
    """ReorderInput(Reshape(Transpose(t, [0, 2, 1]), [N, C, H, W]))  =>  ReorderInput(Reshape(t, [N, H, W, C]), channels_last=1)."""
    _require_swap(m)
    m.require(m.attr("to_blocked", "channels_last", 0) == 0, "the reorder already reads channels-last data")
    tokens, image = m.shape("t"), m.shape("unflatten")
    m.require(
        tokens is not None and image is not None and len(tokens) == 3 and len(image) == 4,
        f"not tokens unflattened to a feature map: {tokens} -> {image}",
    )
    m.require(
        all(isinstance(d, int) for d in image[1:]) and tokens[0] == image[0] and tokens[2] == image[1],
        f"{tokens} -> {image} does not keep batch and channels, or the map's size is not fixed",
    )
    _, channels, height, width = image
    nhwc = b.Reshape(m["t"], np.array([0, height, width, channels], np.int64))
    return b.op("ReorderInput", nhwc, domain=NCHWC, channels_last=1)
