"""GLM-4.1V: packed ViT with bicubic position taps and Conv2d downsample, GLM smart resize, raw-input parity."""

from __future__ import annotations

import _tokenizers_qwen3
import numpy as np
import pytest
import torch
from _real_tokenizers import save_image

from vlmc import exporters, ortsession, verify
from vlmc.package import Package
from vlmc.runtime import patches

from .test_parity_raw_inputs import Family, _check

WRAP = "<|begin_of_image|><|image|><|end_of_image|>"


@pytest.fixture(scope="module")
def builtin(exported):
    return Package.load(exported("tiny-glm4v"))


@pytest.fixture(scope="module")
def builtin_model():
    return exporters.load_source("tiny-glm4v").model


def test_graphs_and_facts(builtin):
    m = builtin.manifest
    v = m["vision"]
    assert v["preprocess"]["resize"] == "temporal_pixels" and v["preprocess"]["kind"] == "packed_patches"
    assert (v["preprocess"]["min_pixels"], v["preprocess"]["max_pixels"]) == (112 * 112, 28 * 28 * 15000)
    assert v["position_embedding"] == {"table": 16, "interpolation": "bicubic", "align_corners": False}
    assert v["image_start_token_id"] != v["image_end_token_id"]
    assert m["text"]["position"] == "mrope" and m["text"]["add_bos"] is False
    ops = {n.op_type for n in builtin.model("vision_encoder").graph}
    assert not ops & {"GridSample", "Conv", "NonZero", "Loop"}  # taps are Gathers, both convs MatMuls


@pytest.mark.parametrize("grids", [[[1, 12, 8]], [[1, 2, 2], [1, 6, 10], [1, 4, 4]], [[1, 20, 2]]])
def test_vision_graph_matches_transformers_grid_sample_on_untraced_grids(builtin, builtin_model, grids):
    """Grids below, at and above the 4x4 table, where the bicubic taps are clamped at the border."""
    grid = torch.tensor(grids)
    dim = builtin.info("vision_encoder")["inputs"][0]["shape"][1]
    pixels = torch.randn(int(grid.prod(-1).sum()), dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = torch.cat(builtin_model.model.get_image_features(pixels, grid).pooler_output).numpy()
    got = ortsession.for_graph(builtin, "vision_encoder").run(
        None, {"pixel_values": pixels.numpy(), "image_grid_thw": grid.numpy()}
    )[0]
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_builtin_verify_token_exact(builtin):
    res = verify.verify(builtin, max_new_tokens=20)
    assert res.passed, res
    assert res.token_agreement == 1.0 and res.prefill_logits_max_abs_diff <= 1e-4
    assert len(res.tokens_reference[0]) == 20


@pytest.mark.parametrize("hw", [(20, 24), (30, 200), (60, 90), (400, 300)])
def test_glm_smart_resize_equals_the_image_processor(hw):
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    for lo, hi in ((112 * 112, 28 * 28 * 15000), (112 * 112, 2 * 64 * 28 * 28)):
        want = smart_resize(2, *hw, temporal_factor=2, factor=28, min_pixels=lo, max_pixels=hi)
        assert patches.smart_resize_temporal(*hw, 28, lo, hi) == tuple(want)


# ---- raw inputs through the directory's own processor --------------------------------------------


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("glm4v"), _tokenizers_qwen3.glm4v_dir)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures_glm")
    # 60x90 -> 84x112 (6x8 patches, 12 tokens); 20x60 is scaled up past one factor first (4x10); 300x200 is
    # scaled down to the 64-token bound
    return [
        save_image(root / f"{i}.png", h, w, i) for i, (h, w) in enumerate([(60, 90), (20, 60), (300, 200)])
    ]


