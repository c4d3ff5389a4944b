"""The generic exporter tier from raw inputs: LLaVA-NeXT, LLaVA-OneVision and Gemma3 with real-format
tokenizers and processors (tests/_tokenizers_generic.py).

For each family: runtime ids, pixel values and image sizes equal the processor's (images of different
aspect ratios that give different tile grids), `vlmc run` tokens equal transformers generate with logit
spread asserted (test_parity_raw_inputs.Family.generate), for a plain prompt through the chat template,
an explicit placeholder and a batch of two. The anyres token-count rule is checked against the processor's
own count over many aspect ratios, and in `vlmc plan`.
"""

from __future__ import annotations

import json

import _real_tokenizers
import _tokenizers_generic
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from vlmc import verify
from vlmc.cli import main
from vlmc.runtime import Pipeline, anyres

from .test_parity_raw_inputs import Family, _check

# (h, w): tall, wide, square, very wide, very tall: different best pinpoints, unpadding on both axes
SIZES = [(120, 90), (64, 160), (96, 96), (30, 100), (140, 40), (33, 31), (200, 210), (50, 120)]


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures")
    return [_real_tokenizers.save_image(root / f"{i}.png", h, w, i) for i, (h, w) in enumerate(SIZES[:4])]


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("llava_next"), _tokenizers_generic.llava_next_dir)


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("onevision"), _tokenizers_generic.llava_onevision_dir)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("gemma3"), _tokenizers_generic.gemma3_dir)


def _sizes_equal(fam, prompts, images):
    ref = fam.reference(prompts, images)
    inp = Pipeline(fam.pkg).prepare(prompts, images)
    np.testing.assert_array_equal(inp.vision["image_sizes"], ref["image_sizes"].numpy())
    return ref, inp


# ---- LLaVA-NeXT ------------------------------------------------------------------------------


