"""InternVL (-hf): tiles + thumbnail, <img>/<IMG_CONTEXT>/</img> expansion, parity from raw inputs.

The source directory is a random-weight InternVLForConditionalGeneration saved beside a real-format Qwen2
tokenizer with InternVL's special tokens and GotOcr2's image processor files (tests/_tokenizers_internvl.py).
The transformers side is the directory's own processor (images-only: its video half needs torchvision) and
generate; nothing from vlmc prepares its inputs.
"""

from __future__ import annotations

import json

import _real_tokenizers
import _tokenizers_internvl
import numpy as np
import pytest
from click.testing import CliRunner

from vlmc import manager, recipe, verify
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.exporters import internvl as internvl_exporter
from vlmc.package import Package
from vlmc.recipe import Step
from vlmc.runtime import Pipeline, tiles

from .test_parity_raw_inputs import Family, _check, _ids, _vlmc_run

TOKENS_PER_TILE = 16  # 64 px tiles, 8 px patches, pixel shuffle 0.5
NO_CAL = {"calibration_images": 0, "picture": False}


def _prune(pkg: Package, **opts) -> Package:
    return manager.run(pkg, [Step(index=1, name="prune_visual_tokens", options=dict(NO_CAL, **opts))])


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("internvl"), _tokenizers_internvl.internvl_dir)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """A wide image that makes a 3x2 grid + thumbnail (7 tiles), a small square one (1 tile), a tall one
    (1x2 + thumbnail: 3 tiles)."""
    root = tmp_path_factory.mktemp("internvl_pictures")
    sizes = [(120, 200), (40, 40), (150, 70)]
    return [_real_tokenizers.save_image(root / f"{i}.png", h, w, 20 + i) for i, (h, w) in enumerate(sizes)]


def _runs(ids: list[int], proc) -> list[tuple[str, int]]:
    """Run-length pieces of the image part: [('<img>', 1), ('<IMG_CONTEXT>', n), ('</img>', 1), ...]."""
    tok = proc.tokenizer
    names = {tok.convert_tokens_to_ids(t): t for t in ("<img>", "</img>", "<IMG_CONTEXT>")}
    out: list[tuple[str, int]] = []
    for x in ids:
        name = names.get(x)
        if name is None:
            continue
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + 1)
        else:
            out.append((name, 1))
    return out


def test_package_carries_the_processor_facts(internvl):
    m = internvl.pkg.manifest
    t, v = m["text"], m["vision"]
    assert type(internvl.proc.tokenizer).__name__ == "Qwen2Tokenizer"
    assert t["image_marker"] == t["image_token"] == "<IMG_CONTEXT>"
    assert t["image_expansion"] == "<img>{tokens}</img>"
    assert (internvl.pkg_dir / t["chat_template"]).read_text() == _tokenizers_internvl.INTERNVL_CHAT_TEMPLATE
    assert v["tokens_per_image"] == TOKENS_PER_TILE and v["tiled"] is True
    pre = v["preprocess"]
    # preprocessor_config.json says crop_to_patches false; InternVLProcessor's own default (true) applies
    assert json.loads((internvl.src / "preprocessor_config.json").read_text())["crop_to_patches"] is False
    assert pre["kind"] == "tiles" and pre["crop_to_patches"] is True
    assert (pre["min_tiles"], pre["max_tiles"], pre["tile_size"]) == (1, 6, [64, 64])
    assert pre["mean"] == internvl_exporter.IMAGENET_MEAN and pre["resample"] == "bicubic"
    from vlmc import report

    assert f"- visual tokens per image: {TOKENS_PER_TILE} per tile\n" in report.render_markdown(internvl.pkg)


def test_plain_prompt_several_tiles_and_a_thumbnail(internvl, pictures):
    ref = _check(internvl, ["What is shown in this picture?"], [[pictures[0]]])
    assert ref["pixel_values"].shape[0] == 7  # 3x2 tiles + thumbnail
    ids = ref["input_ids"][0].tolist()
    assert _runs(ids, internvl.proc) == [("<img>", 1), ("<IMG_CONTEXT>", 7 * TOKENS_PER_TILE), ("</img>", 1)]
    tok = internvl.proc.tokenizer
    assert tok.decode(ids).startswith("<|im_start|>user\n<img>")
    assert tok.convert_ids_to_tokens(ids[ids.index(tok.convert_tokens_to_ids("</img>")) + 1]) == "Ċ"


