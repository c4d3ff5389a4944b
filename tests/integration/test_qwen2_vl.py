"""Qwen2-VL / Qwen2.5-VL: dynamic-resolution vision graph, M-RoPE positions, preprocessing, verify vs transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from vlmc import exporters, ortsession, verify
from vlmc.errors import VlmcError
from vlmc.exporters import qwen2_vl
from vlmc.package import Package
from vlmc.runtime import Pipeline, mrope, patches, positions
from vlmc.runtime.preprocess import demo_image

REPO = Path(__file__).resolve().parents[2]
BUILTINS = ["tiny-qwen2-vl", "tiny-qwen2.5-vl"]
WRAP = "<|vision_start|><image><|vision_end|>"


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return demo_image(max(h, w), seed)[:h, :w].copy()


@pytest.fixture(scope="module", params=BUILTINS)
def builtin(request, exported):
    return request.param, Package.load(exported(request.param))


def test_graphs_follow_the_interfaces(builtin):
    name, pkg = builtin
    m = pkg.manifest
    assert m["pipeline"] == {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}
    vis = pkg.info("vision_encoder")
    assert [(i["name"], i["shape"]) for i in vis["inputs"]] == [
        ("pixel_values", ["patches", vis["inputs"][0]["shape"][1]]),
        ("image_grid_thw", ["images", 3]),
    ]
    assert vis["outputs"][0]["name"] == "image_features" and vis["outputs"][0]["shape"][0] == "image_tokens"
    dec = pkg.info("decoder")
    assert dec["inputs"][2]["name"] == "position_ids" and dec["inputs"][2]["shape"] == [
        3,
        "batch",
        "sequence",
    ]
    assert m["text"]["position"] == "mrope" and m["vision"]["tokens_per_image"] is None
    assert m["vision"]["spatial_merge_size"] == 2 and m["vision"]["preprocess"]["kind"] == "packed_patches"
    assert (m["vision"]["window_attention"] is not None) == (name == "tiny-qwen2.5-vl")
    for g in pkg.graph_names:
        onnx.checker.check_model(str(pkg.root / pkg.info(g)["file"]), full_check=True)


def _atc_ops() -> set[str]:
    lines = (REPO / "vlmc/backends/ascend/data/onnx_ops.tsv").read_text().splitlines()
    return {ln.split("\t")[0] for ln in lines if ln and not ln.startswith("#")} - {"op_type"}


def test_vision_graph_uses_only_static_shape_ops_atc_parses(builtin):
    _, pkg = builtin
    ops = {n.op_type for n in pkg.model("vision_encoder").graph} - {"Constant"}
    assert not ops & {"NonZero", "Compress", "Unique", "Loop", "If", "SequenceConstruct"}
    assert ops <= _atc_ops(), ops - _atc_ops()
    assert "Conv" not in ops  # the patch embedding is exported as a MatMul


@pytest.mark.parametrize("grids", [[[1, 12, 12]], [[1, 4, 6], [1, 10, 2], [1, 8, 8]], [[2, 6, 4]]])
def test_vision_graph_matches_transformers_on_grids_it_was_not_traced_with(builtin, grids):
    name, pkg = builtin
    model = exporters.load_source(name).model
    grid = torch.tensor(grids)
    dim = pkg.info("vision_encoder")["inputs"][0]["shape"][1]
    pixels = torch.randn(int(grid.prod(-1).sum()), dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = torch.cat(model.model.get_image_features(pixels, grid).pooler_output).numpy()
    got = ortsession.for_graph(pkg, "vision_encoder").run(
        None, {"pixel_values": pixels.numpy(), "image_grid_thw": grid.numpy()}
    )[0]
    assert got.shape == ref.shape == (int(grid.prod(-1).sum()) // 4, pkg.manifest["text"]["hidden_size"])
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_patch_coords_match_transformers_position_ids():
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    grid = torch.tensor([[1, 4, 6], [2, 2, 4], [1, 6, 2]])
    n = int(grid.prod(-1).sum())
    segment, hpos, wpos = qwen2_vl.patch_coords(grid, n, 2)
    assert torch.equal(torch.stack([hpos, wpos], -1), get_vision_position_ids(grid, 2))
    cu = get_vision_cu_seqlens(grid).tolist()
    expected = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))])
    assert torch.equal(segment, expected)


def test_builtin_verify_token_exact(builtin):
    _, pkg = builtin
    res = verify.verify(pkg, max_new_tokens=20)
    assert res.passed, res
    assert res.token_agreement == 1.0 and res.prefill_logits_max_abs_diff <= 1e-4
    assert len(res.tokens_reference[0]) == 20  # no early eos: all 20 tokens are compared


def test_preprocess_matches_the_transformers_image_processor():
    cfg = qwen2_vl.tiny_qwen2_vl_config()
    facts = qwen2_vl.preprocess_facts(cfg.vision_config, None)
    proc = _processor(cfg, facts["min_pixels"], facts["max_pixels"])
    images = [_image(70, 130, 1), _image(96, 96, 2)]
    ref = proc(images=images, return_tensors="np")
    got = patches.packed_patches(images, facts)
    np.testing.assert_array_equal(got["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_allclose(got["pixel_values"], ref["pixel_values"], rtol=1e-5, atol=1e-5)


def test_smart_resize_bounds_pixels_and_rejects_extreme_aspect():
    h, w = patches.smart_resize(1000, 3000, 16, 4 * 256, 64 * 256)
    assert h % 16 == 0 and w % 16 == 0 and h * w <= 64 * 256
    assert patches.smart_resize(10, 10, 16, 4 * 256, 64 * 256) == (32, 32)
    with pytest.raises(VlmcError, match="aspect ratio"):
        patches.smart_resize(10, 2100, 16, 4 * 256, 64 * 256)


def test_mrope_positions_match_get_rope_index(builtin):
    """Batch of two prompts, left padding, images of different sizes (one prompt has two)."""
    name, pkg = builtin
    pipe = Pipeline(pkg)
    inp = pipe.prepare(
        [f"A {WRAP} and {WRAP}?", "Describe."], [[_image(64, 96, 1), _image(48, 32, 2)], [_image(80, 80, 3)]]
    )
    assert inp.attention_mask.min() == 0  # one prompt is left padded
    got = positions.prefill(
        "mrope", inp.input_ids, inp.attention_mask, {"manifest": pkg.manifest, "vision": inp.vision}
    )
    model = exporters.load_source(name).model
    ref, delta = model.model.get_rope_index(
        torch.from_numpy(inp.input_ids),
        torch.from_numpy(inp.extra["mm_token_type_ids"]),
        image_grid_thw=torch.from_numpy(inp.vision["image_grid_thw"]),
        attention_mask=torch.from_numpy(inp.attention_mask),
    )
    real = inp.attention_mask.astype(bool)
    np.testing.assert_array_equal(got[:, real], ref.numpy()[:, real])
    # decode continues at transformers' text position + rope delta
    nxt = positions.next_positions(got)
    np.testing.assert_array_equal(nxt[0, :, 0], real.sum(1) + delta.numpy()[:, 0])


def test_mrope_rejects_grids_that_do_not_match_the_placeholders(builtin):
    _, pkg = builtin
    ids = np.array([[1, 5, 319, 319, 319, 319, 6]])
    ctx = {"manifest": pkg.manifest, "vision": {"image_grid_thw": np.array([[1, 4, 6]])}}
    with pytest.raises(VlmcError, match="placeholder"):
        mrope.positions_mrope(ids, np.ones_like(ids), ctx)
    ctx["vision"]["image_grid_thw"] = np.array([[1, 4, 4], [1, 4, 4]])
    with pytest.raises(VlmcError, match="grid"):
        mrope.positions_mrope(ids, np.ones_like(ids), ctx)


def test_text_only_prompt_runs_with_plain_positions(builtin):
    _, pkg = builtin
    pipe = Pipeline(pkg)
    inp = pipe.prepare(["Hello"], [[]])
    pos = positions.prefill(
        "mrope", inp.input_ids, inp.attention_mask, {"manifest": pkg.manifest, "vision": {}}
    )
    assert (pos == np.arange(inp.input_ids.shape[1])).all()
    assert len(pipe.generate_from(inp, 3).tokens[0]) >= 1


# ---- local configs saved with save_pretrained ------------------------------------------------


def _qwen2_mha():
    return qwen2_vl.tiny_qwen2_vl_config(vision_over={"depth": 3, "num_heads": 2}, num_key_value_heads=4)


def _qwen2_small_patch():
    return qwen2_vl.tiny_qwen2_vl_config(
        vision_over={"patch_size": 4, "embed_dim": 48, "num_heads": 6},
        rope_parameters={"rope_type": "default", "rope_theta": 1e5, "mrope_section": [4, 2, 2]},
    )


def _qwen25_big_window():
    # window 64 px = 4x4 merged tokens; a 160x96 image has 3x2 windows, the last ones partial
    return qwen2_vl.tiny_qwen2_5_vl_config(
        vision_over={"window_size": 64, "depth": 4, "fullatt_block_indexes": [3]}
    )


def _qwen25_gqa():
    return qwen2_vl.tiny_qwen2_5_vl_config(
        vision_over={"fullatt_block_indexes": [0, 2]},
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
    )


def _processor(cfg, min_pixels: int, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = cfg.vision_config
    return Qwen2VLImageProcessorPil(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


def _two_images_one_prompt():
    return [f"Compare {WRAP} with {WRAP}."], [[_image(96, 64, 1), _image(48, 112, 2)]]


def _batch_of_two():
    return [f"What is in {WRAP}?", "Describe the image."], [[_image(64, 96, 3)], [_image(80, 48, 4)]]


def _many_windows():
    return ["Describe the image."], [[_image(160, 96, 5)]]


LOCAL = {
    "qwen2_mha_two_images": (_qwen2_mha, _two_images_one_prompt),
    "qwen2_small_patch_batch": (_qwen2_small_patch, _batch_of_two),
    "qwen25_big_window": (_qwen25_big_window, _many_windows),
    "qwen25_gqa_batch": (_qwen25_gqa, _batch_of_two),
}


@pytest.fixture(scope="module")
def local_root(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen_local")


@pytest.mark.parametrize("name", sorted(LOCAL))
def test_verify_local_configs_token_exact(local_root, tmp_path, name):
    make_config, make_inputs = LOCAL[name]
    cfg = make_config()
    torch.manual_seed(1)
    qwen2_vl.model_class(cfg)(cfg).save_pretrained(local_root / name)
    if (
        name == "qwen2_small_patch_batch"
    ):  # a saved processor with its own pixel bounds overrides the defaults
        _processor(cfg, 1024, 6144).save_pretrained(local_root / name)
    src = exporters.load_source(str(local_root / name))
    assert src.architecture == qwen2_vl.model_class(cfg).__name__
    exporters.export(src).save(tmp_path / "pkg")
    pkg = Package.load(tmp_path / "pkg")
    prompts, images = make_inputs()
    inp = Pipeline(pkg).prepare(prompts, images)
    grids = inp.vision["image_grid_thw"]
    if name == "qwen25_big_window":
        span = cfg.vision_config.window_size // cfg.vision_config.patch_size
        assert grids[0, 1] > span and grids[0, 2] > span  # more than one window each way
    if "two_images" in name:
        assert len(grids) == 2 and not np.array_equal(grids[0], grids[1])
    if name == "qwen2_small_patch_batch":
        facts = pkg.manifest["vision"]["preprocess"]
        assert (facts["patch_size"], facts["min_pixels"], facts["max_pixels"]) == (4, 1024, 6144)
        ref = _processor(cfg, 1024, 6144)(images=[i for per in images for i in per], return_tensors="np")
        np.testing.assert_array_equal(grids, ref["image_grid_thw"])
        np.testing.assert_allclose(inp.vision["pixel_values"], ref["pixel_values"], rtol=1e-5, atol=1e-5)
    res = verify.verify(pkg, max_new_tokens=20, prompts=prompts, images=images)
    assert res.passed, res
    assert res.tokens_package == res.tokens_reference
    assert res.token_agreement == 1.0 and res.prefill_logits_max_abs_diff <= 1e-4
