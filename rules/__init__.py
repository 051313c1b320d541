"""Built-in rules, one per module, and the order they are tried in (ORDER below).

Each rule's `phase=` decides first: simplification (-1) reaches its fixed point before the
fusions (0), the fusions before the layout and cleanup rules (1), and those before the
advice (2), whatever the position here. Within a phase the order matters only between rules
that can root at the same node: the engine tries them in this order and applies the first
that fits. Within a module, rules are tried in the order they are defined. A new rule file
goes into this list (tests/test_rule_order.py checks that every module is listed once).
"""

ORDER = [
    # Simplification (phase -1): folds and removals that expose the patterns fusions look for.
    # The sweeps first: dead code goes before anything spends time on it, Constant nodes
    # become initializers, then equal initializers are shared.
    "dead_code",
    "constant_node",
    "shared_initializer",
    "constant_fold",
    "identity_elimination",
    "identity_output",
    "shape_fold",
    "common_subexpression",  # phase 1: merging earlier would give fusable chains extra consumers
    "pad_conv_fold",
    "cast_like",
    "cast_chain",
    "hardsigmoid_decomposed",
    "hardswish_decomposed",
    "neutral_element",
    "noop_elimination",
    "reshape_chain",
    "slice_chain",
    "transpose_chain",
    "transpose_reshape",  # phase 1: after the fusions, which read attention heads' Transposes
    "dropout_elimination",
    "reshape_dims_fold",
    "shape_where_fold",
    # Affine maps folded into convolutions: BatchNormalization, a per-channel scale, a bias.
    "conv_bn_fold",
    "conv_mul_scale",
    "conv_add_bias",
    # Transformer blocks: norms (then their learned weight and bias folded into them, then the
    # Skip* forms in phase 1), rotary embeddings, activations, attention.
    "layer_norm",
    "norm_affine_fold",
    "rms_norm",
    "norm_cast_fold",
    "norm_scale_through_cast",
    "skip_norm",
    "batchnorm_affine_fold",
    "rotary_embedding",  # before attention, which takes the rotated heads as they come
    "gelu",
    "bias_gelu",
    "silu",
    "attention_multihead",
    "attention_standard",
    "matmul_add_gemm",
    "tied_head",
    # Softmax and the logarithms of its written-out forms.
    "softmax_decomposed",
    "log_softmax",
    "log_sum_exp",
    # onnxruntime's fused kernels. fused-conv and fused-conv-residual root at the activation
    # like residual-add-relu below, which must come after them: it reports the residual
    # blocks that neither fused.
    "fused_conv",
    "fused_conv_residual",
    "fused_gemm",
    # Advice on what stayed unfused (attention-advice runs in phase 2, after everything).
    "attention_advice",
    "residual_add_relu",
    # onnxruntime's NCHWc layout (phase 1): convolutions, then the reorders between them
    # cancel and activations, residual Adds, pools, Concat and BatchNormalization follow into
    # the blocked layout, and so does a Resize by whole factors. An activation goes into its convolution (nchwc-activation) before it
    # is carried as an operator of its own (nchwc-elementwise), a residual Add becomes the Sum
    # input (nchwc-conv-add) before it runs on blocked tensors (nchwc-binary), and
    # a per-channel gate becomes a depthwise convolution (nchwc-gate) after both. nchwc-region
    # roots at the convolutions like nchwc-conv and comes after it: it reports the ones left
    # in NCHW.
    "nchwc_conv",
    "nchwc_reorder_cancel",
    "nchwc_activation",
    "nchwc_conv_add",
    "nchwc_pool",
    "nchwc_concat",
    "nchwc_upsample",
    "nchwc_batchnorm",
    "nchwc_elementwise",
    "nchwc_binary",
    "nchwc_gate",
    "nchwc_channels_last",
    "nchwc_tokens",
    "nchwc_region",
]