def test_explicit_placeholder_one_tile_no_thumbnail(internvl, pictures):
    ref = _check(
        internvl, ["<|im_start|>user\n<IMG_CONTEXT>\nDescribe the image.<|im_end|>\n"], [[pictures[1]]]
    )
    assert ref["pixel_values"].shape[0] == 1
    assert _runs(ref["input_ids"][0].tolist(), internvl.proc)[1] == ("<IMG_CONTEXT>", TOKENS_PER_TILE)


def test_batch_of_two_with_different_tile_counts(internvl, pictures):
    ref = _check(
        internvl,
        ["Describe the image.", "What colour is the large circle here?"],
        [[pictures[2]], [pictures[0]]],
    )
    assert ref["pixel_values"].shape[0] == 3 + 7
    rows = _ids(ref["input_ids"], ref["attention_mask"])
    assert [_runs(r, internvl.proc)[1][1] for r in rows] == [3 * TOKENS_PER_TILE, 7 * TOKENS_PER_TILE]


def test_two_images_in_one_prompt(internvl, pictures):
    _check(internvl, ["Compare the two pictures."], [[pictures[1], pictures[2]]])


def test_verify_passes_on_a_multi_tile_image(internvl, pictures):
    res = verify.verify(
        internvl.pkg, max_new_tokens=6, prompts=["What is in the image?"], images=[[pictures[0]]]
    )
    assert res.passed, res
    assert res.inputs["checked"] and res.inputs["ids_equal"] and res.inputs["pixel_max_abs_diff"] <= 1e-5
    assert res.inputs["processor"] == "InternVLProcessor"
    assert res.visual_tokens == {"package": 7 * TOKENS_PER_TILE, "reference": 7 * TOKENS_PER_TILE}


def test_tied_word_embeddings(tmp_path, pictures):
    fam = Family(tmp_path, lambda p: _tokenizers_internvl.internvl_dir(p, tie=True))
    assert fam.model.config.tie_word_embeddings
    _check(fam, ["What is in the image?"], [[pictures[2]]])


