"""quantize byte ratios at CLIP ViT-L/14-336 widths (random weights, few layers) with a small Llama decoder."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import graphs
from vlmc.exporters import Source, export
from vlmc.package import Package
from vlmc.pass_api import get

# CLIP ViT-L/14-336 widths with 3 layers, all feeding the projector (vision_feature_layer -1), to keep
# the test fast; LLaVA-1.5's 24 layers only lower the ratios (the fixed fp32 position table weighs less).
VISION = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "patch_size": 14,
    "image_size": 336,
    "num_hidden_layers": 3,
}


@pytest.fixture(scope="module")
def clip_l(tmp_path_factory):
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    v = CLIPVisionConfig(projection_dim=768, **VISION)
    t = LlamaConfig(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg = LlavaConfig(
        vision_config=v, text_config=t, image_token_index=319, vision_feature_layer=-1, pad_token_id=0
    )
    for c in (cfg, v, t):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    out = tmp_path_factory.mktemp("clip_l") / "pkg"
    export(Source(name="clip-l", model=model, config=cfg, family="llava")).save(out)
    return out


def test_int8_vision_and_int4_decoder_byte_ratios(clip_l):
    pkg = Package.load(clip_l)
    fp32_vision = graphs.initializer_bytes(pkg.model("vision_encoder"))
    res = get("quantize")(
        vision_encoder={"weights": "int8", "activations": "int8", "calibration": {"count": 2}},
        decoder={"weights": "int4"},
        eval_tokens=0,
        eval_samples=1,
    ).run(pkg)
    vis = res.report["graphs"]["vision_encoder"]
    assert vis["bytes_before"] == fp32_vision
    print(
        f"int8 vision bytes ratio {vis['bytes_ratio']}, int4 decoder MatMul weights ratio "
        f"{res.report['graphs']['decoder']['matmul_weight_bytes_ratio']}"
    )
    assert graphs.initializer_bytes(pkg.model("vision_encoder")) <= 0.27 * fp32_vision
    assert vis["fidelity"]["image_features"]["cosine"] >= 0.99
    dec = res.report["graphs"]["decoder"]
    assert dec["matmul_weight_bytes_ratio"] <= 0.16
    q = pkg.info("decoder")["quantization"]
    assert q["weights"]["group_size"] == 128 and q["weights"]["dtype"] == "int4"
    inits = pkg.model("decoder").graph.initializers
    for node, f in q["weights"]["nodes"].items():
        assert inits[f["weight"]].dtype == ir.DataType.UINT8, node  # two int4 values per byte
        k_half, n = inits[f["weight"]].shape
        assert list(inits[f["scale"]].shape) == [2 * k_half // 128, 1, n]


def test_fp16_vision_byte_ratio(clip_l):
    pkg = Package.load(clip_l)
    before = graphs.initializer_bytes(pkg.model("vision_encoder"))
    res = get("quantize")(vision_encoder={"weights": "fp16"}, eval_tokens=0, eval_samples=1).run(pkg)
    assert graphs.initializer_bytes(pkg.model("vision_encoder")) <= 0.51 * before
    assert res.report["graphs"]["vision_encoder"]["fidelity"]["image_features"]["cosine"] >= 0.999
    assert np.isclose(
        res.report["graphs"]["vision_encoder"]["bytes_ratio"],
        graphs.initializer_bytes(pkg.model("vision_encoder")) / before,
        atol=1e-4,
    )
