"""prune_visual_tokens: kept indices against independent numpy top-k, static ATC ops, refusals, end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

import vlmc
from vlmc import budget, interop, manager, ortsession
from vlmc.cli import main
from vlmc.errors import PassFailed, VlmcError
from vlmc.exporters import load_source
from vlmc.package import Package
from vlmc.pass_api import get
from vlmc.passes.prune_visual_tokens import measure
from vlmc.recipe import Step
from vlmc.runtime import Pipeline, mrope, preprocess

ATC_OPS = Path(vlmc.__file__).parent / "backends" / "ascend" / "data" / "onnx_ops.tsv"
NO_CAL = {"calibration_images": 0, "picture": False}  # fast variants: fidelity is exercised end to end below


def _prune(path: Path, **opts) -> Package:
    pkg = Package.load(path)
    return manager.run(pkg, [Step(index=1, name="prune_visual_tokens", options=dict(NO_CAL, **opts))])


def _atc_ops() -> set[str]:
    rows = [ln.split("\t") for ln in ATC_OPS.read_text().splitlines() if ln and not ln.startswith("#")]
    # Constant nodes are converted by the parser itself (header of onnx_ops.tsv).
    return {r[0] for r in rows[1:] if "17" in r[1].split(",")} | {"Constant"}


def _topk_sorted(scores: np.ndarray, k: int) -> np.ndarray:
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    kth = np.take_along_axis(scores, order[..., -1:], -1)
    rest = np.where(np.isin(np.arange(scores.shape[-1]), order), -np.inf, scores).max(-1, keepdims=True)
    assert np.all(kth - rest > 1e-6), "near-tie at the k-th score: the comparison would be meaningless"
    return np.sort(order, axis=-1)


@pytest.fixture(scope="module")
def llava_pixels(tiny_llava):
    pkg = Package.load(tiny_llava)
    images = [preprocess.load_image(f"demo:{i}") for i in range(3)]
    return preprocess.preprocess(images, pkg.manifest["vision"]["preprocess"])["pixel_values"]


@pytest.fixture(scope="module")
def tiny_qwen(exported):
    return exported("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def qwen_inputs(tiny_qwen):
    """Two images of different sizes: 36 and 48 tokens, packed on one axis."""
    pkg = Package.load(tiny_qwen)
    rng = np.random.default_rng(0)
    images = [preprocess.demo_image(96, seed=1), rng.integers(0, 256, (96, 128, 3)).astype(np.uint8)]
    feeds = preprocess.preprocess(images, pkg.manifest["vision"]["preprocess"])
    assert [int(np.prod(g)) // 4 for g in feeds["image_grid_thw"]] == [36, 48]
    return feeds


# ---- kept indices against independent computations ----------------------------------------------------
def test_cls_attention_matches_torch_attention_topk(tiny_llava, llava_pixels):
    """Scores from transformers' own CLIP attentions (not from the graph): CLS row of layer L-2, head mean."""
    k = 16
    pruned = _prune(tiny_llava, keep=k)
    out = Pipeline(pruned).run_graph("vision_encoder", {"pixel_values": llava_pixels})
    model = load_source("tiny-llava").model
    with torch.no_grad():
        att = model.model.vision_tower(torch.from_numpy(llava_pixels), output_attentions=True).attentions
    layer = pruned.manifest["vision"]["attention"]["layer"]
    assert layer == len(att) - 2  # hidden_states[-2] is the output of encoder layer L-2
    scores = att[layer][:, :, 0, 1:].mean(1).numpy()
    expected = _topk_sorted(scores, k)
    got = out[measure.INDICES_OUTPUT]
    np.testing.assert_array_equal(got, expected)
    assert np.all(np.diff(got, axis=1) > 0)  # original order kept
    full = Pipeline(Package.load(tiny_llava)).run_graph("vision_encoder", {"pixel_values": llava_pixels})
    np.testing.assert_array_equal(
        out["image_features"], np.take_along_axis(full["image_features"], got[..., None], 1)
    )


