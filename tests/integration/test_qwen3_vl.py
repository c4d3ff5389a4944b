"""Qwen3-VL (dense): vision graph with deepstack, the deepstack decoder inputs, raw-input parity, passes."""

from __future__ import annotations

from pathlib import Path

import _tokenizers_qwen3
import numpy as np
import onnx
import pytest
import torch
from _real_tokenizers import save_image

from vlmc import exporters, ortsession, verify
from vlmc.package import Package
from vlmc.runtime import Pipeline, patches, positions
from vlmc.runtime.preprocess import demo_image

from .test_parity_raw_inputs import Family, _check

REPO = Path(__file__).resolve().parents[2]
WRAP = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return demo_image(max(h, w), seed)[:h, :w].copy()


@pytest.fixture(scope="module")
def builtin(exported):
    return Package.load(exported("tiny-qwen3-vl"))


@pytest.fixture(scope="module")
def builtin_model():
    return exporters.load_source("tiny-qwen3-vl").model


def test_graphs_declare_the_deepstack_interface(builtin):
    m = builtin.manifest
    assert m["text"]["deepstack"] == {
        "layers": 2,
        "vision_layers": [0, 2],
        "vision_output": "deepstack_features",
        "mask_input": "visual_pos_masks",
        "embeds_input": "deepstack_visual_embeds",
        "rows_dim": "visual_tokens",
    }
    assert m["vision"]["token_aligned_outputs"] == {"deepstack_features": 1}
    assert m["text"]["mrope_interleaved"] is True and m["text"]["position"] == "mrope"
    vis = builtin.info("vision_encoder")
    assert [(o["name"], o["shape"]) for o in vis["outputs"]] == [
        ("image_features", ["image_tokens", 64]),
        ("deepstack_features", [2, "image_tokens", 64]),
    ]
    dec = {i["name"]: i for i in builtin.info("decoder")["inputs"]}
    assert dec["visual_pos_masks"]["shape"] == ["batch", "sequence"]
    assert dec["visual_pos_masks"]["dtype"] == "int64"
    assert dec["deepstack_visual_embeds"]["shape"] == [2, "visual_tokens", 64]
    assert dec["position_ids"]["shape"] == [3, "batch", "sequence"]
    nodes = list(builtin.model("decoder").graph)
    assert not {n.op_type for n in nodes} & {"NonZero", "Compress"}  # visual positions are a Gather
    # the only scatters are transformers' interleaved M-RoPE recomposition (static slices, ATC parses them)
    assert all("rotary_emb" in n.name for n in nodes if n.op_type == "ScatterND")
    for g in builtin.graph_names:
        onnx.checker.check_model(str(builtin.root / builtin.info(g)["file"]), full_check=True)


