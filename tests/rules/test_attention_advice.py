"""Tests for attention-advice (rules/attention_advice.py): attention that stays unfused is
reported with the reason, and nothing else is."""

from __future__ import annotations

import numpy as np
from onnx import helper

import fuser
from fuser.rules.attention_advice import attention_advice
from fuser.rules.attention_multihead import attention_multihead
from fuser.rules.attention_standard import attention_standard
from tests.helpers import make_model
from tests.rules.test_attention_multihead import attention_model


def advice(model, rules, **kwargs):
    _, report = fuser.optimize(model, rules=rules, check=False, **kwargs)
    return [a.message for a in report.engine.advice if a.rule == "attention-advice"]


def test_grouped_query_attention_is_reported_with_the_reason():
    model, _ = attention_model(kv_heads=2, nan_guard=True)
    (message,) = advice(model, [attention_multihead, attention_advice], target="onnxruntime")
    assert message.startswith("attention left unfused: Q has 4 heads but K has 2")


def test_mask_before_scaling_is_reported():
    model, _ = attention_model(mask="padding", mask_before_scale=True, nan_guard=True)
    (message,) = advice(model, [attention_multihead, attention_advice], target="onnxruntime")
    assert "the mask is added before the scores are scaled" in message


def test_old_opset_on_the_onnx_target_says_what_would_fuse_it():
    model, _ = attention_model(opset=17)
    (message,) = advice(model, [attention_standard, attention_advice])
    assert "needs opset 23 (the model has 17)" in message
    assert "MultiHeadAttention" in message


def test_old_opset_on_the_onnxruntime_target_says_where_to_find_why_it_stayed():
    model, _ = attention_model(opset=17, probs_output=True, nan_guard=True)  # the probabilities are a graph output
    (message,) = advice(model, [attention_multihead, attention_advice], target="onnxruntime")
    assert "--rule attention-multihead tells why not" in message


def test_eager_attention_says_why_multihead_attention_would_not_pay():
    model, _ = attention_model(opset=17)
    for rules, kwargs in (([attention_multihead, attention_advice], {"target": "onnxruntime"}), ([attention_advice], {})):
        (message,) = advice(model, rules, **kwargs)
        assert "needs opset 23 (the model has 17)" in message
        assert "would run no faster than the attention as it is" in message


def test_fused_attention_is_not_reported():
    model, _ = attention_model(nan_guard=True)
    assert advice(model, [attention_multihead, attention_advice], target="onnxruntime") == []
    model, _ = attention_model(opset=23)
    assert advice(model, [attention_standard, attention_advice]) == []


def test_a_classifier_softmax_is_not_attention():
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "w"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["y"], axis=-1),
        ],
        [("x", np.float32, [2, 4])],
        [("y", np.float32, [2, 3])],
        {"w": np.ones((4, 3), np.float32)},
    )
    assert advice(model, [attention_advice]) == []