def test_recomputed_attention_side_branch_gives_the_same_indices(tiny_llava, llava_pixels):
    exposed = Pipeline(_prune(tiny_llava, keep=20)).run_graph(
        "vision_encoder", {"pixel_values": llava_pixels}
    )
    side = _prune(tiny_llava, keep=20, recompute_attention=True)
    assert side.manifest["vision"]["pruning"]["score_source"] == "recomputed"
    ops = {n.op_type for n in side.model("vision_encoder").graph}
    assert {"MatMul", "Softmax", "TopK", "GatherElements"} <= ops
    got = Pipeline(side).run_graph("vision_encoder", {"pixel_values": llava_pixels})
    np.testing.assert_array_equal(got[measure.INDICES_OUTPUT], exposed[measure.INDICES_OUTPUT])


def test_llava_attention_received_matches_numpy(tiny_llava, llava_pixels):
    pkg = Package.load(tiny_llava)
    probs_name = pkg.manifest["vision"]["attention"]["probs"]
    sess = ortsession.from_model(pkg.model("vision_encoder"), extra_outputs=[probs_name])
    probs = sess.run([probs_name], {"pixel_values": llava_pixels})[0]
    expected = _topk_sorted(probs.mean(2).mean(1)[:, 1:], 10)
    out = Pipeline(_prune(tiny_llava, keep=10, method="attention_received")).run_graph(
        "vision_encoder", {"pixel_values": llava_pixels}
    )
    np.testing.assert_array_equal(out[measure.INDICES_OUTPUT], expected)


@pytest.mark.parametrize("method", ["uniform", "random"])
def test_llava_baselines_match_numpy(tiny_llava, llava_pixels, method):
    n, k, seed = 64, 16, 7
    if method == "uniform":
        expected = np.floor((np.arange(k) + 0.5) * n / k).astype(np.int64)
    else:
        expected = np.sort(np.argsort(-np.random.default_rng(seed).random(n).astype(np.float32))[:k])
    out = Pipeline(_prune(tiny_llava, keep=k, method=method, seed=seed)).run_graph(
        "vision_encoder", {"pixel_values": llava_pixels}
    )
    np.testing.assert_array_equal(out[measure.INDICES_OUTPUT], np.broadcast_to(expected, (3, k)))
    assert out["image_features"].shape == (3, k, 64)


def test_qwen_attention_received_per_image_topk_on_packed_tokens(tiny_qwen, qwen_inputs):
    """Mean attention received per patch (heads, queries), merge-group mean, top-k within each image."""
    pkg = Package.load(tiny_qwen)
    probs_name = pkg.manifest["vision"]["attention"]["probs"]
    sess = ortsession.from_model(pkg.model("vision_encoder"), extra_outputs=[probs_name])
    feats, probs = sess.run(["image_features", probs_name], qwen_inputs)
    token_scores = probs.mean(1).mean(0).reshape(-1, 4).mean(1)
    k, start = 12, 0
    out = Pipeline(_prune(tiny_qwen, keep=k, method="attention_received")).run_graph(
        "vision_encoder", qwen_inputs
    )
    for i, n in enumerate([36, 48]):
        expected = _topk_sorted(token_scores[start : start + n][None], k)[0]
        np.testing.assert_array_equal(out[measure.INDICES_OUTPUT][i], expected)
        np.testing.assert_array_equal(out["image_features"][i * k : (i + 1) * k], feats[start + expected])
        start += n


@pytest.mark.parametrize("method", ["uniform", "random"])
def test_qwen_baselines_adapt_to_each_image_size(tiny_qwen, qwen_inputs, method):
    k, seed = 12, 3
    out = Pipeline(_prune(tiny_qwen, keep=k, method=method, seed=seed)).run_graph(
        "vision_encoder", qwen_inputs
    )
    for i, n in enumerate([36, 48]):
        if method == "uniform":
            expected = np.floor((np.arange(k) + 0.5) * n / k).astype(np.int64)
        else:
            expected = np.sort(np.argsort(-np.random.default_rng(seed).random(n).astype(np.float32))[:k])
        np.testing.assert_array_equal(out[measure.INDICES_OUTPUT][i], expected)


def _tower_attentions(name: str, pixels: np.ndarray):
    model = load_source(name).model
    with torch.no_grad():
        return model, model.model.vision_tower(torch.from_numpy(pixels), output_attentions=True).attentions


