"""Regenerate the model corpus: real architectures from their public definitions, small configs, random weights.

    pip install -e '.[corpus]'        # torch, torchvision, transformers, onnxruntime (not needed by the tests)
    python corpus/make_corpus.py      # rewrites corpus/*.onnx and corpus/manifest.json
    python corpus/make_corpus.py --only bert gpt2

Every model is built from its library's class with ``weights=None`` / ``from_config`` (no hub download) and a
fixed seed, then exported twice with torch's TorchScript ("legacy", ``dynamo=False``) ONNX exporter at opset
``OPSET``: ``<name>.onnx`` with static shapes (batch 1, sequence ``SEQ``) and ``<name>_dyn.onnx`` with the
symbolic dims ``batch`` (and ``sequence`` for token models). Each file is checked against the torch module
with onnxruntime before it is written into the manifest.

Random-init networks are degenerate in ways real ones are not (BatchNorm statistics 0/1, ConvNeXt layer
scale 1e-6, zero biases): ``_perturb`` gives every normalisation/scale parameter random values so each
layer's arithmetic is actually exercised by the comparison.

torchvision's PyPI wheel carries CUDA-built ops that do not load next to a CPU torch; the model
definitions do not need them (``_import_torchvision``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus_io import CORPUS_DIR, MANIFEST, relative_error, sha256_of  # noqa: E402

OPSET = 17
SEED = 0
IMAGE = 64          # CNN input side (pixels); ViT uses the same
SEQ = 32            # token models' static sequence length
VOCAB = 1000
CLASSES = 10      # CNN classifier outputs (the classifier is most of a small CNN's weights)
CHECK_RTOL = 1e-4   # exported model vs the torch module (relative_error), else the model is not written


def _import_torchvision():
    """Import torchvision; if its compiled ops failed to load (CUDA wheel next to a CPU torch), declare the
    two op schemas its meta registrations need and import it again. Detection models would not run; the
    classification models here use none of these ops."""
    import torch

    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
        for m in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[m]
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _import_torchvision.lib = lib   # keep the library alive
        import torchvision
    return torchvision


def _perturb(model, rng_seed: int):
    """Random values for every norm's affine parameters, BatchNorm running statistics, ConvNeXt layer scales."""
    import torch

    g = torch.Generator().manual_seed(rng_seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.BatchNorm1d)):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            # torch's BatchNorm/LayerNorm and the libraries' own norms (LlamaRMSNorm, T5LayerNorm, ...)
            weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
            if "Norm" in type(m).__name__ and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1:
                weight.copy_(torch.rand(weight.shape, generator=g) + 0.5)
                if isinstance(bias, torch.nn.Parameter):
                    bias.copy_(torch.randn(bias.shape, generator=g) * 0.1)
            # ConvNeXt-V2's global response norm (transformers ConvNextV2GRN): gamma / beta start at 0, which
            # would make the block skip it
            if type(m).__name__.endswith("GRN"):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            if hasattr(m, "layer_scale") and isinstance(m.layer_scale, torch.nn.Parameter):
                m.layer_scale.copy_(torch.rand(m.layer_scale.shape, generator=g) * 0.5 + 0.5)
    return model


# ---- model builders: (module, config dict for the manifest). One row per model in MODELS below. ----

def _tv_resnet18():
    """torchvision ResNet-18 topology (BasicBlock, [2, 2, 2, 2]) at an eighth of its width: the full
    network is 46 MB of weights, far over the corpus budget; torchvision has no width knob for BasicBlock,
    so the stages are rebuilt with its own ``_make_layer`` at widths 8/16/32/64."""
    import torch
    tv = _import_torchvision()
    from torchvision.models.resnet import BasicBlock, ResNet

    widths = [8, 16, 32, 64]
    m = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=CLASSES)
    m.inplanes = widths[0]
    m.conv1 = torch.nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3, bias=False)
    m.bn1 = torch.nn.BatchNorm2d(widths[0])
    m.layer1 = m._make_layer(BasicBlock, widths[0], 2)
    m.layer2 = m._make_layer(BasicBlock, widths[1], 2, stride=2)
    m.layer3 = m._make_layer(BasicBlock, widths[2], 2, stride=2)
    m.layer4 = m._make_layer(BasicBlock, widths[3], 2, stride=2)
    m.fc = torch.nn.Linear(widths[3], CLASSES)
    return m, {"class": "torchvision.models.resnet.ResNet", "block": "BasicBlock", "layers": [2, 2, 2, 2],
               "stage_widths": widths, "num_classes": CLASSES, "torchvision": tv.__version__}


def _tv_mobilenet_v2():
    tv = _import_torchvision()
    m = tv.models.mobilenet_v2(weights=None, width_mult=0.35, num_classes=CLASSES)
    return m, {"class": "torchvision.models.mobilenet_v2", "width_mult": 0.35, "num_classes": CLASSES}


def _tv_mobilenet_v3_small():
    _import_torchvision()
    from torchvision.models.mobilenetv3 import MobileNetV3, _mobilenet_v3_conf

    setting, last = _mobilenet_v3_conf("mobilenet_v3_small", width_mult=0.5, reduced_tail=True)
    m = MobileNetV3(setting, last, num_classes=CLASSES)
    return m, {"class": "torchvision.models.mobilenetv3.MobileNetV3", "arch": "mobilenet_v3_small",
               "width_mult": 0.5, "reduced_tail": True, "num_classes": CLASSES}