@pytest.mark.parametrize("grids", [[[1, 12, 8]], [[1, 4, 6], [1, 10, 2], [1, 16, 16]], [[2, 6, 4]]])
def test_vision_graph_and_deepstack_match_transformers_on_untraced_grids(builtin, builtin_model, grids):
    """Grids smaller and larger than the 8x8 position table: the bilinear resampling is per grid."""
    grid = torch.tensor(grids)
    dim = builtin.info("vision_encoder")["inputs"][0]["shape"][1]
    pixels = torch.randn(int(grid.prod(-1).sum()), dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = builtin_model.model.get_image_features(pixels, grid)
    ref = torch.cat(out.pooler_output).numpy()
    ref_stack = np.stack([torch.cat(f).numpy() for f in out.deepstack_features])
    feats, stack = ortsession.for_graph(builtin, "vision_encoder").run(
        None, {"pixel_values": pixels.numpy(), "image_grid_thw": grid.numpy()}
    )
    assert stack.shape == ref_stack.shape == (2, int(grid.prod(-1).sum()) // 4, 64)
    np.testing.assert_allclose(feats, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(stack, ref_stack, rtol=1e-4, atol=1e-4)


def test_decoder_adds_deepstack_at_the_visual_positions_like_transformers(builtin, builtin_model):
    """Prefill through the decoder graph == Qwen3VLTextModel with the same deepstack lists, and the
    deepstack inputs change the logits (they are not ignored)."""
    rng = np.random.default_rng(0)
    batch, seq, hidden = 2, 6, 64
    embeds = rng.standard_normal((batch, seq, hidden)).astype(np.float32)
    mask = np.zeros((batch, seq), np.int64)
    mask[0, 1:4], mask[1, 4:6] = 1, 1
    stack = rng.standard_normal((2, int(mask.sum()), hidden)).astype(np.float32)
    pos = np.broadcast_to(np.arange(seq), (3, batch, seq)).astype(np.int64)
    kv = builtin.manifest["kv"]
    feeds = {
        "inputs_embeds": embeds,
        "attention_mask": np.ones((batch, seq), np.int64),
        "position_ids": pos,
        "visual_pos_masks": mask,
        "deepstack_visual_embeds": stack,
    }
    for i in range(kv["layers"]):
        for k in ("key", "value"):
            feeds[f"past_key_values.{i}.{k}"] = np.zeros(
                (batch, kv["kv_heads"], 0, kv["head_dim"]), np.float32
            )
    sess = ortsession.for_graph(builtin, "decoder")
    logits = sess.run(["logits"], feeds)[0]
    with torch.no_grad():
        lm = builtin_model.model.language_model
        out = lm(
            inputs_embeds=torch.from_numpy(embeds),
            attention_mask=torch.ones(batch, seq, dtype=torch.int64),
            position_ids=torch.from_numpy(pos),
            visual_pos_masks=torch.from_numpy(mask.astype(bool)),
            deepstack_visual_embeds=list(torch.from_numpy(stack)),
        )
        ref = builtin_model.lm_head(out.last_hidden_state).numpy()
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4)
    feeds["deepstack_visual_embeds"] = np.zeros_like(stack)
    without = sess.run(["logits"], feeds)[0]
    assert np.abs(without - logits)[mask == 1].max() > 1e-2  # visual rows move
    # Row 0 of the padded table is zeros, so positions before any visual token are untouched.
    np.testing.assert_array_equal(without[0, 0], logits[0, 0])


def test_builtin_verify_token_exact(builtin):
    res = verify.verify(builtin, max_new_tokens=20)
    assert res.passed, res
    assert res.token_agreement == 1.0 and res.prefill_logits_max_abs_diff <= 1e-4
    assert len(res.tokens_reference[0]) == 20


def test_positions_match_get_rope_index_for_a_batch_with_two_grids(builtin, builtin_model):
    pipe = Pipeline(builtin)
    wrap = "<|vision_start|><image><|vision_end|>"
    inp = pipe.prepare([f"A {wrap} and {wrap}?", "Hi."], [[_image(64, 96, 1), _image(96, 64, 2)], []])
    got = positions.prefill(
        "mrope", inp.input_ids, inp.attention_mask, {"manifest": builtin.manifest, "vision": inp.vision}
    )
    ref, _ = builtin_model.model.get_rope_index(
        torch.from_numpy(inp.input_ids),
        torch.from_numpy(inp.extra["mm_token_type_ids"]),
        image_grid_thw=torch.from_numpy(inp.vision["image_grid_thw"]),
        attention_mask=torch.from_numpy(inp.attention_mask),
    )
    real = inp.attention_mask.astype(bool)
    np.testing.assert_array_equal(got[:, real], ref.numpy()[:, real])


def test_text_only_prompt_feeds_an_empty_deepstack(builtin):
    res = Pipeline(builtin).generate(["Hello"], [[]], 3)
    assert len(res.tokens[0]) >= 1 and res.image_tokens == 0


# ---- raw inputs through the directory's own processor --------------------------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("qwen3_vl"), _tokenizers_qwen3.qwen3_vl_dir)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures3")
    # 120x90 -> 128x96 px, a 8x6 patch grid (12 tokens); 64x160 -> 4x10 (10 tokens); 250x180 is scaled
    # down to the processor's 64-token bound
    return [
        save_image(root / f"{i}.png", h, w, i) for i, (h, w) in enumerate([(120, 90), (64, 160), (250, 180)])
    ]


def test_processor_settings_come_from_the_saved_directory(qwen3):
    facts = qwen3.pkg.manifest["vision"]["preprocess"]
    assert (facts["patch_size"], facts["merge_size"], facts["temporal_patch_size"]) == (16, 2, 2)
    assert (facts["min_pixels"], facts["max_pixels"]) == (8 * 32 * 32, 64 * 32 * 32)
    assert facts["mean"] == [0.5, 0.5, 0.5] and facts["std"] == [0.5, 0.5, 0.5]
    assert qwen3.pkg.manifest["text"]["image_marker"] == "<|image_pad|>"


def test_plain_prompt_through_the_chat_template(qwen3, pictures):
    ref = _check(qwen3, ["What is in the image?"], [[pictures[0]]])
    pieces = qwen3.proc.tokenizer.convert_ids_to_tokens(ref["input_ids"][0].tolist())
    assert pieces[:3] == ["<|im_start|>", "user", "Ċ"]  # Qwen3-VL's template has no default system turn
    start = pieces.index("<|vision_start|>")
    n = int(np.prod(ref["image_grid_thw"][0].tolist())) // 4
    assert (
        pieces[start + 1 : start + 1 + n] == ["<|image_pad|>"] * n
        and pieces[start + 1 + n] == "<|vision_end|>"
    )


def test_two_images_of_different_grids(qwen3, pictures):
    ref = _check(qwen3, ["Compare the two pictures."], [[pictures[0], pictures[1]]])
    grids = ref["image_grid_thw"].numpy()
    assert grids.tolist() == [[1, 8, 6], [1, 4, 10]]
    big = _check(qwen3, ["Describe the image."], [[pictures[2]]])
    assert int(big["image_grid_thw"].prod()) // 4 <= 64  # smart-resized to the processor's bound


def test_explicit_placeholder_and_batch_of_two(qwen3, pictures):
    _check(qwen3, [f"{WRAP}Describe the image."], [[pictures[1]]])
    _check(qwen3, ["What is in the image?", "Compare the two pictures."], [[pictures[1]], [pictures[0]]])


def test_runtime_preprocessing_equals_the_image_processor_without_torch(qwen3, pictures):
    from PIL import Image

    flat = [np.asarray(Image.open(p).convert("RGB")) for p in pictures]
    ref = qwen3.proc.image_processor(images=flat, return_tensors="np")
    got = patches.packed_patches(flat, qwen3.pkg.manifest["vision"]["preprocess"])
    np.testing.assert_array_equal(got["image_grid_thw"], ref["image_grid_thw"])
    np.testing.assert_allclose(got["pixel_values"], ref["pixel_values"], rtol=0, atol=1e-5)


def test_verify_checks_inputs_against_the_processor(qwen3, pictures):
    res = verify.verify(
        qwen3.pkg, max_new_tokens=3, prompts=["What is in the image?"], images=[[pictures[0]]]
    )
    assert res.passed, res
    assert res.inputs["checked"] and res.inputs["ids_equal"] and res.inputs["pixel_max_abs_diff"] <= 1e-5


# ---- passes, backend, plan on a deepstack package ------------------------------------------------

PROMPTS = ["Describe the image.", "Hi"]
IMAGES = [[_image(64, 96, 1)], []]


def _passes(path: Path, tmp: Path, steps) -> Package:
    from vlmc import manager
    from vlmc.recipe import Step

    pkg = manager.run(Package.load(path), [Step(name, opts, i + 1) for i, (name, opts) in enumerate(steps)])
    pkg.save(tmp)
    return Package.load(tmp)


@pytest.mark.parametrize(
    "steps",
    [
        [("paged_kv", {"block_size": 16})],
        [("merge", {})],
        [("split", {"boundaries": [1]})],
        [("split", {"boundaries": [2]}), ("merge", {})],
    ],
    ids=["paged_kv", "merge", "split", "split_merge"],
)
def test_numerics_keeping_passes_carry_the_deepstack_inputs(exported, tmp_path, steps):
    """Tokens equal the unrewritten package's; the deepstack inputs stay where the manifest says."""
    path = exported("tiny-qwen3-vl")
    want = Pipeline(Package.load(path)).generate(PROMPTS, IMAGES, 8)
    pkg = _passes(path, tmp_path / "out", steps)
    ds = pkg.manifest["text"]["deepstack"]
    for name in pkg.manifest["pipeline"]["decoder"]:
        names = {i["name"] for i in pkg.info(name)["inputs"]}
        first = pkg.info(name).get("kv_layers", [0, 3])[0]
        # a split decoder range takes the deepstack inputs only if it holds one of the first layers
        assert ({ds["mask_input"], ds["embeds_input"]} <= names) == (first < ds["layers"])
    if "vlm" in pkg.manifest["pipeline"]:
        vlm = {i["name"] for i in pkg.info("vlm")["inputs"]}
        assert not vlm & {ds["mask_input"], ds["embeds_input"]}  # computed inside the merged graph
    got = Pipeline(pkg).generate(PROMPTS, IMAGES, 8)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.prefill_logits, want.prefill_logits, rtol=1e-4, atol=1e-4)


def test_prune_keeps_the_deepstack_rows_of_the_kept_tokens(exported, tmp_path):
    path = exported("tiny-qwen3-vl")
    opts = {"keep": 3, "method": "attention_received", "calibration_images": 1, "picture": False}
    pruned = _passes(path, tmp_path / "pruned", [("prune_visual_tokens", opts)])
    sig = {o["name"]: o["shape"] for o in pruned.info("vision_encoder")["outputs"]}
    assert sig["deepstack_features"] == [2, "image_tokens", 64]
    grid = np.array([[1, 4, 6], [1, 8, 4]])
    feeds = patches.packed_patches(
        [_image(64, 96, 1), _image(128, 64, 2)], Package.load(path).manifest["vision"]["preprocess"]
    )
    np.testing.assert_array_equal(feeds["image_grid_thw"], grid)
    full_feats, full_stack = ortsession.for_graph(Package.load(path), "vision_encoder").run(None, feeds)
    out = dict(
        zip(
            [o.name for o in ortsession.for_graph(pruned, "vision_encoder").get_outputs()],
            ortsession.for_graph(pruned, "vision_encoder").run(None, feeds),
        )
    )
    starts = np.array([0, 6])  # image 0 has 6 tokens, image 1 has 8
    flat = (out["image_token_indices"] + starts[:, None]).reshape(-1)
    assert out["image_features"].shape == (6, 64) and out["deepstack_features"].shape == (2, 6, 64)
    np.testing.assert_array_equal(out["image_features"], full_feats[flat])
    np.testing.assert_array_equal(out["deepstack_features"], full_stack[:, flat])
    res = Pipeline(pruned).generate(PROMPTS, IMAGES, 4)
    assert res.image_tokens == 3 and all(res.tokens)


def test_ascend_compile_sizes_the_deepstack_rows_per_variant(exported, tmp_path):
    from vlmc.backends import ascend

    pkg = Package.load(exported("tiny-qwen3-vl"))
    # one exact patch count (dims), so the vision build and the prefill each have one static size
    target = {"backend": "ascend", "soc": "Ascend910B3", "dims": {"patches": 48}}
    out = ascend.compile(pkg, tmp_path / "build", target)
    shapes = {b["name"]: b["input_shape"] for b in out["builds"]}
    # prefill carries the vision build's tokens (48 patches / 2x2 = 12); a decode step one zero row
    assert "deepstack_visual_embeds:2,12,64" in shapes["decoder_prefill"]
    assert "pixel_values:48," in shapes["vision_encoder"]
    assert "deepstack_visual_embeds:2,1,64" in shapes["decoder_decode"]
    assert "visual_pos_masks:1,1" in shapes["decoder_decode"]


def test_plan_bounds_tokens_per_image_by_the_processor_pixels(qwen3):
    from vlmc import budget

    spec = budget.spec_from_package(qwen3.pkg)
    assert spec.tokens_per_image == 64  # max_pixels 64 * 32 * 32 of the saved processor
    for hw in [(120, 90), (64, 160), (250, 180), (10, 300)]:  # --image-size: the processor's own count
        want = qwen3.proc.image_processor.get_number_of_image_patches(*hw, {}) // 4
        assert budget.spec_from_package(qwen3.pkg, image_size=hw).tokens_per_image == want
    cfg = budget.load_spec(qwen3.src / "config.json")
    assert cfg.tokens_per_image == 16384 and {g.role for g in cfg.graphs} == {"vision", "embed", "decoder"}