def test_internvl_cls_attention_scores_each_pixel_shuffle_group(exported):
    """transformers' CLS attention of the feature layer, shuffled like the features, mean per token."""
    pkg = Package.load(exported("tiny-internvl"))
    images = [preprocess.load_image("demo:0")]
    pixels = preprocess.preprocess(images, pkg.manifest["vision"]["preprocess"])["pixel_values"]
    k = 6
    out = Pipeline(_prune(exported("tiny-internvl"), keep=k)).run_graph(
        "vision_encoder", {"pixel_values": pixels}
    )
    model, att = _tower_attentions("tiny-internvl", pixels)
    cls = att[-1][:, :, 0, 1:].mean(1)  # feature layer -1: the last layer's CLS row, head mean
    side = int(round(cls.shape[1] ** 0.5))
    shuffled = model.model.pixel_shuffle(cls.reshape(-1, side, side, 1), scale_factor=0.5)
    scores = shuffled.reshape(cls.shape[0], -1, shuffled.shape[-1]).mean(-1).numpy()
    np.testing.assert_array_equal(out[measure.INDICES_OUTPUT], _topk_sorted(scores, k))


def test_gemma3_attention_received_scores_each_pooled_token_and_runs(exported):
    """The last layer's received attention, average-pooled like the features; the image block follows."""
    pkg = Package.load(exported("tiny-gemma3"))
    pixels = preprocess.preprocess(
        [preprocess.load_image(f"demo:{i}") for i in range(2)], pkg.manifest["vision"]["preprocess"]
    )["pixel_values"]
    k = 2
    pruned = _prune(exported("tiny-gemma3"), keep=k, method="attention_received")
    out = Pipeline(pruned).run_graph("vision_encoder", {"pixel_values": pixels})
    _, att = _tower_attentions("tiny-gemma3", pixels)
    received = att[-1].mean(2).mean(1)  # [images, patches]
    side = int(round(received.shape[1] ** 0.5))
    tokens_side = int(round(pkg.manifest["vision"]["tokens_per_image"] ** 0.5))
    pooled = torch.nn.functional.avg_pool2d(received.reshape(-1, 1, side, side), side // tokens_side)
    np.testing.assert_array_equal(out[measure.INDICES_OUTPUT], _topk_sorted(pooled.flatten(1).numpy(), k))
    pipe = Pipeline(pruned)
    inp = pipe.prepare(["Describe the image."], [["demo:0"]])
    res = pipe.generate_from(inp, 3)
    assert res.image_tokens == k
    types = inp.extra[pruned.manifest["text"]["token_type_ids"]]
    np.testing.assert_array_equal(types, (inp.input_ids == pruned.manifest["vision"]["image_token_id"]))


ANYRES = {"tiny-llava-next": "cls_attention", "tiny-llava-onevision": "attention_received"}


def _anyres_feeds(pkg: Package) -> dict:
    """Two images of different aspect ratios (different tile grids, unpadding and newline counts)."""
    rng = np.random.default_rng(0)
    images = [preprocess.demo_image(64, seed=1), rng.integers(0, 256, (40, 90, 3)).astype(np.uint8)]
    pipe = Pipeline(pkg)
    return pipe.vision_feeds(preprocess.preprocess(images, pkg.manifest["vision"]["preprocess"]))


def _anyres_expected(pkg: Package, feeds: dict, method: str, keep: int, seed: int = 0) -> list[np.ndarray]:
    """Per image, in numpy: every newline token, and the best keep - rows content tokens, ascending."""
    index, weight = feeds["image_feature_index"], feeds["image_feature_weight"]
    images, tiles = feeds["pixel_values"].shape[:2]
    per_tile = pkg.manifest["vision"]["token_table"]["tile_tokens"]
    newline = images * tiles * per_tile
    counts = preprocess.token_counts(feeds, pkg.manifest["vision"]["preprocess"])
    if method in ("cls_attention", "attention_received"):
        att = pkg.manifest["vision"]["attention"]
        sess = ortsession.from_model(pkg.model("vision_encoder"), extra_outputs=[att["probs"]])
        graph_feeds = {k: v for k, v in feeds.items() if k != "image_sizes"}
        probs = sess.run([att["probs"]], graph_feeds)[0]  # [tiles, heads, queries, keys]
        a = probs[:, :, 0] if method == "cls_attention" else probs.mean(2)
        off = att["token_offset"]
        table = np.concatenate([a.mean(1)[:, off : off + per_tile].reshape(-1), [0.0]]).astype(np.float32)
        w = weight
        token_scores = (table[index[:, 0]] * w[:, 0] + table[index[:, 1]] * w[:, 1]) + (
            table[index[:, 2]] * w[:, 2] + table[index[:, 3]] * w[:, 3]
        )
    else:
        token_scores = None
    return _table_expected(counts, index[:, 0] == newline, token_scores, method, keep, seed)


def _table_expected(counts, separators, token_scores, method, keep, seed) -> list[np.ndarray]:
    """Per image of a token-table layout: every separator token and the best keep - separators others."""
    out, start = [], 0
    for n in counts:
        is_sep = separators[start : start + n]
        content = np.flatnonzero(~is_sep)
        slots = keep - int(is_sep.sum())
        if method == "uniform":
            chosen = content[((2 * np.arange(slots) + 1) * len(content)) // (2 * slots)]
        elif method == "random":
            table = np.random.default_rng(seed).random(1 << 16).astype(np.float32)
            chosen = content[np.sort(np.argsort(-table[: len(content)], kind="stable")[:slots])]
        else:
            chosen = content[_topk_sorted(token_scores[start : start + n][content], slots)]
        out.append(np.sort(np.concatenate([np.flatnonzero(is_sep), chosen])))
        start += n
    return out


@pytest.mark.parametrize("method", ["attention", "uniform", "random"])
@pytest.mark.parametrize("name", sorted(ANYRES))
def test_anyres_keeps_every_newline_and_the_best_tokens_per_image(exported, name, method):
    method = ANYRES[name] if method == "attention" else method
    keep = 30
    pkg = Package.load(exported(name))
    feeds = _anyres_feeds(pkg)
    pruned = _prune(exported(name), keep=keep, method=method, seed=3)
    assert pruned.manifest["vision"]["tokens_per_image"] == keep
    graph_feeds = {k: v for k, v in feeds.items() if k != "image_sizes"}
    out = Pipeline(pruned).run_graph("vision_encoder", graph_feeds)
    full = Pipeline(pkg).run_graph("vision_encoder", graph_feeds)["image_features"]
    expected = _anyres_expected(pkg, feeds, method, keep, seed=3)
    np.testing.assert_array_equal(out[measure.INDICES_OUTPUT], np.stack(expected))
    counts = preprocess.token_counts(feeds, pkg.manifest["vision"]["preprocess"])
    starts = np.cumsum([0, *counts[:-1]])
    rows = np.concatenate([s + e for s, e in zip(starts, expected)])
    np.testing.assert_array_equal(out["image_features"], full[rows])  # kept tokens, exact, in order


def test_anyres_keep_below_the_newline_rows_is_refused(exported):
    most = Package.load(exported("tiny-llava-next")).manifest["vision"]["token_table"]["most_rows"]
    with pytest.raises(PassFailed, match=f"keep={most} must be above the {most} feature rows"):
        _prune(exported("tiny-llava-next"), keep=most, method="uniform")
    with pytest.raises(PassFailed, match="give keep"):
        _prune(exported("tiny-llava-next"), ratio=0.5, method="uniform")


def _hd_feeds(pkg: Package) -> dict:
    """Two images of different crop grids (2 x 2 and 1 x 3: 757 and 601 tokens, 37 and 25 separators)."""
    rng = np.random.default_rng(0)
    images = [preprocess.demo_image(64, seed=1), rng.integers(0, 256, (40, 150, 3)).astype(np.uint8)]
    feeds = Pipeline(pkg).vision_feeds(preprocess.preprocess(images, pkg.manifest["vision"]["preprocess"]))
    assert preprocess.token_counts(feeds, pkg.manifest["vision"]["preprocess"]) == [757, 601]
    return feeds


def _hd_expected(pkg: Package, feeds: dict, method: str, keep: int, seed: int = 0) -> list[np.ndarray]:
    """Per image, in numpy: every separator (sub_GN, glb_GN) and the best keep - separators crop tokens,
    each scored by the CLS attention of the 2 x 2 patches it merges, ascending."""
    index = feeds["image_feature_index"]
    images, crops = feeds["pixel_values"].shape[:2]
    table = pkg.manifest["vision"]["token_table"]
    separator = images * crops * table["tile_tokens"]  # the table's sub_GN row (glb_GN follows it)
    counts = preprocess.token_counts(feeds, pkg.manifest["vision"]["preprocess"])
    if method == "cls_attention":
        att = pkg.manifest["vision"]["attention"]
        sess = ortsession.from_model(pkg.model("vision_encoder"), extra_outputs=[att["probs"]])
        graph_feeds = {k: feeds[k] for k in ("pixel_values", "image_feature_index")}
        probs = sess.run([att["probs"]], graph_feeds)[0]  # [images * crops, heads, 577, 577]
        cls = probs[:, :, 0].mean(1)  # [tiles, keys]
        groups = np.asarray(att["groups"]).reshape(-1, att["group_size"])  # [144, 4] key columns
        rows = np.concatenate([cls[:, groups].mean(2).reshape(-1), [0.0, 0.0]]).astype(np.float32)
        token_scores = rows[index]
    else:
        token_scores = None
    return _table_expected(counts, index >= separator, token_scores, method, keep, seed)


@pytest.mark.parametrize("method", ["cls_attention", "uniform", "random"])
def test_hd_crops_keep_every_separator_and_the_best_tokens_per_image(exported, method):
    """Phi-3-vision: each image keeps its sub_GN / glb_GN separators and the best crop tokens, k in all."""
    keep = 327  # the k-th and next attention scores of both images are 8.5e-6 apart here (no near-tie)
    pkg = Package.load(exported("tiny-phi3-v"))
    feeds = _hd_feeds(pkg)
    pruned = _prune(exported("tiny-phi3-v"), keep=keep, method=method, seed=3)
    assert pruned.manifest["vision"]["tokens_per_image"] == keep
    graph_feeds = {k: feeds[k] for k in ("pixel_values", "image_feature_index")}
    out = Pipeline(pruned).run_graph("vision_encoder", graph_feeds)
    full = Pipeline(pkg).run_graph("vision_encoder", graph_feeds)["image_features"]
    expected = _hd_expected(pkg, feeds, method, keep, seed=3)
    np.testing.assert_array_equal(out[measure.INDICES_OUTPUT], np.stack(expected))
    starts = np.cumsum([0, 757])
    rows = np.concatenate([s + e for s, e in zip(starts, expected)])
    np.testing.assert_array_equal(out["image_features"], full[rows])  # kept tokens, exact, in order
    if method == "cls_attention":
        assert pruned.manifest["history"][-1]["report"]["score_source"] == "graph"


def test_hd_crops_recomputed_attention_gives_the_same_indices(exported):
    feeds = _hd_feeds(Package.load(exported("tiny-phi3-v")))
    graph_feeds = {k: feeds[k] for k in ("pixel_values", "image_feature_index")}
    kept = [
        Pipeline(_prune(exported("tiny-phi3-v"), keep=327, recompute_attention=r)).run_graph(
            "vision_encoder", graph_feeds
        )[measure.INDICES_OUTPUT]
        for r in (False, True)
    ]
    np.testing.assert_array_equal(kept[0], kept[1])


def test_hd_crops_keep_at_or_below_the_separators_is_refused(exported):
    table = Package.load(exported("tiny-phi3-v")).manifest["vision"]["token_table"]
    assert table["most_rows"] == 5 * 12 + 1  # a 4 x 1 grid: 48 + 12 sub_GN rows, one glb_GN
    with pytest.raises(PassFailed, match="keep=61 must be above the 61 separator tokens"):
        _prune(exported("tiny-phi3-v"), keep=61, method="uniform")
    with pytest.raises(PassFailed, match=r"\(HD crops\); give keep"):
        _prune(exported("tiny-phi3-v"), ratio=0.5, method="uniform")


def test_pruned_phi3_v_runs_k_tokens_per_image_and_its_reference_build_agrees(exported, tmp_path):
    """Each <|image_N|> expands to k placeholders; onnxruntime and the Ascend reference build give the same
    tokens (the build pads the feature index by rows: the padded copies belong to no image)."""
    src = tmp_path / "src"
    shutil.copytree(exported("tiny-phi3-v"), src)
    pkg = Package.load(src)
    image_id = pkg.manifest["vision"]["image_token_id"]
    demo = int((Pipeline(pkg).prepare(["Describe the image."], [["demo"]]).input_ids == image_id).sum())
    assert demo == 757
    keep = demo // 2
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"passes": [{"prune_visual_tokens": {**NO_CAL, "keep": keep}}]}))
    out, build = tmp_path / "pruned", tmp_path / "build"
    runner = CliRunner()
    r = runner.invoke(main, ["optimize", str(src), "-r", str(recipe), "-o", str(out)])
    assert r.exit_code == 0, r.output
    pruned = Package.load(out)
    spec = budget.spec_from_package(pruned, (1080, 1920))  # vlmc plan: a 2 x 2 grid, k of its 757 tokens
    assert (spec.tokens_per_image, spec.tokens_per_image_unpruned) == (keep, 757)
    pipe = Pipeline(pruned)
    two = pipe.prepare(["<|image_1|>\nand <|image_2|>\nsay"], [["demo", "demo:1"]])
    assert int((two.input_ids == image_id).sum()) == 2 * keep
    res = pipe.generate_from(two, 3)
    assert res.image_tokens == 2 * keep
    args = ["--image", "demo", "--prompt", "Describe the image.", "--max-new-tokens", "6", "--json"]
    r = runner.invoke(main, ["run", str(out), *args])
    assert r.exit_code == 0, r.output
    ort_tokens = json.loads(r.stdout.splitlines()[-1])["tokens"][0]
    unpruned = Pipeline(pkg).generate(["Describe the image."], [["demo"]], 6)
    assert unpruned.image_tokens == demo and ort_tokens != unpruned.tokens[0]  # the prompt really shrank
    r = runner.invoke(main, ["compile", str(out), "--soc", "Ascend910B4", "-o", str(build)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["run", str(build), "--executor", "reference", "--against", str(out), *args])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["tokens"][0] == ort_tokens
    assert got["agreement"]["tokens_agree"] == got["agreement"]["tokens"] == 6


# ---- graph properties ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,opts",
    [
        ("tiny-llava", {"keep": 16}),
        ("tiny-llava", {"ratio": 0.25, "method": "random"}),
        ("tiny-qwen2-vl", {"keep": 8, "method": "attention_received"}),
        ("tiny-qwen2-vl", {"keep": 8, "method": "random"}),
        ("tiny-phi3-v", {"keep": 378}),
        ("tiny-phi3-v", {"keep": 378, "method": "random"}),
    ],
)
def test_rewrite_uses_only_static_atc_ops_and_stays_valid(exported, name, opts):
    pruned = _prune(exported(name), **opts)
    model = pruned.model("vision_encoder")
    with interop.as_proto(model, weight_limit=None) as seam:
        onnx.checker.check_model(seam.proto, full_check=True)
    ops = {n.op_type for n in model.graph}
    assert ops <= _atc_ops(), ops - _atc_ops()
    assert not ops & {"NonZero", "Compress", "Unique"}
    assert max(v for d, v in model.opset_imports.items() if d in ("", "ai.onnx")) == 17
    outs = {o["name"]: o["shape"] for o in pruned.info("vision_encoder")["outputs"]}
    assert outs[measure.INDICES_OUTPUT][1] == pruned.manifest["vision"]["tokens_per_image"]
    assert pruned.manifest["history"][-1]["modified"] is True