def _tv_efficientnet_b0():
    _import_torchvision()
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    setting, last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.5)
    m = EfficientNet(setting, dropout=0.2, num_classes=CLASSES, last_channel=last)
    return m, {"class": "torchvision.models.efficientnet.EfficientNet", "arch": "efficientnet_b0",
               "width_mult": 0.25, "depth_mult": 0.5, "num_classes": CLASSES}


def _tv_convnext():
    _import_torchvision()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    blocks = [(16, 32, 1), (32, 64, 1), (64, 128, 2), (128, None, 1)]
    m = ConvNeXt([CNBlockConfig(*b) for b in blocks], stochastic_depth_prob=0.0, num_classes=CLASSES)
    return m, {"class": "torchvision.models.convnext.ConvNeXt", "like": "convnext_tiny",
               "block_setting": [list(b) for b in blocks], "num_classes": CLASSES}


def _tv_squeezenet1_1():
    tv = _import_torchvision()
    m = tv.models.squeezenet1_1(weights=None, num_classes=CLASSES)
    return m, {"class": "torchvision.models.squeezenet1_1", "num_classes": CLASSES}


def _tv_shufflenet_v2():
    tv = _import_torchvision()
    """torchvision's shufflenet_v2_x0_5 stages with a 512-channel (not 1024) last conv: half its weights."""
    _import_torchvision()
    from torchvision.models.shufflenetv2 import ShuffleNetV2

    repeats, channels = [4, 8, 4], [24, 48, 96, 192, 512]
    m = ShuffleNetV2(repeats, channels, num_classes=CLASSES)
    return m, {"class": "torchvision.models.shufflenetv2.ShuffleNetV2", "like": "shufflenet_v2_x0_5",
               "stages_repeats": repeats, "stages_out_channels": channels, "num_classes": CLASSES}


def _tv_mnasnet():
    tv = _import_torchvision()
    _import_torchvision()
    from torchvision.models.mnasnet import MNASNet

    m = MNASNet(0.25, num_classes=CLASSES)
    return m, {"class": "torchvision.models.mnasnet.MNASNet", "like": "mnasnet0_5", "alpha": 0.25,
               "num_classes": CLASSES}


