"""Resolution gears: a build of a dynamic-resolution family runs every image its package runs.

Each family's build gets gears derived from its preprocessor's limits (or the target's own), and the
runtime fits every image to one: packed patches are resized to a compiled grid (the tokens become that
grid's, and the package on the resized pixels gives the same tokens), tiles and anyres inputs are padded
(the tokens are the package's on the original image).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vlmc.backends import ascend
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import Pipeline, patches, preprocess
from vlmc.runtime.executors import build as runner

PROMPTS = ["Describe the image."]
NEW_TOKENS = 6
SOC = "Ascend910B2"
DYNAMIC = {
    "tiny-qwen2-vl": "patches",
    "tiny-qwen2.5-vl": "patches",
    "tiny-qwen3-vl": "patches",
    "tiny-glm4v": "patches",
    "tiny-internvl": "images",
    "tiny-llava-next": "tiles",
    "tiny-llava-onevision": "tiles",
}
FIXED = ("tiny-llava", "tiny-gemma3", "tiny-blip2")


def _compile(pkg: Package, out: Path, **extra) -> dict:
    return ascend.compile(pkg, out, {"soc": SOC, "sequence_buckets": [64, 256], **extra})


def _run_build(out: Path, images: list, prompts=PROMPTS) -> tuple[object, Package, runner.BuildExecutor]:
    run_pkg, executor = runner.open_build(out, "reference")
    got = Pipeline(run_pkg, executor=executor).generate(prompts, [images], NEW_TOKENS)
    return got, run_pkg, executor


@pytest.mark.parametrize("name", [*DYNAMIC, *FIXED])
def test_every_family_runs_the_demo_image_on_its_default_build(exported, tmp_path, name):
    pkg = Package.load(exported(name))
    summary = _compile(pkg, tmp_path / "b")
    got, run_pkg, executor = _run_build(tmp_path / "b", ["demo"])
    facts = run_pkg.manifest["vision"]["preprocess"]
    fitted, notes = preprocess.fit_to_gears(["demo"], facts)
    ref = Pipeline(pkg).generate(PROMPTS, [fitted], NEW_TOKENS)
    assert got.tokens == ref.tokens and len(got.tokens[0]) == NEW_TOKENS
    assert got.image_tokens == ref.image_tokens > 0
    assert set(executor.runs) == {b["name"] for b in summary["builds"]}  # every build ran, at a gear
    if name in FIXED:
        assert summary["resolution"] is None and preprocess.GEARS_KEY not in facts and notes == []
        return
    rules = {r["symbol"]: r for r in summary["resolution"]["rules"]}
    rule = rules[DYNAMIC[name]]
    assert rule["source"] == "preprocessor limits" and len(rule["gears"]) > 1 and rule["tokens"]
    assert facts[preprocess.GEARS_KEY] == {s: r["gears"] for s, r in rules.items()}
    vision = next(b for b in summary["builds"] if b["graph"] == pkg.manifest["pipeline"]["image"][0])
    assert 1 < vision["profiles"] <= 100
    if rule["fit"] == "resize":
        # the demo picture was resized to a compiled grid, and its tokens are that grid's
        (note,) = notes
        assert "resized to" in note and fitted[0].shape != preprocess.load_image("demo").shape
        grid = Pipeline(run_pkg).prepare(PROMPTS, [["demo"]]).vision["image_grid_thw"]
        assert int(np.prod(grid)) in rule["gears"]
    else:
        # padding leaves the image alone: the build's tokens are the package's on the original picture
        assert notes == [] and fitted[0] is not None
        assert Pipeline(pkg).generate(PROMPTS, [["demo"]], NEW_TOKENS).tokens == got.tokens


def test_packed_patches_keep_the_aspect_ratio_and_the_package_sees_the_same_grid(exported, tmp_path):
    pkg = Package.load(exported("tiny-qwen2-vl"))
    _compile(pkg, tmp_path / "b", images=[1, 2])
    wide = preprocess.demo_image(96)[:48]  # 48 x 96: its own grid 6 x 12, nearest gear 128 patches (8 x 16)
    tall = preprocess.demo_image(64, seed=3)[:, :32]  # 64 x 32: its own grid 8 x 4 = 32 patches, a gear
    two = ["<image><image>Compare the images."]
    got, run_pkg, _ = _run_build(tmp_path / "b", [wide, tall], two)
    facts = run_pkg.manifest["vision"]["preprocess"]
    fitted, notes = preprocess.fit_to_gears([wide, tall], facts)
    grids = Pipeline(pkg).prepare(two, [fitted]).vision["image_grid_thw"]
    # one request, one gear: both images have the patch count of the larger one's nearest grid
    assert len(notes) == 2 and int(np.prod(grids[0])) == int(np.prod(grids[1])) in facts["gears"]["patches"]
    (_, gh0, gw0), (_, gh1, gw1) = grids.tolist()
    assert gw0 == 2 * gh0 and gh1 == 2 * gw1  # each keeps its aspect ratio (the tall one is scaled up)
    ref = Pipeline(pkg).generate(two, [fitted], NEW_TOKENS)
    assert got.tokens == ref.tokens
    # the fitted pixels are a fixed point: fitting them again changes nothing
    again, _ = preprocess.fit_to_gears(fitted, facts)
    assert all(np.array_equal(a, b) for a, b in zip(again, fitted))


def test_target_gears_are_used_and_padding_is_exact(exported, tmp_path):
    pkg = Package.load(exported("tiny-llava-next"))
    summary = _compile(pkg, tmp_path / "b", tile_gears=[8], image_token_gears=[100, 200])
    rules = {r["symbol"]: r for r in summary["resolution"]["rules"]}
    assert rules["tiles"]["gears"] == [8] and rules["image_tokens"]["gears"] == [100, 200]
    assert {r["source"] for r in rules.values()} == {"target"}
    assert summary["resolution"]["row_padded"] == ["image_tokens"]
    got, _, _ = _run_build(tmp_path / "b", ["demo"])
    ref = Pipeline(pkg).generate(PROMPTS, [["demo"]], NEW_TOKENS)  # the original picture: nothing resized
    assert got.tokens == ref.tokens and got.image_tokens == ref.image_tokens == 88
    qwen = Package.load(exported("tiny-qwen2-vl"))
    summary = _compile(qwen, tmp_path / "q", patch_gears=[64, 256])
    vision = next(b for b in summary["builds"] if b["graph"] == "vision_encoder")
    assert vision["bindings"]["patches"] == [64, 256] and vision["profiles"] == 2


@pytest.mark.parametrize(
    "name, extra",
    [("tiny-qwen2-vl", {}), ("tiny-internvl", {}), ("tiny-llava-next", {"image_token_gears": [100]})],
)
def test_a_merged_paged_build_fits_images_the_same_way(exported, tmp_path, name, extra):
    # the merged vlm prefill graph takes the vision inputs too: resized grids, padded tiles and padded
    # feature-index rows (the merged graph reads the features of the placeholders only)
    from vlmc import pass_api

    pkg = Package.load(exported(name))
    pass_api.get("paged_kv")(block_size=16).run(pkg)
    pass_api.get("merge")().run(pkg)
    pkg.save(tmp_path / "merged")
    pkg = Package.load(tmp_path / "merged")
    summary = _compile(pkg, tmp_path / "b", **extra)
    vlm = next(b for b in summary["builds"] if b["graph"] == "vlm")
    assert any(r["symbol"] in vlm["bindings"] for r in summary["resolution"]["rules"])
    got, run_pkg, executor = _run_build(tmp_path / "b", ["demo"])
    assert executor.runs.get(vlm["name"]) == 1
    fitted, _ = preprocess.fit_to_gears(["demo"], run_pkg.manifest["vision"]["preprocess"])
    assert got.tokens == Pipeline(pkg).generate(PROMPTS, [fitted], NEW_TOKENS).tokens


@pytest.mark.parametrize(
    "name, extra", [("tiny-llava-onevision", {}), ("tiny-phi3-v", {"sequence_buckets": [1, 1024]})]
)
def test_table_images_are_never_padded_by_rows(exported, tmp_path, name, extra):
    # A copied image would move the feature table's last rows (anyres' image_newline, HD crops' sub_GN and
    # glb_GN): wrong tokens, not an error (tiny-phi3-v agreed on 0 of 6 tokens before). Phi-3's demo prompt
    # has 808 tokens, above the default sequence gears of a two-image build.
    pkg = Package.load(exported(name))
    summary = _compile(pkg, tmp_path / "b", images=[2], **extra)
    assert summary["resolution"]["unpadded"] == ["images"]
    with pytest.raises(VlmcError, match=r"no gear holds images=1"):
        _run_build(tmp_path / "b", ["demo"])


@pytest.mark.parametrize(
    "name, option, match",
    [
        ("tiny-internvl", {"patch_gears": [64]}, r"patch_gears does not apply .*\(tiles\).*tile_gears"),
        ("tiny-llava", {"tile_gears": [4]}, r"tile_gears does not apply .*none: its images have one size"),
        ("tiny-qwen2-vl", {"patch_gears": [30]}, r"30 patches is not a multiple of merge_size² \(4\)"),
        (
            "tiny-qwen2-vl",
            {"patch_gears": [8]},
            r"8 patches is outside what the preprocessor's min/max pixels",
        ),
        ("tiny-internvl", {"tile_gears": [4]}, r"largest tile gear 4 is below the 13 tiles"),
        ("tiny-llava-next", {"image_token_gears": [64]}, r"below the 88 tokens an image can give"),
        ("tiny-qwen2-vl", {"patch_gears": [0]}, r"patch_gears"),
    ],
)
def test_gear_options_are_checked_before_anything_is_written(exported, tmp_path, name, option, match):
    pkg = Package.load(exported(name))
    with pytest.raises(VlmcError, match=match):
        _compile(pkg, tmp_path / "b", **option)
    assert not (tmp_path / "b").exists()


def test_a_pruned_build_runs_every_image_on_gears_that_hold_its_kept_tokens(exported, tmp_path):
    from vlmc import pass_api

    pkg = Package.load(exported("tiny-qwen2-vl"))
    pass_api.get("prune_visual_tokens")(keep=24, method="uniform", picture=False).run(pkg)
    pkg.save(tmp_path / "pruned")
    pkg = Package.load(tmp_path / "pruned")
    summary = _compile(pkg, tmp_path / "b")
    assert min(summary["resolution"]["rules"][0]["gears"]) == 128  # 24 kept tokens need 96 patches: 128
    small = preprocess.demo_image(32)  # its own grid, 4 x 4 patches, is below what pruning keeps
    got, run_pkg, _ = _run_build(tmp_path / "b", [small])
    fitted, _ = preprocess.fit_to_gears([small], run_pkg.manifest["vision"]["preprocess"])
    assert got.tokens == Pipeline(pkg).generate(PROMPTS, [fitted], NEW_TOKENS).tokens


@pytest.mark.parametrize(
    "name, merged",
    [("tiny-qwen3-vl", False), ("tiny-qwen2-vl", True), ("tiny-qwen3-vl", True)],
    ids=["deepstack", "merged", "deepstack-merged"],
)
def test_a_pruned_build_holds_the_kept_rows_and_positions(exported, tmp_path, name, merged):
    # The deepstack rows of a pruned package are images x kept tokens, whatever the patch gear; a merged
    # pruned M-RoPE build places the kept tokens itself and returns its positions.
    from vlmc import pass_api

    pkg = Package.load(exported(name))
    pass_api.get("prune_visual_tokens")(keep=8, method="attention_received", picture=False).run(pkg)
    if merged:
        pass_api.get("merge")().run(pkg)
    pkg.save(tmp_path / "pruned")
    pkg = Package.load(tmp_path / "pruned")
    summary = _compile(pkg, tmp_path / "b")
    ds = pkg.manifest["text"].get("deepstack")
    if ds:
        assert any(b["bindings"].get(ds.get("rows_dim", "visual_tokens")) == [8] for b in summary["builds"])
    got, run_pkg, _ = _run_build(tmp_path / "b", ["demo"])
    fitted, _ = preprocess.fit_to_gears(["demo"], run_pkg.manifest["vision"]["preprocess"])
    assert got.tokens == Pipeline(pkg).generate(PROMPTS, [fitted], NEW_TOKENS).tokens


def test_dims_keep_their_exact_sizes_and_fit_nothing(exported, tmp_path):
    pkg = Package.load(exported("tiny-qwen2-vl"))
    own = int(Pipeline(pkg).prepare(PROMPTS, [["demo"]]).vision["pixel_values"].shape[0])
    summary = _compile(pkg, tmp_path / "b", dims={"patches": own})
    assert summary["resolution"] is None
    got, run_pkg, _ = _run_build(tmp_path / "b", ["demo"])
    assert preprocess.GEARS_KEY not in run_pkg.manifest["vision"]["preprocess"]
    assert got.tokens == Pipeline(pkg).generate(PROMPTS, [["demo"]], NEW_TOKENS).tokens


def test_default_patch_gears_follow_the_preprocessor_limits():
    # Qwen2-VL's published processor: 14 px patches, 2x2 merge, 56x56 .. 28x28x16384 pixels
    facts = {
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 3136,
        "max_pixels": 12845056,
    }
    gears = patches.default_gears(facts)
    assert gears == [4 * 2**j for j in range(7, 15)]  # the 8 largest powers of two, up to 65536 patches
    assert patches.check_gears(facts, gears) is None
    # GLM-4.1V's rule bounds both temporal frames: half the patches per image
    glm = {**facts, "resize": "temporal_pixels"}
    assert max(patches.default_gears(glm)) == 32768
    # a pruned package keeps 64 tokens of each image: every gear has at least 64 merge blocks
    small = {**facts, "patch_size": 8, "min_pixels": 1024, "max_pixels": 327680}  # the tiny built-in's
    kept = {"pruning": {"keep": 64}, "tokens_per_image": 64}
    assert patches.default_gears(small) == [32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert patches.default_gears(small, kept) == [256, 512, 1024, 2048, 4096]
    assert "outside" in patches.check_gears(small, [128], kept) and patches.check_gears(small, [128]) is None
    for height, width in ((480, 640), (1000, 200), (560, 560)):
        gh, gw = patches.gear_grid(height, width, facts, gears)
        assert gh * gw in gears and np.sign(gh - gw) == np.sign(height - width)


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-llava-onevision", "tiny-internvl"])
def test_default_tile_and_token_gears_hold_every_image_size(exported, name):
    from vlmc.runtime import anyres, tiles

    facts = Package.load(exported(name)).manifest["vision"]["preprocess"]
    sizes = [(h, w) for h in range(8, 260, 9) for w in range(8, 260, 11)]
    if facts["kind"] == "tiles":
        assert max(tiles.tiles_for(h, w, facts) for h, w in sizes) <= max(tiles.default_gears(facts))
        return
    # an image's token count depends on how much of its pinpoint it leaves unpadded
    most = max(anyres.tokens_for_size(h, w, facts) for h, w in sizes)
    assert most == max(anyres.default_token_gears(facts)) == anyres.most_tokens(facts)
    assert max(len(anyres.tiles(preprocess.demo_image(s)[:, : s // 2], facts)) for s in (40, 96)) <= max(
        anyres.default_tile_gears(facts)
    )


def test_tampered_runtime_gears_are_one_line_errors(exported, tmp_path):
    pkg = Package.load(exported("tiny-qwen2-vl"))
    _compile(pkg, tmp_path / "b")
    where = tmp_path / "b" / "runtime" / "vlmc.json"
    manifest = json.loads(where.read_text())
    for bad, match in (([], "must list positive integers"), ([30], "not a multiple of merge_size")):
        manifest["vision"]["preprocess"]["gears"]["patches"] = bad
        where.write_text(json.dumps(manifest))
        result = CliRunner().invoke(
            main, ["run", str(tmp_path / "b"), "--executor", "reference", "--image", "demo", "--prompt", "Hi"]
        )
        assert result.exit_code == 2 and match in result.stderr and "Traceback" not in result.stderr


def test_cli_run_against_the_package_uses_the_resized_pixels(exported, tmp_path):
    pkg_dir = exported("tiny-glm4v")
    _compile(Package.load(pkg_dir), tmp_path / "b")
    args = ["run", str(tmp_path / "b"), "--executor", "reference", "--image", "demo", "--prompt", PROMPTS[0]]
    result = CliRunner().invoke(main, [*args, "--max-new-tokens", str(NEW_TOKENS), "--against", str(pkg_dir)])
    assert result.exit_code == 0, result.stderr
    assert "resized to" in result.stderr and "for the patches gear" in result.stderr
    assert f"{NEW_TOKENS}/{NEW_TOKENS} tokens agree" in result.output