# ---- refusals and options ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts,message",
    [
        ({}, "exactly one of keep"),
        ({"keep": 4, "ratio": 0.5}, "exactly one of keep"),
        ({"ratio": 0.0}, "above 0"),
        ({"keep": 0}, "below the minimum"),
        ({"keep": 4, "method": "topk"}, "is not one of"),
        ({"keep": 4, "bogus": 1}, "unknown option"),
    ],
)
def test_option_errors(opts, message):
    with pytest.raises(VlmcError, match=message):
        get("prune_visual_tokens")(**opts)


@pytest.mark.parametrize(
    "name,opts,message",
    [
        ("tiny-llava", {"keep": 64}, "not below the 64 visual tokens"),
        ("tiny-qwen2-vl", {"keep": 8}, "needs a CLS token"),
        ("tiny-qwen2-vl", {"ratio": 0.5, "method": "uniform"}, "give keep"),
        ("tiny-qwen2-vl", {"keep": 8, "method": "attention_received", "recompute_attention": True}, "masked"),
    ],
)
def test_package_refusals_leave_the_package_unchanged(exported, name, opts, message):
    pkg = Package.load(exported(name))
    before = json.dumps(pkg.manifest, sort_keys=True)
    with pytest.raises(PassFailed, match=message):
        manager.run(pkg, [Step(index=1, name="prune_visual_tokens", options=dict(NO_CAL, **opts))])
    assert json.dumps(pkg.manifest, sort_keys=True) == before
    assert all(not pkg.is_loaded(g) or pkg.state()[g] == pkg.original_fingerprint(g) for g in pkg.graph_names)