def _tv_regnet_y():
    """torchvision RegNet-Y (grouped 3x3 convs, squeeze-excite in every block) at a reduced width/depth:
    regnet_y_400mf is depth 16, w_0 48, w_a 27.89, w_m 2.09, group width 8."""
    tv = _import_torchvision()
    from torchvision.models.regnet import BlockParams, RegNet

    params = dict(depth=6, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    m = RegNet(BlockParams.from_init_params(**params), num_classes=CLASSES)
    return m, {"class": "torchvision.models.regnet.RegNet", "like": "regnet_y_400mf", "block_params": params,
               "num_classes": CLASSES, "torchvision": tv.__version__}


def _tv_densenet():
    """torchvision DenseNet (every layer concatenates its input with its new features) at a reduced
    growth/depth: densenet121 is growth 32, blocks (6, 12, 24, 16), 64 initial features, bn_size 4."""
    tv = _import_torchvision()
    from torchvision.models.densenet import DenseNet

    params = dict(growth_rate=8, block_config=(2, 4, 6, 4), num_init_features=16, bn_size=2)
    m = DenseNet(**params, num_classes=CLASSES)
    return m, {"class": "torchvision.models.densenet.DenseNet", "like": "densenet121",
               **{k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
               "num_classes": CLASSES, "torchvision": tv.__version__}


def _tv_swin():
    """torchvision Swin Transformer (shifted-window attention: torch.roll, window partition reshapes, a
    relative position bias, LayerNorm on NHWC tensors) at a tiny config: swin_t is embed 96, depths
    (2, 2, 6, 2), heads (3, 6, 12, 24), window 7."""
    tv = _import_torchvision()
    from torchvision.models.swin_transformer import SwinTransformer

    params = dict(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4])
    m = SwinTransformer(**params, stochastic_depth_prob=0.0, num_classes=CLASSES)
    return m, {"class": "torchvision.models.swin_transformer.SwinTransformer", "like": "swin_t", **params,
               "num_classes": CLASSES, "torchvision": tv.__version__}


def _tv_resnext():
    """torchvision ResNeXt topology (Bottleneck blocks with grouped 3x3 convs, 8 groups) at reduced
    width/depth: resnext50_32x4d is layers (3, 4, 6, 3), 32 groups of width 4 at stage widths 128..1024;
    here one block per stage, ``planes`` 8/16/32/64 with ``width_per_group`` 32 (inner widths 32..256,
    group widths 4..32), rebuilt with torchvision's own ``_make_layer``."""
    import torch
    tv = _import_torchvision()
    from torchvision.models.resnet import Bottleneck, ResNet

    planes, layers, groups, wpg = [8, 16, 32, 64], [1, 1, 1, 1], 8, 32
    m = ResNet(Bottleneck, layers, num_classes=CLASSES, groups=groups, width_per_group=wpg)
    m.inplanes = planes[0]
    m.conv1 = torch.nn.Conv2d(3, planes[0], kernel_size=7, stride=2, padding=3, bias=False)
    m.bn1 = torch.nn.BatchNorm2d(planes[0])
    m.layer1 = m._make_layer(Bottleneck, planes[0], layers[0])
    m.layer2 = m._make_layer(Bottleneck, planes[1], layers[1], stride=2)
    m.layer3 = m._make_layer(Bottleneck, planes[2], layers[2], stride=2)
    m.layer4 = m._make_layer(Bottleneck, planes[3], layers[3], stride=2)
    m.fc = torch.nn.Linear(planes[3] * Bottleneck.expansion, CLASSES)
    return m, {"class": "torchvision.models.resnet.ResNet", "block": "Bottleneck", "like": "resnext50_32x4d",
               "layers": layers, "planes": planes, "groups": groups, "width_per_group": wpg,
               "num_classes": CLASSES, "torchvision": tv.__version__}


# GoogLeNet's nine Inception blocks: (in, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj), torchvision's
# channel counts divided by GOOGLENET_DIV (the full net is 6.6 M parameters)
_GOOGLENET_BLOCKS = {
    "inception3a": (192, 64, 96, 128, 16, 32, 32), "inception3b": (256, 128, 128, 192, 32, 96, 64),
    "inception4a": (480, 192, 96, 208, 16, 48, 64), "inception4b": (512, 160, 112, 224, 24, 64, 64),
    "inception4c": (512, 128, 128, 256, 24, 64, 64), "inception4d": (512, 112, 144, 288, 32, 64, 64),
    "inception4e": (528, 256, 160, 320, 32, 128, 128), "inception5a": (832, 256, 160, 320, 32, 128, 128),
    "inception5b": (832, 384, 192, 384, 48, 128, 128),
}
GOOGLENET_DIV = 8


def _tv_googlenet():
    """torchvision GoogLeNet (Inception v1: four parallel branches 1x1 / 1x1->3x3 / 1x1->3x3 / maxpool->1x1
    concatenated, ceil-mode max pools) with every channel count divided by GOOGLENET_DIV, no auxiliary heads
    (eval mode drops them anyway), ``transform_input=False``; the stem and the nine blocks are rebuilt with
    torchvision's own ``BasicConv2d`` / ``Inception``."""
    import torch
    tv = _import_torchvision()
    from torchvision.models.googlenet import BasicConv2d, GoogLeNet, Inception

    d = GOOGLENET_DIV
    m = GoogLeNet(num_classes=CLASSES, aux_logits=False, transform_input=False, init_weights=True)
    m.conv1 = BasicConv2d(3, 64 // d, kernel_size=7, stride=2, padding=3)
    m.conv2 = BasicConv2d(64 // d, 64 // d, kernel_size=1)
    m.conv3 = BasicConv2d(64 // d, 192 // d, kernel_size=3, padding=1)
    for name, chans in _GOOGLENET_BLOCKS.items():
        setattr(m, name, Inception(*(c // d for c in chans)))
    m.fc = torch.nn.Linear(1024 // d, CLASSES)
    return m, {"class": "torchvision.models.googlenet.GoogLeNet", "like": "googlenet", "channel_divisor": d,
               "aux_logits": False, "transform_input": False, "num_classes": CLASSES,
               "torchvision": tv.__version__}


_HF_COMMON = dict(initializer_range=0.1)


def _hf(cls_name: str, cfg_name: str, attn: str = "eager", **cfg):
    """A transformers model from its config class. ``attn``: "eager" (plain MatMul/Softmax graph) or, for
    causal models, "sdpa_without_vmap": transformers' own export path (integrations.executorch), since the
    causal mask builder of eager attention uses torch.vmap, which the TorchScript exporter cannot trace
    ("RuntimeError: unordered_map::at")."""
    _import_torchvision()   # transformers imports torchvision when it is installed
    import transformers

    if attn == "sdpa_without_vmap":
        try:
            from transformers.integrations.executorch import sdpa_mask_without_vmap
        except ImportError:
            # transformers >= 5 dropped it: its sdpa mask builder no longer uses vmap unless a mask
            # function needs it (masking_utils.sdpa_mask(use_vmap=False) by default), so eager attention
            # exports (not sdpa: the exporter cannot convert scaled_dot_product_attention with enable_gqa).
            # Its causal mask does look for packed sequences in the position ids (torch.diff, which the
            # TorchScript exporter cannot export, then a CumSum of bools that ONNX rejects); the corpus
            # feeds one sequence per row, for which that search returns None: skip it.
            import transformers.masking_utils as masking_utils

            masking_utils.find_packed_sequence_indices = lambda position_ids: None
            attn = "eager"
        else:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            ALL_MASK_ATTENTION_FUNCTIONS.register(attn, sdpa_mask_without_vmap)
            ALL_ATTENTION_FUNCTIONS.register(attn, ALL_ATTENTION_FUNCTIONS["sdpa"])
    config = getattr(transformers, cfg_name)(**_HF_COMMON, **cfg)
    config._attn_implementation = attn
    model = getattr(transformers, cls_name)(config)
    return model, {"class": f"transformers.{cls_name}", "config_class": f"transformers.{cfg_name}",
                   "config": {**_HF_COMMON, **cfg}, "attn_implementation": attn,
                   "transformers": transformers.__version__}


def _hf_bert():
    _import_torchvision()
    import transformers

    cfg = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=256, max_position_embeddings=128, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
    config = transformers.BertConfig(**_HF_COMMON, **cfg)
    config._attn_implementation = "eager"
    model = transformers.BertModel(config, add_pooling_layer=False)
    return model, {"class": "transformers.BertModel", "config_class": "transformers.BertConfig",
                   "config": {**_HF_COMMON, **cfg}, "add_pooling_layer": False, "attn_implementation": "eager",
                   "transformers": transformers.__version__}


def _hf_gpt2():
    return _hf("GPT2Model", "GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
               n_inner=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
               attn="sdpa_without_vmap")


def _hf_llama():
    return _hf("LlamaModel", "LlamaConfig", vocab_size=VOCAB, hidden_size=64, intermediate_size=172,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               use_cache=False, attn="sdpa_without_vmap")


def _hf_vit():
    return _hf("ViTModel", "ViTConfig", image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=64,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)


def _hf_t5_encoder():
    return _hf("T5EncoderModel", "T5Config", vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=256, num_layers=2,
               num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=32, use_cache=False)


MEL_BINS, FRAMES = 16, 100   # whisper_encoder input: mel bins x frames (the encoder requires 2 x max_source_positions)


def _hf_whisper_encoder():
    """transformers' Whisper encoder (two Conv1d + GELU over mel frames, sinusoidal positions, pre-LayerNorm
    attention) at a tiny config: whisper-tiny is 80 mels, d_model 384, 4 layers, 6 heads, 3000 frames."""
    _import_torchvision()
    import transformers
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = dict(vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=64, encoder_layers=2, encoder_attention_heads=4,
               encoder_ffn_dim=256, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=256,
               max_source_positions=FRAMES // 2, max_target_positions=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, use_cache=False)
    config = transformers.WhisperConfig(init_std=0.1, **cfg)
    config._attn_implementation = "eager"
    model = WhisperEncoder(config)
    return model, {"class": "transformers.models.whisper.modeling_whisper.WhisperEncoder",
                   "config_class": "transformers.WhisperConfig", "config": {"init_std": 0.1, **cfg},
                   "attn_implementation": "eager", "transformers": transformers.__version__}


def _hf_mobilevit():
    """transformers MobileViT (MobileNetV2 inverted residuals, then MobileViT blocks: a conv, an unfold of
    2x2 patches into sequences, a transformer, a fold back, a fusion conv over the concatenation with the
    block input) at a tiny config: mobilevit-small is hidden (144, 192, 240), neck (16, 32, 64, 96, 128,
    160, 640) at 256x256."""
    return _hf("MobileViTModel", "MobileViTConfig", image_size=IMAGE, patch_size=2, hidden_sizes=[32, 48, 64],
               neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 96], num_attention_heads=2, mlp_ratio=2.0,
               expand_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               classifier_dropout_prob=0.0)


AUDIO_SAMPLES = 1600   # wav2vec2 input: raw waveform samples (0.1 s at 16 kHz)


def _hf_wav2vec2():
    """transformers Wav2Vec2 (a strided Conv1d feature extractor with GroupNorm on the first layer, a
    feature projection, a grouped Conv1d positional embedding (weight norm), post-LN attention) at a tiny
    config: wav2vec2-base is conv_dim 7 x 512, hidden 768, 12 layers, 12 heads, 128-wide pos conv in 16
    groups."""
    return _hf("Wav2Vec2Model", "Wav2Vec2Config", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=256, conv_dim=[32, 32, 32], conv_stride=[5, 2, 2], conv_kernel=[10, 3, 3],
               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
               activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
               apply_spec_augment=False, mask_time_prob=0.0)


def _hf_phi():
    """transformers Phi (phi-2 family: parallel attention + MLP off one LayerNorm, partial rotary embedding
    on half of each head, biased projections, gelu_new) at a tiny config with GQA (4 heads / 2 KV heads):
    phi-2 is hidden 2560, 32 layers, 32 heads."""
    return _hf("PhiModel", "PhiConfig", vocab_size=VOCAB, hidden_size=64, intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               use_cache=False, attn="sdpa_without_vmap")


def _hf_qwen2():
    """transformers Qwen2 (RMSNorm, full rotary, GQA, biased q/k/v projections, SwiGLU) at a tiny config:
    Qwen2-0.5B is hidden 896, 24 layers, 14 heads / 2 KV heads."""
    return _hf("Qwen2Model", "Qwen2Config", vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
               use_cache=False, attn="sdpa_without_vmap")


# ---- session 10: more unseen families (benchmarks/notes/corpus10.md) ----

INCEPTION_IMAGE = 80   # inception_v3 input side: its valid (unpadded) stride-2 convs need >= 75 pixels
INCEPTION_DIV = 8      # every inception_v3 channel count divided by this (the full net is 27 M parameters)


def _tv_inception_v3():
    """torchvision Inception v3 (factorised 1x7 / 7x1 and 1x3 / 3x1 convolutions, grid reductions by
    parallel stride-2 branches, valid stem convs) with every channel count divided by INCEPTION_DIV, no
    auxiliary head, ``transform_input=False``, at INCEPTION_IMAGE pixels (inception_v3: 299); built with
    torchvision's own blocks through ``Inception3(inception_blocks=...)`` and a conv block that divides."""
    import functools

    import torch
    tv = _import_torchvision()
    from torchvision.models import inception as inc

    d = INCEPTION_DIV

    def conv_block(in_channels, out_channels, **kwargs):
        return inc.BasicConv2d(in_channels if in_channels == 3 else in_channels // d, out_channels // d, **kwargs)

    blocks = [conv_block] + [functools.partial(b, conv_block=conv_block) for b in
                             (inc.InceptionA, inc.InceptionB, inc.InceptionC, inc.InceptionD, inc.InceptionE,
                              inc.InceptionAux)]
    m = inc.Inception3(num_classes=CLASSES, aux_logits=False, transform_input=False, inception_blocks=blocks,
                       init_weights=True)
    m.fc = torch.nn.Linear(2048 // d, CLASSES)
    return m, {"class": "torchvision.models.inception.Inception3", "like": "inception_v3", "channel_divisor": d,
               "aux_logits": False, "transform_input": False, "image": INCEPTION_IMAGE, "num_classes": CLASSES,
               "torchvision": tv.__version__}


def _tv_efficientnet_v2():
    """torchvision EfficientNetV2 (Fused-MBConv stages: one full 3x3 conv in place of 1x1 expand + depthwise,
    then MBConv stages with squeeze-excite) at a reduced width/depth: efficientnet_v2_s is widths 24..256,
    layers (2, 4, 4, 6, 9, 15), last channel 1280."""
    import functools

    import torch
    tv = _import_torchvision()
    from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig

    # (expand_ratio, kernel, stride, input_channels, out_channels, num_layers), the order of v2_s's setting
    fused = [(1, 3, 1, 8, 8, 1), (4, 3, 2, 8, 16, 2), (4, 3, 2, 16, 24, 2)]
    mb = [(4, 3, 2, 24, 32, 2), (6, 3, 1, 32, 48, 2), (6, 3, 2, 48, 64, 2)]
    last = 256
    setting = [FusedMBConvConfig(*r) for r in fused] + [MBConvConfig(*r, width_mult=1.0, depth_mult=1.0)
                                                        for r in mb]
    # v2's BatchNorm eps as torchvision's efficientnet_v2_s builder sets it
    m = EfficientNet(setting, dropout=0.2, stochastic_depth_prob=0.0, num_classes=CLASSES, last_channel=last,
                     norm_layer=functools.partial(torch.nn.BatchNorm2d, eps=1e-3))
    return m, {"class": "torchvision.models.efficientnet.EfficientNet", "like": "efficientnet_v2_s",
               "fused_mbconv": [list(r) for r in fused], "mbconv": [list(r) for r in mb], "last_channel": last, "bn_eps": 1e-3,
               "num_classes": CLASSES, "torchvision": tv.__version__}


def _hf_opt():
    """transformers OPT (learned positions with an offset of 2, ReLU FFN, post-LN blocks as opt-350m with
    ``do_layer_norm_before=False``, embeddings projected 32 -> 64 -> 32 by bias-free project_in/out) at a
    tiny config: opt-350m is hidden 1024, 24 layers, 16 heads, word_embed_proj_dim 512."""
    return _hf("OPTModel", "OPTConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=256,
               num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=32,
               do_layer_norm_before=False, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
               layerdrop=0.0, use_cache=False, attn="sdpa_without_vmap")


def _hf_bloom():
    """transformers BLOOM (ALiBi: a per-head linear bias on key positions in place of position embeddings,
    LayerNorm on the word embeddings, fused query_key_value, tanh-approximate GELU) at a tiny config:
    bloom-560m is hidden 1024, 24 layers, 16 heads."""
    return _hf("BloomModel", "BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
               hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, attn="sdpa_without_vmap")


def _hf_albert():
    """transformers ALBERT (factorised embedding 32 -> 64, one transformer layer's weights shared by every
    layer, GELU-new FFN) at a tiny config without pooler: albert-base-v2 is embedding 128, hidden 768,
    12 layers sharing one, 12 heads."""
    _import_torchvision()
    import transformers

    cfg = dict(vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=256, max_position_embeddings=128, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    config = transformers.AlbertConfig(**_HF_COMMON, **cfg)
    config._attn_implementation = "eager"
    model = transformers.AlbertModel(config, add_pooling_layer=False)
    return model, {"class": "transformers.AlbertModel", "config_class": "transformers.AlbertConfig",
                   "config": {**_HF_COMMON, **cfg}, "add_pooling_layer": False, "attn_implementation": "eager",
                   "transformers": transformers.__version__}


# ---- session 11: more unseen families (benchmarks/notes/corpus11.md) ----

def _hf_roberta():
    """transformers RoBERTa (BERT layers; position ids from the input ids: ``cumsum(input_ids != pad) + pad``,
    computed per call, a CumSum in the static graph too) at a tiny config without pooler: roberta-base is
    hidden 768, 12 layers, 12 heads."""
    _import_torchvision()
    import transformers

    cfg = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=256, max_position_embeddings=SEQ + 2 + 64, type_vocab_size=1, pad_token_id=1,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config = transformers.RobertaConfig(**_HF_COMMON, **cfg)
    config._attn_implementation = "eager"
    model = transformers.RobertaModel(config, add_pooling_layer=False)
    return model, {"class": "transformers.RobertaModel", "config_class": "transformers.RobertaConfig",
                   "config": {**_HF_COMMON, **cfg}, "add_pooling_layer": False, "attn_implementation": "eager",
                   "transformers": transformers.__version__}


def _hf_deberta_v2():
    """transformers DeBERTa-v2 (disentangled attention: content-to-position and position-to-content scores
    gathered from a relative-position embedding by log-bucketed relative positions, scaled by 1/sqrt(3d))
    at a tiny config: deberta-v3-base is hidden 768, 12 layers, 12 heads, 256 position buckets."""
    _import_torchvision()
    import transformers

    cfg = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=256, max_position_embeddings=128, relative_attention=True, position_buckets=16,
               max_relative_positions=-1, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
               share_att_key=True, position_biased_input=False, type_vocab_size=0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
    config = transformers.DebertaV2Config(**_HF_COMMON, **cfg)
    config._attn_implementation = "eager"
    model = transformers.DebertaV2Model(config)
    return model, {"class": "transformers.DebertaV2Model", "config_class": "transformers.DebertaV2Config",
                   "config": {**_HF_COMMON, **cfg}, "attn_implementation": "eager",
                   "transformers": transformers.__version__}


def _hf_segformer():
    """transformers SegFormer encoder (MiT: overlapping strided patch-embedding convs, efficient
    self-attention whose keys/values come from a strided "spatial reduction" conv + LayerNorm, Mix-FFN with a
    3x3 depthwise conv between its two linears) at a tiny config: mit-b0 is hidden (32, 64, 160, 256),
    depths (2, 2, 2, 2), heads (1, 2, 5, 8) at 512x512."""
    return _hf("SegformerModel", "SegformerConfig", image_size=IMAGE, num_channels=3, num_encoder_blocks=4,
               depths=[1, 1, 1, 1], sr_ratios=[8, 4, 2, 1], hidden_sizes=[16, 32, 48, 64],
               patch_sizes=[7, 3, 3, 3], strides=[4, 2, 2, 2], num_attention_heads=[1, 2, 2, 4],
               mlp_ratios=[4, 4, 4, 4], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               classifier_dropout_prob=0.0, drop_path_rate=0.0)


def _hf_convnextv2():
    """transformers ConvNeXt-V2 (ConvNeXt blocks with a global response norm: the per-channel L2 norm over
    H x W divided by its mean over channels, ``gamma * (x * n) + beta + x``; no layer scale) at a reduced
    width/depth: convnextv2-atto is hidden (40, 80, 160, 320), depths (2, 2, 6, 2)."""
    return _hf("ConvNextV2Model", "ConvNextV2Config", num_channels=3, hidden_sizes=[16, 32, 64, 128],
               depths=[1, 1, 2, 1], drop_path_rate=0.0, image_size=IMAGE)


def _hf_levit():
    """transformers LeViT (a 4-conv stride-16 stem with hardswish, attention over a 2-D grid with a learned
    per-head bias gathered by constant offsets, BatchNorm after every linear, hardswish before the output
    projection, shrinking attention that subsamples the queries) at a reduced config: levit-128S is hidden
    (128, 256, 384), heads (4, 6, 8), depths (2, 3, 4) at 224x224."""
    hidden, key_dim = [32, 48, 64], [8, 8, 8]
    return _hf("LevitModel", "LevitConfig", image_size=IMAGE, num_channels=3, patch_size=16,
               hidden_sizes=hidden, num_attention_heads=[2, 3, 4], depths=[1, 1, 1], key_dim=key_dim,
               mlp_ratio=[2, 2, 2], attention_ratio=[2, 2, 2],
               down_ops=[["Subsample", key_dim[0], hidden[0] // key_dim[0], 4, 2, 2],
                         ["Subsample", key_dim[0], hidden[1] // key_dim[0], 4, 2, 2]])


def _audio_inputs():
    return [{"name": "input_features", "shape": [1, MEL_BINS, FRAMES], "dyn_shape": ["batch", MEL_BINS, FRAMES],
             "dtype": "float32"}]


def _waveform_inputs():
    return [{"name": "input_values", "shape": [1, AUDIO_SAMPLES], "dyn_shape": ["batch", AUDIO_SAMPLES],
             "dtype": "float32"}]


def _image_inputs(side: int = IMAGE):
    return [{"name": "pixel_values", "shape": [1, 3, side, side], "dyn_shape": ["batch", 3, side, side],
             "dtype": "float32"}]


def _token_inputs(mask: bool = False):
    ids = {"name": "input_ids", "shape": [1, SEQ], "dyn_shape": ["batch", "sequence"], "dtype": "int64",
           "int_range": [0, VOCAB]}
    if not mask:
        return [ids]
    return [ids, {"name": "attention_mask", "shape": [1, SEQ], "dyn_shape": ["batch", "sequence"],
                  "dtype": "int64", "int_range": [1, 2]}]


# name, builder, library, inputs, output name
MODELS = [
    ("resnet18", _tv_resnet18, "torchvision", _image_inputs(), "logits"),
    ("mobilenet_v2", _tv_mobilenet_v2, "torchvision", _image_inputs(), "logits"),
    ("mobilenet_v3_small", _tv_mobilenet_v3_small, "torchvision", _image_inputs(), "logits"),
    ("efficientnet_b0", _tv_efficientnet_b0, "torchvision", _image_inputs(), "logits"),
    ("convnext", _tv_convnext, "torchvision", _image_inputs(), "logits"),
    ("squeezenet1_1", _tv_squeezenet1_1, "torchvision", _image_inputs(), "logits"),
    ("shufflenet_v2", _tv_shufflenet_v2, "torchvision", _image_inputs(), "logits"),
    ("mnasnet", _tv_mnasnet, "torchvision", _image_inputs(), "logits"),
    ("bert", _hf_bert, "transformers", _token_inputs(mask=True), "last_hidden_state"),
    ("gpt2", _hf_gpt2, "transformers", _token_inputs(), "last_hidden_state"),
    ("llama", _hf_llama, "transformers", _token_inputs(), "last_hidden_state"),
    ("vit", _hf_vit, "transformers", _image_inputs(), "last_hidden_state"),
    ("t5_encoder", _hf_t5_encoder, "transformers", _token_inputs(), "last_hidden_state"),
    # session 8: architectures tvmfuse had not been tuned against (benchmarks/notes/corpus8.md)
    ("regnet_y", _tv_regnet_y, "torchvision", _image_inputs(), "logits"),
    ("densenet", _tv_densenet, "torchvision", _image_inputs(), "logits"),
    ("swin", _tv_swin, "torchvision", _image_inputs(), "logits"),
    ("whisper_encoder", _hf_whisper_encoder, "transformers", _audio_inputs(), "last_hidden_state"),
    # session 9: more unseen families (benchmarks/notes/corpus9.md)
    ("resnext", _tv_resnext, "torchvision", _image_inputs(), "logits"),
    ("googlenet", _tv_googlenet, "torchvision", _image_inputs(), "logits"),
    ("mobilevit", _hf_mobilevit, "transformers", _image_inputs(), "last_hidden_state"),
    ("wav2vec2", _hf_wav2vec2, "transformers", _waveform_inputs(), "last_hidden_state"),
    ("phi", _hf_phi, "transformers", _token_inputs(), "last_hidden_state"),
    ("qwen2", _hf_qwen2, "transformers", _token_inputs(), "last_hidden_state"),
    # session 10 (benchmarks/notes/corpus10.md)
    ("opt", _hf_opt, "transformers", _token_inputs(), "last_hidden_state"),
    ("bloom", _hf_bloom, "transformers", _token_inputs(), "last_hidden_state"),
    ("albert", _hf_albert, "transformers", _token_inputs(mask=True), "last_hidden_state"),
    ("efficientnet_v2", _tv_efficientnet_v2, "torchvision", _image_inputs(), "logits"),
    ("inception_v3", _tv_inception_v3, "torchvision", _image_inputs(INCEPTION_IMAGE), "logits"),
    # session 11 (benchmarks/notes/corpus11.md)
    ("roberta", _hf_roberta, "transformers", _token_inputs(mask=True), "last_hidden_state"),
    ("deberta_v2", _hf_deberta_v2, "transformers", _token_inputs(mask=True), "last_hidden_state"),
    ("segformer", _hf_segformer, "transformers", _image_inputs(), "last_hidden_state"),
    ("convnextv2", _hf_convnextv2, "transformers", _image_inputs(), "last_hidden_state"),
    ("levit", _hf_levit, "transformers", _image_inputs(), "last_hidden_state"),
]


def _single_output(module, library: str):
    """transformers models return a ModelOutput: wrap them to return its first tensor only."""
    import torch

    if library != "transformers":
        return module

    class FirstOutput(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(*args, return_dict=True)[0]

    return FirstOutput(module)


def _example(inputs, rng):
    import torch

    out = []
    for spec in inputs:
        if spec["dtype"] == "int64":
            lo, hi = spec["int_range"]
            out.append(torch.from_numpy(rng.integers(lo, hi, size=spec["shape"], dtype=np.int64)))
        else:
            out.append(torch.from_numpy(rng.standard_normal(spec["shape"]).astype(np.float32)))
    return tuple(out)


def _export(module, example, inputs, output: str, path: str, dynamic: bool):
    import torch

    names = [s["name"] for s in inputs]
    axes = None
    if dynamic:
        axes = {s["name"]: {i: d for i, d in enumerate(s["dyn_shape"]) if isinstance(d, str)} for s in inputs}
        seq = "sequence" in {d for s in inputs for d in s["dyn_shape"]}
        axes[output] = {0: "batch", **({1: "sequence"} if seq else {})}
    torch.onnx.export(module, example, path, input_names=names, output_names=[output], opset_version=OPSET,
                      dynamic_axes=axes, do_constant_folding=True, dynamo=False)


def _check(path: str, module, inputs, rng, dims: dict | None) -> float:
    """Relative error of onnxruntime on the exported file vs the torch module, on fresh inputs."""
    import onnxruntime as ort
    import torch

    shaped = [dict(s, shape=[dims[d] if isinstance(d, str) else d for d in s["dyn_shape"]]) if dims else s
              for s in inputs]
    example = _example(shaped, rng)
    with torch.no_grad():
        want = module(*example).numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = sess.run(None, {s["name"]: t.numpy() for s, t in zip(inputs, example)})[0]
    return relative_error(got, want)


def seeded_module(name: str):
    """(module, source config, module returning the one output) of the corpus model ``name``, built as for
    its ONNX files (same seed, same perturbation): the torch definition behind ``<name>.onnx``
    (``benchmarks/bench_models.py`` compiles it with torch.compile)."""
    import torch

    rows = {row[0]: row for row in MODELS}
    if name not in rows:
        raise KeyError(f"no corpus model {name!r}; known: {sorted(rows)}")
    _, builder, library, _, _ = rows[name]
    torch.manual_seed(SEED)
    module, source = builder()
    module = _perturb(module, SEED).eval()
    return module, source, _single_output(module, library).eval()


def build_one(name, library, inputs, output, out_dir: str) -> dict:
    import onnx
    import torch

    module, source, wrapped = seeded_module(name)
    rng = np.random.default_rng(SEED)
    entry = {"name": name, "library": library, "source": source, "inputs": inputs, "outputs": [output],
             "opset": OPSET, "parameters": int(sum(p.numel() for p in module.parameters())), "files": {}}
    for variant, suffix, dims in (("static", "", None), ("dynamic", "_dyn", {"batch": 2, "sequence": SEQ // 2})):
        fname = f"{name}{suffix}.onnx"
        path = os.path.join(out_dir, fname)
        with torch.no_grad():
            _export(wrapped, _example(inputs, rng), inputs, output, path, dynamic=(variant == "dynamic"))
        onnx.checker.check_model(onnx.load(path), full_check=True)
        err = _check(path, wrapped, inputs, rng, dims)
        if not err <= CHECK_RTOL:
            raise RuntimeError(f"{fname}: onnxruntime differs from torch by relative error {err:.3g} "
                               f"(> {CHECK_RTOL})")
        m = onnx.load(path, load_external_data=False)
        entry["files"][variant] = {"path": fname, "sha256": sha256_of(path), "bytes": os.path.getsize(path),
                                   "nodes": len(m.graph.node), "ort_vs_torch_rel_err": err,
                                   **({"checked_dims": dims} if dims else {})}
    return entry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="regenerate these models only (others keep their manifest rows)")
    ap.add_argument("--out", default=CORPUS_DIR, help="output folder (default: this folder)")
    args = ap.parse_args(argv)
    import onnx
    import onnxruntime
    import torch
    import transformers

    tv = _import_torchvision()
    manifest_path = os.path.join(args.out, "manifest.json")
    old, old_versions = {}, None
    if args.only and os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as f:
            previous = json.load(f)
        old, old_versions = {e["name"]: e for e in previous["models"]}, previous.get("versions")
    wanted = set(args.only or [n for n, *_ in MODELS])
    unknown = wanted - {n for n, *_ in MODELS}
    if unknown:
        ap.error(f"unknown model(s) {sorted(unknown)}; known: {[n for n, *_ in MODELS]}")
    versions = {"torch": torch.__version__, "torchvision": tv.__version__,
                "transformers": transformers.__version__, "onnx": onnx.__version__,
                "onnxruntime": onnxruntime.__version__}
    entries, dropped = [], {}
    for name, _, library, inputs, output in MODELS:
        if name not in wanted:
            if name in old:
                entries.append(old[name])
            continue
        try:
            with tempfile.TemporaryDirectory() as tmp:   # a failed export leaves no half-written file behind
                entry = build_one(name, library, inputs, output, tmp)
                for f in entry["files"].values():
                    os.replace(os.path.join(tmp, f["path"]), os.path.join(args.out, f["path"]))
        except Exception as e:  # a model that cannot export is dropped from the corpus with its reason
            dropped[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            print(f"{name}: DROPPED ({dropped[name]})", flush=True)
            continue
        entry["versions"] = versions   # what wrote these files (a --only run may differ from the others')
        entries.append(entry)
        sizes = ", ".join(f"{v} {f['bytes'] / 1e6:.2f} MB ({f['nodes']} nodes)" for v, f in entry["files"].items())
        print(f"{name}: {entry['parameters']} params; {sizes}", flush=True)
    manifest = {
        "generator": "corpus/make_corpus.py",
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        # a full run's versions; a --only run keeps the previous ones here (its entries carry their own)
        "versions": old_versions if args.only and old_versions else versions,
        "exporter": "torch.onnx.export(dynamo=False)", "opset": OPSET, "seed": SEED,
        "dropped": dropped, "models": entries,
    }
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    total = sum(f["bytes"] for e in entries for f in e["files"].values())
    print(f"{len(entries)} models, {total / 1e6:.2f} MB; dropped: {sorted(dropped) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