@pytest.mark.parametrize("max_tiles", [1, 12])
def test_tile_rule_matches_the_processor_over_many_sizes(max_tiles):
    """tiles.tile_grid against transformers' own canvas choice, ties and the area rule included."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    sizes = [(h, w) for h in (16, 33, 64, 90, 128, 200, 448, 1000) for w in (16, 40, 64, 96, 300, 448, 1337)]
    for h, w in sizes:
        for tile in (64, 448):
            want = get_optimal_tiled_canvas((h, w), (tile, tile), 1, max_tiles)
            assert tiles.tile_grid(h, w, tile, tile, 1, max_tiles) == want, (h, w, tile)


def test_tile_count_rule_against_the_processor(internvl):
    ip = internvl.proc.image_processor
    facts = internvl.pkg.manifest["vision"]["preprocess"]
    kw = {"crop_to_patches": True, "max_patches": facts["max_tiles"], "min_patches": facts["min_tiles"]}
    for h, w in [(120, 200), (40, 40), (150, 70), (96, 96), (64, 400), (10, 1000)]:
        assert tiles.tiles_for(h, w, facts) == ip.get_number_of_image_patches(h, w, kw), (h, w)


def test_vlmc_run_on_the_saved_package_needs_no_torch(internvl, pictures):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['torch'] = None\n"
        "from vlmc.package import Package; from vlmc.runtime import Pipeline\n"
        f"p = Pipeline(Package.load({str(internvl.pkg_dir)!r}))\n"
        f"i = p.prepare(['What is it?'], [[{pictures[0]!r}]])\n"
        "print(i.vision['pixel_values'].shape[0], i.image_tiles)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "7"


@pytest.mark.parametrize("size", ["120x200", None])
def test_plan_counts_tiles_from_the_package(internvl, size):
    args = ["plan", str(internvl.pkg_dir), "--device-memory", "1GiB", "--json"]
    res = CliRunner().invoke(main, args + (["--image-size", size] if size else []))
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    tiles_ = 7 if size else 6 + 1  # 3x2 + thumbnail; at most max_patches + thumbnail
    assert plan["tokens_per_image"] == plan["image_tokens"] == tiles_ * TOKENS_PER_TILE
    assert any(n.startswith("image tokens:") for n in plan["notes"])


def test_plan_counts_tiles_from_a_config(internvl):
    config = str(internvl.src / "config.json")
    base_args = ["plan", "--config", config, "--device-memory", "1GiB", "--json"]
    res = CliRunner().invoke(main, base_args + ["--image-size", "150x70"])
    assert res.exit_code == 0, res.output
    # the processor is loaded for its tile settings (a log line about its video half comes first)
    assert json.loads(res.output[res.output.index("{") :])["tokens_per_image"] == 3 * TOKENS_PER_TILE
    res = CliRunner().invoke(main, base_args)
    assert res.exit_code != 0 and "--image-size" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, base_args + ["--image-size", "150by70"])
    assert res.exit_code == 2 and "HEIGHTxWIDTH" in res.output


def test_pruned_package_keeps_k_tokens_per_tile(internvl, pictures):
    out = _prune(Package.load(internvl.pkg_dir), keep=4, method="uniform")
    pipe = Pipeline(out)
    inp = pipe.prepare(["What is in the image?"], [[pictures[0]]])
    assert int((inp.input_ids == out.manifest["vision"]["image_token_id"]).sum()) == 7 * 4
    res = verify.verify(out, max_new_tokens=3, prompts=["What is in the image?"], images=[[pictures[0]]])
    assert res.inputs["ids_equal"] and res.visual_tokens["reference"] == 7 * TOKENS_PER_TILE


def test_pruning_by_attention_scores_the_pixel_shuffle_groups(internvl, pictures):
    # each token scores the CLS attention of the 2x2 patches its pixel shuffle folds (numerics:
    # tests/test_prune.py against transformers' attentions)
    out = _prune(Package.load(internvl.pkg_dir), keep=4, method="cls_attention")
    att = out.manifest["vision"]["attention"]
    assert att["group_size"] == 4 and len(att["groups"]) == 4 * TOKENS_PER_TILE
    assert sorted(att["groups"]) == list(range(1, 4 * TOKENS_PER_TILE + 1))  # every patch once, CLS is 0
    inp = Pipeline(out).prepare(["What is in the image?"], [[pictures[0]]])
    assert int((inp.input_ids == out.manifest["vision"]["image_token_id"]).sum()) == 7 * 4


def test_mismatched_image_seq_length_is_refused(tmp_path):
    from vlmc import exporters

    src = _tokenizers_internvl.internvl_dir(tmp_path / "src")
    (src / "processor_config.json").write_text(
        json.dumps({"processor_class": "InternVLProcessor", "image_seq_length": 256})
    )
    with pytest.raises(VlmcError, match="256 image tokens per tile"):
        exporters.export(exporters.load_source(str(src)))


def test_prepare_rejects_mismatched_markers(internvl, pictures):
    with pytest.raises(VlmcError, match="placeholder"):
        Pipeline(internvl.pkg).prepare(["<IMG_CONTEXT><IMG_CONTEXT> two markers"], [[pictures[1]]])


def test_thumbnail_tile_is_the_whole_image(internvl, pictures):
    inp = Pipeline(internvl.pkg).prepare(["x"], [[pictures[0]]])
    assert inp.image_tiles == [7]
    assert np.asarray(inp.vision["pixel_values"]).shape == (7, 3, 64, 64)


# ---- passes and the Ascend backend on the real-format package ------------------------------------


@pytest.mark.parametrize(
    "passes",
    [[{"paged_kv": {"block_size": 16}}], [{"merge": {}}], [{"split": {"decoder_ranges": 2}}]],
    ids=["paged_kv", "merge", "split"],
)
def test_exact_passes_keep_vlmc_run_equal_to_generate(internvl, pictures, tmp_path, passes):
    out = manager.run(Package.load(internvl.pkg_dir), recipe.from_dict({"passes": passes}).steps)
    out_dir = out.save(tmp_path / "pkg")
    prompts, images = (
        ["What is shown in this picture?", "Describe the image."],
        [[pictures[0]], [pictures[2]]],
    )
    want = internvl.generate(internvl.reference(prompts, images))
    assert _vlmc_run(out_dir, prompts, images) == want


def test_quantized_package_compiles_for_ascend(internvl, tmp_path):
    from vlmc.backends import ascend

    steps = recipe.parse(
        "passes:\n  - quantize:\n"
        "      vision_encoder: {weights: int8, activations: int8, calibration: {count: 2}}\n"
        "      decoder: {weights: int4, group_size: 32}\n"
    ).steps
    pkg = manager.run(Package.load(internvl.pkg_dir), steps)
    summary = ascend.compile(pkg, tmp_path / "b", {"soc": "Ascend910B", "soc_variant": "Ascend910B2"})
    names = {b["name"] for b in summary["builds"]}
    assert {"vision_encoder", "decoder_prefill", "decoder_decode"} <= names
    assert any(b["quantized"] for b in summary["builds"])
    # the vision build takes tiles: its batch axis is the tile count, planned like any image batch
    vision = next(b for b in summary["builds"] if b["name"] == "vision_encoder")
    cmd = (tmp_path / "b" / vision["workdir"] / "atc.cmd").read_text()
    assert "pixel_values" in cmd and "64,64" in cmd