def test_already_pruned_is_refused(tiny_llava):
    pkg = _prune(tiny_llava, keep=16)
    with pytest.raises(PassFailed, match="already pruned"):
        manager.run(pkg, [Step(index=2, name="prune_visual_tokens", options=dict(NO_CAL, keep=8))])


def test_fusion_chain_is_refused_unless_forced(exported):
    """BLIP-2: the image chain ends in a fusion graph (Q-Former queries), so there is nothing to prune."""
    path = exported("tiny-blip2")
    with pytest.raises(PassFailed, match="fusion graph .* nothing to prune"):
        _prune(path, keep=4)
    with pytest.raises(PassFailed, match="use method uniform or random"):
        _prune(path, keep=4, force=True)
    pkg = _prune(path, keep=4, method="uniform", force=True)
    res = Pipeline(pkg).generate(["Describe the image."], [["demo"]], 3)
    assert res.image_tokens == 4


# ---- runtime: positions and guards -------------------------------------------------------------------
def test_mrope_kept_tokens_keep_original_positions(tiny_qwen):
    full = Pipeline(Package.load(tiny_qwen))
    pruned = Pipeline(_prune(tiny_qwen, keep=12, method="attention_received"))
    ref_inp, inp = (
        full.prepare(["Describe <image> it."], [["demo"]]),
        pruned.prepare(["Describe <image> it."], [["demo"]]),
    )
    pruned.prefill_embeds(inp)
    kept = inp.image_outputs[measure.INDICES_OUTPUT][0]
    ctx = {"manifest": pruned.m, "vision": inp.vision, "image_outputs": inp.image_outputs}
    pos = mrope.positions_mrope(inp.input_ids, inp.attention_mask, ctx)[:, 0]
    ref = mrope.positions_mrope(
        ref_inp.input_ids, ref_inp.attention_mask, {"manifest": full.m, "vision": ref_inp.vision}
    )[:, 0]
    image_id = full.m["vision"]["image_token_id"]
    ref_img, img = ref_inp.input_ids[0] == image_id, inp.input_ids[0] == image_id
    np.testing.assert_array_equal(pos[:, img], ref[:, ref_img][:, kept])
    np.testing.assert_array_equal(pos[:, ~img], ref[:, ~ref_img])  # text keeps its unpruned positions