def test_plain_prompt_through_the_chat_template(glm, pictures):
    ref = _check(glm, ["What is in the image?"], [[pictures[0]]])
    pieces = glm.proc.tokenizer.convert_ids_to_tokens(ref["input_ids"][0].tolist())
    assert pieces[:4] == ["[gMASK]", "<sop>", "<|user|>", "Ċ"]
    start = pieces.index("<|begin_of_image|>")
    n = int(np.prod(ref["image_grid_thw"][0].tolist())) // 4
    assert (
        pieces[start + 1 : start + 1 + n] == ["<|image|>"] * n and pieces[start + 1 + n] == "<|end_of_image|>"
    )
    assert pieces[-2:] == ["<|assistant|>", "Ċ"]


def test_two_images_of_different_grids(glm, pictures):
    ref = _check(glm, ["Compare the two pictures."], [[pictures[0], pictures[1]]])
    grids = ref["image_grid_thw"].numpy()
    assert len(grids) == 2 and not np.array_equal(grids[0], grids[1])
    big = _check(glm, ["Describe the image."], [[pictures[2]]])
    assert int(big["image_grid_thw"].prod()) // 4 <= 64


def test_explicit_placeholder_and_batch_of_two(glm, pictures):
    _check(glm, [f"[gMASK]<sop><|user|>\n{WRAP}Describe the image.<|assistant|>\n"], [[pictures[1]]])
    _check(glm, ["What is in the image?", "Compare the two pictures."], [[pictures[1]], [pictures[0]]])


def test_runtime_preprocessing_equals_the_image_processor(glm, pictures):
    from PIL import Image

    flat = [np.asarray(Image.open(p).convert("RGB")) for p in pictures]
    ref = glm.proc.image_processor(images=flat, return_tensors="np")
    got = patches.packed_patches(flat, glm.pkg.manifest["vision"]["preprocess"])
    np.testing.assert_array_equal(got["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_allclose(got["pixel_values"], ref["pixel_values"], rtol=0, atol=1e-5)


def test_verify_checks_inputs_against_the_processor(glm, pictures):
    res = verify.verify(glm.pkg, max_new_tokens=3, prompts=["What is in the image?"], images=[[pictures[2]]])
    assert res.passed, res
    assert res.inputs["checked"] and res.inputs["ids_equal"] and res.inputs["pixel_max_abs_diff"] <= 1e-5


@pytest.mark.parametrize(
    "steps",
    [[("paged_kv", {"block_size": 16})], [("merge", {})], [("split", {"boundaries": [1]})]],
    ids=["paged_kv", "merge", "split"],
)
def test_numerics_keeping_passes_are_token_exact(exported, tmp_path, steps):
    from vlmc import manager
    from vlmc.recipe import Step
    from vlmc.runtime import Pipeline

    path = exported("tiny-glm4v")
    prompts, images = ["Describe the image.", "Hi"], [[_picture(60, 90)], []]
    want = Pipeline(Package.load(path)).generate(prompts, images, 8)
    pkg = manager.run(Package.load(path), [Step(n, o, i + 1) for i, (n, o) in enumerate(steps)])
    got = Pipeline(pkg).generate(prompts, images, 8)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.prefill_logits, want.prefill_logits, rtol=1e-4, atol=1e-4)


def test_ascend_compile(exported, tmp_path):
    from vlmc.backends import ascend

    pkg = Package.load(exported("tiny-glm4v"))
    out = ascend.compile(pkg, tmp_path / "build", {"backend": "ascend", "soc": "Ascend910B3"})
    names = {b["name"] for b in out["builds"]}
    assert names == {"vision_encoder", "embed_tokens", "decoder_prefill", "decoder_decode"}


def _picture(h: int, w: int) -> np.ndarray:
    from _real_tokenizers import image

    return image(h, w, 5)


def test_plan_counts_tokens_by_glm_smart_resize(glm):
    from vlmc import budget

    assert budget.spec_from_package(glm.pkg).tokens_per_image == 64  # the saved bound over both frames
    for hw in [(60, 90), (20, 60), (300, 200), (28, 500)]:
        want = glm.proc.image_processor.get_number_of_image_patches(*hw, {}) // 4
        assert budget.spec_from_package(glm.pkg, image_size=hw).tokens_per_image == want
    assert budget.load_spec(glm.src / "config.json").tokens_per_image == 28 * 28 * 15000 // 2 // (28 * 28)