def test_llava_next_manifest_is_facts_of_the_generic_tier(llava_next):
    m = llava_next.pkg.manifest
    assert m["model"]["tier"] == "generic" and m["model"]["family"] == "llava_next"
    p = m["vision"]["preprocess"]
    assert p["kind"] == "anyres" and p["grid_pinpoints"] == [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
    assert p["mean"] == [0.5, 0.45, 0.4] and p["crop_size"] == {"height": 32, "width": 32}
    assert m["vision"]["tokens_per_image"] is None and m["text"]["image_marker"] == "<image>"
    names = [i["name"] for i in m["graphs"]["vision_encoder"]["inputs"]]
    assert names == ["pixel_values", "image_feature_index", "image_feature_weight"]


def test_llava_next_plain_prompt_two_tile_grids(llava_next, pictures):
    ref = _check(llava_next, ["What is shown in this picture?"], [[pictures[0]]])
    assert tuple(ref["pixel_values"].shape[:2]) == (1, 5)  # base + 2x2 tiles
    ref = _check(llava_next, ["Describe the image in detail."], [[pictures[1]]])
    assert tuple(ref["pixel_values"].shape[:2]) == (1, 4)  # base + 1x3 tiles


def test_llava_next_explicit_marker(llava_next, pictures):
    _check(llava_next, ["USER: <image>\nWhat colour is the large circle here? ASSISTANT:"], [[pictures[3]]])


def test_llava_next_batch_pads_tiles_like_the_processor(llava_next, pictures):
    prompts = ["Describe the image in detail.", "What colour is the large circle here?"]
    images = [[pictures[0]], [pictures[1]]]
    ref = _check(llava_next, prompts, images)
    pv = ref["pixel_values"].numpy()
    assert pv.shape[1] == 5 and not pv[1, 4].any()  # the 4-tile image padded with a zero tile
    _sizes_equal(llava_next, prompts, images)


# ---- LLaVA-OneVision -------------------------------------------------------------------------


def test_onevision_plain_prompt_with_and_without_the_downscale(onevision, pictures):
    facts = onevision.pkg.manifest["vision"]["preprocess"]
    assert (
        facts["max_tiles"] == 4
        and facts["crop_size"] is None
        and facts["size"] == {"height": 32, "width": 32}
    )
    # 120x90: 3x3 tiles, unpadded 12x10 features, more than 1.1x 4 tiles -> interpolated to 8x7
    ref = _check(onevision, ["What is in the image?"], [[pictures[0]]])
    n = int((ref["input_ids"] == onevision.pkg.manifest["vision"]["image_token_id"]).sum())
    assert n == 16 + 8 * 7 + 8
    # 64x160: 2x3 tiles, 8x12 features unpadded to 4x12 (int(round(4.8, 7)) rows of image): kept as is
    ref = _check(onevision, ["Describe the image."], [[pictures[1]]])
    n = int((ref["input_ids"] == onevision.pkg.manifest["vision"]["image_token_id"]).sum())
    assert n == 16 + 4 * 12 + 4


def test_onevision_explicit_marker_and_batch(onevision, pictures):
    _check(
        onevision,
        [
            "<|im_start|>user <image>\nWhat colour is the large circle here?<|im_end|>\n<|im_start|>assistant\n"
        ],
        [[pictures[2]]],
    )
    prompts = ["What is in the image?", "Compare the two pictures."]
    _check(onevision, prompts, [[pictures[3]], [pictures[0]]])
    _sizes_equal(onevision, prompts, [[pictures[3]], [pictures[0]]])


def test_onevision_refuses_several_images_in_one_prompt(onevision, pictures):
    res = CliRunner().invoke(
        main,
        [
            "run",
            str(onevision.pkg_dir),
            "--prompt",
            "Compare.",
            "--image",
            pictures[0],
            "--image",
            pictures[1],
        ],
    )
    assert res.exit_code != 0
    assert "llava_onevision: at most 1 image(s) per prompt" in res.output


# ---- the anyres token-count rule ---------------------------------------------------------------


@pytest.mark.parametrize("fam_name", ["llava_next", "onevision"])
def test_anyres_token_count_equals_the_processor_for_many_aspect_ratios(fam_name, request):
    fam = request.getfixturevalue(fam_name)
    facts = fam.pkg.manifest["vision"]["preprocess"]
    image_id = fam.pkg.manifest["vision"]["image_token_id"]
    seen = set()
    for i, (h, w) in enumerate(SIZES):
        from PIL import Image

        img = Image.fromarray(_real_tokenizers.image(h, w, i))
        ref = fam.proc(images=[img], text=[fam.marker], return_tensors="pt")
        want = int((ref["input_ids"] == image_id).sum())
        assert anyres.tokens_for_size(h, w, facts) == want, (h, w)
        seen.add(want)
    assert len(seen) >= 5  # the sizes really exercise different grids / unpadding / downscales


@pytest.mark.parametrize("fam_name", ["llava_next", "onevision"])
def test_plan_states_tokens_for_the_image_size(fam_name, request):
    """`vlmc plan` counts image tokens with the runtime's rule, from the package and from config.json."""
    fam = request.getfixturevalue(fam_name)
    image_id = fam.pkg.manifest["vision"]["image_token_id"]
    base = ["plan", "--device-memory", "16GiB", "--json"]
    seen = set()
    for i, (h, w) in enumerate(SIZES[:4]):
        from PIL import Image

        ref = fam.proc(
            images=[Image.fromarray(_real_tokenizers.image(h, w, i))], text=[fam.marker], return_tensors="pt"
        )
        want = int((ref["input_ids"] == image_id).sum())
        for source in ([str(fam.pkg_dir)], ["--config", str(fam.src / "config.json")]):
            res = CliRunner().invoke(main, [*base, *source, "--image-size", f"{h}x{w}"])
            assert res.exit_code == 0, res.output
            assert json.loads(res.output)["tokens_per_image"] == want, (source, h, w)
        seen.add(want)
    assert len(seen) >= 3
    res = CliRunner().invoke(main, ["plan", str(fam.pkg_dir), "--device-memory", "16GiB"])
    assert res.exit_code != 0 and "--image-size" in res.output


def test_prune_on_anyres_refuses_a_keep_below_the_newline_rows(llava_next, tmp_path):
    # anyres pruning keeps every row's image_newline: fewer kept tokens than rows is refused in one line
    recipe = tmp_path / "r.yaml"
    recipe.write_text("passes:\n  - prune_visual_tokens: {keep: 8, method: uniform}\n")
    res = CliRunner().invoke(
        main, ["optimize", str(llava_next.pkg_dir), "-r", str(recipe), "-o", str(tmp_path / "o")]
    )
    assert res.exit_code != 0
    assert "keep=8 must" in res.output and "image_newline" in res.output and not (tmp_path / "o").exists()


# ---- Gemma3 ----------------------------------------------------------------------------------


def test_gemma3_manifest_facts(gemma3):
    m = gemma3.pkg.manifest
    t, kv = m["text"], m["kv"]
    assert t["image_marker"] == "<start_of_image>" and t["image_token"] == "<image_soft_token>"
    assert t["decoder_inputs"] == {"token_type_ids": "image_tokens"}
    assert kv["layer_types"] == ["sliding_attention", "full_attention"] and kv["sliding_window"] == 8
    names = [i["name"] for i in m["graphs"]["decoder"]["inputs"]]
    assert names[:4] == ["inputs_embeds", "attention_mask", "position_ids", "token_type_ids"]


def test_gemma3_plain_prompt_expands_boi_into_the_soft_token_run(gemma3, pictures):
    ref = _check(gemma3, ["What is shown in this picture?"], [[pictures[0]]])
    tok = gemma3.proc.tokenizer
    pieces = tok.convert_ids_to_tokens(ref["input_ids"][0].tolist())
    start = pieces.index("<start_of_image>")
    assert (
        pieces[start + 1 : start + 5] == ["<image_soft_token>"] * 4 and pieces[start + 5] == "<end_of_image>"
    )
    assert pieces[0] == "<bos>" and pieces.count("<bos>") == 1
    assert len(pieces) > 2 * gemma3.pkg.manifest["kv"]["sliding_window"]  # the window masks something


def test_gemma3_explicit_marker_and_batch(gemma3, pictures):
    _check(
        gemma3,
        [
            "<start_of_turn>user\n<start_of_image>What colour is the large circle here?<end_of_turn>\n<start_of_turn>model\n"
        ],
        [[pictures[1]]],
    )
    _check(gemma3, ["Describe the image in detail.", "What is in the image?"], [[pictures[2]], [pictures[3]]])


def test_gemma3_token_type_ids_change_the_reference(gemma3, pictures):
    """The bidirectional image mask is not a no-op on this model, so parity above exercises it."""
    ref = gemma3.reference(["What is shown in this picture?"], [[pictures[0]]])
    with torch.no_grad():
        with_types = gemma3.model(**ref).logits[:, -1]
        feeds = {k: v for k, v in ref.items() if k != "token_type_ids"}
        without = gemma3.model(**feeds).logits[:, -1]
    assert float((with_types - without).abs().max()) > 1e-3


@pytest.mark.parametrize("fam_name", ["llava_next", "gemma3"])
def test_verify_passes_from_raw_inputs(fam_name, request, pictures):
    fam = request.getfixturevalue(fam_name)
    res = verify.verify(
        fam.pkg,
        max_new_tokens=4,
        prompts=["What is in the image?", "Describe the image."],
        images=[[pictures[0]], [pictures[1]]],
    )
    assert res.passed, res
    assert res.inputs["checked"] and res.inputs["ids_equal"] and res.inputs["pixel_max_abs_diff"] <= 1e-5
    assert res.inputs.get("image_sizes_equal", True)


# ---- backends and torch-free runtime -------------------------------------------------------------


@pytest.mark.parametrize("fam_name", ["llava_next", "gemma3"])
def test_ascend_compile_takes_the_new_inputs(fam_name, request, tmp_path):
    import shlex

    from vlmc.backends.ascend import atc

    fam = request.getfixturevalue(fam_name)
    out = tmp_path / "build"
    res = CliRunner().invoke(main, ["compile", str(fam.pkg_dir), "--soc", "Ascend910B4", "-o", str(out)])
    assert res.exit_code == 0, res.output
    builds = {b["name"]: b for b in json.loads((out / "compile.json").read_text())["builds"]}
    shapes = {}
    for name, b in builds.items():
        opts = atc.parse_argv(shlex.split((out / b["workdir"] / "atc.cmd").read_text().split("\n")[0]))
        assert atc.problems(opts, quantized=b["quantized"], sequence=opts.get("input_format") == "ND") == []
        shapes[name] = dict(atc.parse_input_shape(opts["input_shape"]))
    if fam_name == "gemma3":
        assert "token_type_ids" in shapes["decoder_prefill"] and "token_type_ids" in shapes["decoder_decode"]
    else:
        assert {"pixel_values", "image_feature_index", "image_feature_weight"} <= set(
            shapes["vision_encoder"]
        )


def test_anyres_run_needs_neither_transformers_nor_torch(onevision, pictures):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['torch'] = None\n"
        "from vlmc.package import Package; from vlmc.runtime import Pipeline\n"
        f"r = Pipeline(Package.load({str(onevision.pkg_dir)!r})).generate(['What is it?'], [[{pictures[0]!r}]], 2)\n"
        "print(r.tokens)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.strip().splitlines()[-1])[0]) == 2