def test_image_with_fewer_tokens_than_k_is_refused(tiny_qwen):
    pipe = Pipeline(_prune(tiny_qwen, keep=30, method="uniform"))
    with pytest.raises(VlmcError, match="fewer than the 30"):
        pipe.prepare(["hi"], [[np.zeros((40, 40, 3), np.uint8)]])


# ---- end to end through the CLI ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,options",
    [("tiny-llava", "{keep: 16}"), ("tiny-qwen2-vl", "{keep: 12, method: attention_received}")],
)
def test_cli_optimize_run_verify_inspect(exported, tmp_path, name, options):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"passes:\n  - prune_visual_tokens: {options}\n")
    out = tmp_path / "pruned"
    # A private copy: save() hard-links unchanged data files, and the shared session package must
    # keep one link (onnx.checker refuses hard-linked external data).
    src = tmp_path / "src"
    shutil.copytree(exported(name), src)
    runner = CliRunner()
    r = runner.invoke(main, ["optimize", str(src), "-r", str(recipe), "-o", str(out)])
    assert r.exit_code == 0, r.output
    m = json.loads((out / "vlmc.json").read_text())
    rep = m["history"][0]["report"]
    fid = rep["fidelity"]
    assert set(fid) >= {m["vision"]["pruning"]["method"], "uniform", "random"}
    for row in (v for v in fid.values() if isinstance(v, dict)):
        assert row["kl"] >= 0 and -1 <= row["cosine"] <= 1 and 0 <= row["top5"] <= 1
        assert row["visual_tokens"] == m["vision"]["tokens_per_image"]
    # the reference is the unpruned package (the pass must not have pruned the snapshot's graph)
    assert fid["reference_visual_tokens"] > m["vision"]["tokens_per_image"]
    assert rep["savings"]["visual_tokens_after"] < rep["savings"]["visual_tokens_before"]
    assert 0 < rep["savings"]["prefill_flops_saved"] < 1
    assert (out / "pruning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![pruning](pruning.png)" in (out / "report.md").read_text()
    assert "## Visual-token pruning" in (out / "report.md").read_text()
    r = runner.invoke(
        main,
        [
            "run",
            str(out),
            "--image",
            "demo",
            "--prompt",
            "Describe the image.",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["tokens"][0]) >= 1
    r = runner.invoke(main, ["verify", str(out), "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    v = json.loads((out / "verify.json").read_text())
    assert v["exact_package"] is False and v["prefill_logits_kl"] >= 0 and 0 <= v["top5_agreement"] <= 1
    assert v["visual_tokens"]["package"] == m["vision"]["tokens_per_image"] < v["visual_tokens"]["reference"]
    png = tmp_path / "kept.png"
    r = runner.invoke(main, ["inspect", str(out), "--pruning", "demo:2", "-o", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_inspect_pruning_on_unpruned_package_is_a_user_error(tiny_llava, tmp_path):
    r = CliRunner().invoke(
        main, ["inspect", str(tiny_llava), "--pruning", "demo", "-o", str(tmp_path / "x.png")]
    )
    assert r.exit_code == 2
    assert "not pruned" in r.output


def test_fastv_flops_formula():
    # layers * (4nd^2 + 2n^2d + 2ndm) with n=10, d=4, m=8, 2 layers
    assert measure.prefill_flops(2, 4, 8, 10) == 2 * (4 * 10 * 16 + 2 * 100 * 4 + 2 * 10 * 4 * 8)


def test_recipes_validate():
    from vlmc import recipe

    root = Path(__file__).resolve().parents[2] / "recipes"
    for name, keep in (("llava-1.5-prune-144.yaml", 144), ("qwen2-vl-448-prune-96.yaml", 96)):
        r = recipe.load(root / name)
        step = [s for s in r.steps if s.name == "prune_visual_tokens"][0]
        assert step.instantiate().opts["keep"] == keep


def test_bench_prune_quick_smoke():
    """scripts/bench_prune.py (make bench) in its tiny mode: both prefills run, token counts as pruned."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_prune.py"
    spec = importlib.util.spec_from_file_location("bench_prune", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows: list = []
    out = mod.run(rows, quick=True)
    assert rows == out and len(out) == 3
    full, pruned, ratio = out
    assert (full["visual_tokens"], pruned["visual_tokens"]) == (64, 16)
    assert full["prefill_tokens"] - pruned["prefill_tokens"] == 48
    assert len(full["runs_ms"]) == len(pruned["runs_ms"]) >= 5
    assert ratio["ratio"] == pytest.approx(full["median_ms"] / pruned["median_ms"], rel=1e-2)
