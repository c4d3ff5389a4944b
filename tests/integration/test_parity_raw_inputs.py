"""Parity from raw inputs with real-format tokenizers: runtime ids == processor ids, `vlmc run` == generate.

Each family's directory is a random-weight model saved beside a tokenizer trained offline with `tokenizers`
(Llama SentencePiece BPE, Qwen2 byte-level BPE with Qwen2-VL's specials, GPT-2/OPT byte-level BPE) and the
family's processor files. The transformers side here is written with transformers calls only (processor,
apply_chat_template, generate); nothing from vlmc's runtime prepares its inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _real_tokenizers
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from vlmc import exporters, pass_api, verify
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.exporters import processor
from vlmc.package import Package
from vlmc.runtime import Pipeline

TOKENS = 6


class Family:
    """A saved source directory, its exported package and the transformers side built from raw inputs."""

    def __init__(self, root: Path, build) -> None:
        self.src = build(root / "src")
        self.pkg_dir = root / "pkg"
        exporters.export(exporters.load_source(str(self.src))).save(self.pkg_dir)
        self.pkg = Package.load(self.pkg_dir)
        self.proc = processor.load(self.src)
        self.model = exporters.load_source(str(self.src)).model
        self.marker = self.pkg.manifest["text"]["image_marker"]

    def reference(self, prompts: list[str], images: list[list[str]]):
        """The processor's model inputs for raw prompts and image files, as a transformers user writes."""
        self.proc.tokenizer.padding_side = "left"
        if all(self.marker not in p for p in prompts) and self.proc.chat_template is not None:
            convs = [
                [
                    {
                        "role": "user",
                        "content": [{"type": "image", "path": f} for f in per]
                        + [{"type": "text", "text": p}],
                    }
                ]
                for p, per in zip(prompts, images)
            ]
            return self.proc.apply_chat_template(
                convs,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                processor_kwargs={"padding": True},
            )
        from PIL import Image

        flat = [Image.open(f).convert("RGB") for per in images for f in per]
        return self.proc(images=flat, text=prompts, padding=True, return_tensors="pt")

    def generate(self, feeds) -> list[list[int]]:
        eos = self.pkg.manifest["text"]["eos_token_id"]
        with torch.no_grad():
            out = self.model.generate(
                **feeds,
                max_new_tokens=TOKENS,
                do_sample=False,
                num_beams=1,
                pad_token_id=self.proc.tokenizer.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        # Logits with spread: greedy picks are never near-ties, so a one-token shift in the prompt shows
        # in the tokens (ids are also compared directly).
        first = out.logits[0].float()
        top2 = first.topk(2, dim=-1).values
        assert float(first.std(dim=-1).min()) > 0.3 and float((top2[:, 0] - top2[:, 1]).min()) > 1e-3
        rows = []
        for row in out.sequences[:, feeds["input_ids"].shape[1] :].tolist():
            seq = []
            for t in row:
                seq.append(t)
                if t == eos:
                    break
            rows.append(seq)
        return rows


def _ids(input_ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    return [row[m == 1].tolist() for row, m in zip(np.asarray(input_ids), np.asarray(mask))]


def _vlmc_run(pkg_dir: Path, prompts: list[str], images: list[list[str]]) -> list[list[int]]:
    args = ["run", str(pkg_dir), "--json", "--max-new-tokens", str(TOKENS)]
    for p in prompts:
        args += ["--prompt", p]
    for f in (f for per in images for f in per):
        args += ["--image", f]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])["tokens"]


def _check(fam: Family, prompts: list[str], images: list[list[str]], ref_prompts: list[str] | None = None):
    """Runtime ids, pixels and grids equal the processor's; `vlmc run` tokens equal transformers generate."""
    ref = fam.reference(ref_prompts or prompts, images)
    inp = Pipeline(fam.pkg).prepare(prompts, images)
    assert _ids(inp.input_ids, inp.attention_mask) == _ids(ref["input_ids"], ref["attention_mask"])
    np.testing.assert_allclose(inp.vision["pixel_values"], ref["pixel_values"].numpy(), rtol=0, atol=1e-5)
    if "image_grid_thw" in ref:
        np.testing.assert_array_equal(inp.vision["image_grid_thw"], ref["image_grid_thw"].numpy())
    want = fam.generate(ref)
    assert _vlmc_run(fam.pkg_dir, prompts, images) == want
    return ref


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures")
    return [
        _real_tokenizers.save_image(root / f"{i}.png", h, w, i)
        for i, (h, w) in enumerate([(120, 90), (64, 160), (96, 96)])
    ]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("llava"), _real_tokenizers.llava_dir)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("qwen2_vl"), _real_tokenizers.qwen2_vl_dir)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return Family(
        tmp_path_factory.mktemp("qwen2_5_vl"), lambda p: _real_tokenizers.qwen2_vl_dir(p, qwen25=True)
    )


@pytest.fixture(scope="module")
def blip2(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("blip2"), _real_tokenizers.blip2_dir)


# ---- LLaVA -----------------------------------------------------------------------------------


def test_llava_package_carries_the_processor_tokenizer_and_template(llava):
    t = llava.pkg.manifest["text"]
    assert t["tokenizer"] == "source" and (llava.pkg_dir / t["tokenizer_file"]).is_file()
    assert (llava.pkg_dir / t["chat_template"]).read_text() == _real_tokenizers.LLAVA_CHAT_TEMPLATE
    assert t["special_tokens"]["bos_token"] == "<s>" and t["image_marker"] == "<image>"


def test_llava_plain_prompt_goes_through_the_chat_template(llava, pictures):
    ref = _check(llava, ["What is shown in this picture?"], [[pictures[0]]])
    ids = ref["input_ids"][0].tolist()
    image_id = llava.pkg.manifest["vision"]["image_token_id"]
    last = max(i for i, x in enumerate(ids) if x == image_id)
    # llava-1.5's tokenizer: BOS first, and a lone '▁' between the image run and the newline (29871 there)
    assert ids[0] == llava.proc.tokenizer.bos_token_id
    assert llava.proc.tokenizer.convert_ids_to_tokens(ids[last + 1 : last + 3]) == ["▁", "<0x0A>"]


def test_llava_prompt_with_an_explicit_marker(llava, pictures):
    _check(llava, ["USER: <image>\nWhat colour is the large circle here? ASSISTANT:"], [[pictures[1]]])


def test_llava_batch_of_two_prompts(llava, pictures):
    _check(
        llava,
        ["Describe the image in detail.", "What colour is the large circle here?"],
        [[pictures[0]], [pictures[2]]],
    )


def test_runtime_tokenizes_like_the_processor_not_like_the_tokenizer_class(llava, tmp_path, pictures):
    """The issue's case: llava-1.5's tokenizer.json prepends '▁' after every special token, its
    tokenizer_config says legacy: false. The processor (model directory) runs the file as it is; the
    LlamaTokenizer class, which AutoTokenizer picks for the same files without config.json (what vlmc
    used to load from the package's source/), rebuilds the pipeline from the flag and drops that '▁'."""
    from transformers import AutoTokenizer

    bare = tmp_path / "tokenizer_only"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((llava.src / name).read_bytes())
    prompt, images = ["What is shown in this picture?"], [[pictures[0]]]
    ref = llava.reference(prompt, images)
    want = _ids(ref["input_ids"], ref["attention_mask"])[0]
    text = llava.proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt[0]}]}],
        add_generation_prompt=True,
    )
    n = llava.pkg.manifest["vision"]["tokens_per_image"]
    by_class = AutoTokenizer.from_pretrained(bare)(text.replace("<image>", "<image>" * n))["input_ids"]
    assert type(AutoTokenizer.from_pretrained(bare)).__name__ == "LlamaTokenizer"
    last = max(i for i, x in enumerate(want) if x == llava.pkg.manifest["vision"]["image_token_id"])
    lone, newline = llava.proc.tokenizer.convert_tokens_to_ids(["▁", "<0x0A>"])
    assert want[last + 1 : last + 3] == [lone, newline] and by_class[last + 1] == newline
    inp = Pipeline(llava.pkg).prepare(prompt, images)
    assert _ids(inp.input_ids, inp.attention_mask)[0] == want


@pytest.mark.parametrize("legacy", [True, False])
def test_metaspace_format_follows_the_legacy_prepend_scheme(tmp_path, pictures, legacy):
    fam = Family(
        tmp_path,
        lambda p: _real_tokenizers.llava_dir(p, legacy=legacy, metaspace="always" if legacy else "first"),
    )
    prompt, images = ["What is shown in this picture?"], [[pictures[0]]]
    want = _ids(*(fam.reference(prompt, images)[k] for k in ("input_ids", "attention_mask")))
    inp = Pipeline(fam.pkg).prepare(prompt, images)
    assert _ids(inp.input_ids, inp.attention_mask) == want
    last = max(i for i, x in enumerate(want[0]) if x == fam.pkg.manifest["vision"]["image_token_id"])
    lone = fam.proc.tokenizer.convert_tokens_to_ids("▁")
    assert (want[0][last + 1] == lone) == legacy  # '▁' after the image run only with prepend_scheme always


def test_verify_reports_identical_inputs_on_a_real_tokenizer(llava, pictures):
    res = verify.verify(
        llava.pkg, max_new_tokens=TOKENS, prompts=["What is in the image?"], images=[[pictures[2]]]
    )
    assert res.passed, res
    assert res.inputs["checked"] and res.inputs["ids_equal"] and res.inputs["processor"] == "LlavaProcessor"
    assert res.inputs["pixel_max_abs_diff"] <= 1e-5


def test_verify_fails_on_a_corrupted_chat_template_and_names_the_position(llava, tmp_path, pictures):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llava.pkg_dir, bad)
    template = bad / llava.pkg.manifest["text"]["chat_template"]
    template.write_text(template.read_text().replace("<image>\n", "<image> "))
    args = ["verify", str(bad), "--image", pictures[0], "--prompt", "What is shown in this picture?"]
    res = CliRunner().invoke(main, [*args, "--max-new-tokens", "2"])
    assert res.exit_code == 1, res.output
    ref_ids = llava.reference(["What is shown in this picture?"], [[pictures[0]]])["input_ids"][0].tolist()
    got = Pipeline(Package.load(bad)).prepare(["What is shown in this picture?"], [[pictures[0]]])
    got_ids = got.input_ids[0].tolist()
    pos = next(i for i, (a, b) in enumerate(zip(ref_ids, got_ids)) if a != b)
    line = f"token ids differ at position {pos}: processor {ref_ids[pos]}, vlmc {got_ids[pos]}"
    assert line in " ".join(res.output.split())
    report = json.loads((bad / "verify.json").read_text())
    assert report["passed"] is False and report["inputs"]["first_difference"] == line


def test_run_needs_neither_transformers_nor_torch(llava, pictures):
    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['torch'] = None\n"
        "from vlmc.package import Package; from vlmc.runtime import Pipeline\n"
        f"r = Pipeline(Package.load({str(llava.pkg_dir)!r})).generate(['What is it?'], [[{pictures[0]!r}]], 2)\n"
        "print(r.tokens)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.strip().splitlines()[-1])[0]) == 2


# ---- Qwen2-VL / Qwen2.5-VL ---------------------------------------------------------------------


def test_qwen2_vl_plain_prompt(qwen2_vl, pictures):
    ref = _check(qwen2_vl, ["What is in the image?"], [[pictures[0]]])
    tok = qwen2_vl.proc.tokenizer
    pieces = tok.convert_ids_to_tokens(ref["input_ids"][0].tolist())
    start = pieces.index("<|vision_start|>")
    n = int(np.prod(ref["image_grid_thw"][0].tolist())) // 4
    assert (
        pieces[start + 1 : start + 1 + n] == ["<|image_pad|>"] * n
        and pieces[start + 1 + n] == "<|vision_end|>"
    )


def test_qwen2_vl_smart_resize_uses_the_processor_pixel_bounds(qwen2_vl, tmp_path):
    big, small = (
        _real_tokenizers.save_image(tmp_path / "big.png", 240, 180, 8),
        _real_tokenizers.save_image(tmp_path / "small.png", 20, 24, 9),
    )
    ref = _check(qwen2_vl, ["Compare the two pictures."], [[big, small]])
    facts = qwen2_vl.pkg.manifest["vision"]["preprocess"]
    assert (facts["min_pixels"], facts["max_pixels"]) == (8 * 16 * 16, 64 * 16 * 16)  # not Qwen's defaults
    pixels = ref["image_grid_thw"].numpy().prod(-1) * 8 * 8  # patches of 8x8 px after the resize
    assert pixels[0] <= facts["max_pixels"] < 240 * 180 and pixels[1] >= facts["min_pixels"] > 20 * 24


def test_qwen2_vl_explicit_marker_and_batch(qwen2_vl, pictures):
    _check(qwen2_vl, ["<|vision_start|><|image_pad|><|vision_end|>Describe the image."], [[pictures[1]]])
    _check(qwen2_vl, ["What is in the image?", "Compare the two pictures."], [[pictures[1]], [pictures[2]]])


def test_qwen2_5_vl_two_images_of_different_sizes(qwen2_5_vl, pictures):
    ref = _check(qwen2_5_vl, ["Compare the two pictures."], [[pictures[0], pictures[1]]])
    grids = ref["image_grid_thw"].numpy()
    assert len(grids) == 2 and not np.array_equal(grids[0], grids[1])
    wrap = "<|vision_start|><|image_pad|><|vision_end|>"
    _check(qwen2_5_vl, [f"Compare {wrap} with {wrap}."], [[pictures[1], pictures[2]]])
    _check(qwen2_5_vl, ["What is in the image?", "Describe the image."], [[pictures[2]], [pictures[0]]])


# ---- BLIP-2 ----------------------------------------------------------------------------------


def test_blip2_query_tokens_lead_then_bos_and_text(blip2, pictures):
    ref = _check(blip2, ["Question: how many shapes are there? Answer:"], [[pictures[0]]])
    ids = ref["input_ids"][0].tolist()
    n = blip2.pkg.manifest["vision"]["num_query_tokens"]
    assert ids[:n] == [blip2.pkg.manifest["vision"]["image_token_id"]] * n
    assert ids[n] == blip2.proc.tokenizer.bos_token_id


def test_blip2_marker_and_batch(blip2, pictures):
    # BLIP-2's processor always puts the queries first; a marker in the prompt only says an image is there.
    _check(
        blip2, ["<image>Question: what is it? Answer:"], [[pictures[1]]], ["Question: what is it? Answer:"]
    )
    _check(
        blip2, ["Question: what colour is it? Answer:", "Describe the image."], [[pictures[1]], [pictures[2]]]
    )


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "blip2"])
def test_verify_checks_inputs_against_each_family_processor(family, request, pictures):
    fam = request.getfixturevalue(family)
    prompts = [f"{fam.marker}What is in the image?", "Describe the image."]
    res = verify.verify(fam.pkg, max_new_tokens=3, prompts=prompts, images=[[pictures[0]], [pictures[1]]])
    assert res.passed, res
    assert res.inputs["checked"] and res.inputs["ids_equal"] and res.inputs["pixel_max_abs_diff"] <= 1e-5
    assert res.inputs.get("image_grid_thw_equal", True)


def test_verify_catches_the_tokenizer_an_older_vlmc_package_runs(llava, tmp_path, pictures, caplog):
    """A package from before text.tokenizer_file loads source/ with AutoTokenizer (no config.json there):
    on llava-1.5's files that drops the '▁' after the image run. verify used to pass it (it fed vlmc's own
    ids to transformers); now it fails and names the position."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(llava.pkg_dir, old)
    m = json.loads((old / "vlmc.json").read_text())
    for key in ("tokenizer_file", "chat_template", "special_tokens"):
        del m["text"][key]
    (old / "vlmc.json").write_text(json.dumps(m))
    prompt, images = ["USER: <image>\nWhat is it? ASSISTANT:"], [[pictures[0]]]
    res = verify.verify(Package.load(old), max_new_tokens=2, prompts=prompt, images=images)
    assert "exported by an older vlmc" in caplog.text
    assert not res.passed and not res.inputs["ids_equal"]
    ref = _ids(*(llava.reference(prompt, images)[k] for k in ("input_ids", "attention_mask")))[0]
    got = _ids(
        *(lambda i: (i.input_ids, i.attention_mask))(Pipeline(Package.load(old)).prepare(prompt, images))
    )[0]
    pos = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    assert (
        res.inputs["first_difference"]
        == f"token ids differ at position {pos}: processor {ref[pos]}, vlmc {got[pos]}"
    )
    assert got[pos] == llava.proc.tokenizer.convert_tokens_to_ids("<0x0A>")


def test_image_processor_settings_come_from_the_saved_processor(llava, blip2):
    # transformers 5 saves LlavaProcessor's and Blip2Processor's image processor inside processor_config.json
    for fam in (llava, blip2):
        assert not (fam.src / "preprocessor_config.json").exists()
        facts = fam.pkg.manifest["vision"]["preprocess"]
        assert facts["mean"] != [0.48145466, 0.4578275, 0.40821073] and facts["resample"] == "bilinear"
    assert llava.pkg.manifest["vision"]["preprocess"]["resize_shortest_edge"] == 72


# ---- configs whose EOS transformers never emits (issue 31) -------------------------------------------


_NO_EOS = {
    # LLaVA whose text config is Qwen2 with no eos_token_id (Qwen2Config's default, None)
    "llava_qwen2_no_eos": lambda p: _real_tokenizers.llava_dir(p, qwen2_text=True),
    # Qwen2-VL / Qwen2.5-VL with the class's eos 151645 (and bos 151643) past a 434-token vocabulary
    "qwen2_vl_class_eos": lambda p: _real_tokenizers.qwen2_vl_dir(p, class_eos=True),
    "qwen2_5_vl_class_eos": lambda p: _real_tokenizers.qwen2_vl_dir(p, qwen25=True, class_eos=True),
}


@pytest.mark.parametrize("config", sorted(_NO_EOS))
def test_a_model_without_a_usable_eos_exports_runs_exact_and_pages(config, tmp_path, pictures, caplog):
    """transformers loads and generates with these configs; the export keeps eos null (one warning line),
    generation runs to max_new_tokens token-exact from raw inputs, and the paged package matches."""
    with caplog.at_level("WARNING", logger="vlmc.exporters._facts"):
        fam = Family(tmp_path, _NO_EOS[config])
    warned = [r.getMessage() for r in caplog.records if r.name == "vlmc.exporters._facts"]
    assert len(warned) == 1 and "generation stops at max_new_tokens" in warned[0], warned
    assert fam.pkg.manifest["text"]["eos_token_id"] is None
    vocab = fam.pkg.manifest["text"]["vocab_size"]
    assert fam.pkg.manifest["text"]["bos_token_id"] in (None, *range(vocab))
    prompts, images = ["What is in the image?", "Describe the image."], [[pictures[0]], [pictures[2]]]
    _check(fam, prompts, images)
    contiguous = Pipeline(fam.pkg).generate(prompts, images, max_new_tokens=TOKENS)
    assert all(len(row) == TOKENS for row in contiguous.tokens)  # no EOS: every row runs to the limit
    paged = Package.load(fam.pkg_dir)
    pass_api.get("paged_kv")(block_size=16).run(paged)
    assert paged.manifest["kv"]["layout"] == "paged"
    assert Pipeline(paged).generate(prompts, images, max_new_tokens=TOKENS).tokens == contiguous.tokens


def test_the_manifest_still_refuses_an_eos_outside_the_vocabulary(tmp_path, pictures):
    """eos may be null; a present one must be a token id: a tampered package is refused at load."""
    fam = Family(tmp_path, _NO_EOS["qwen2_vl_class_eos"])
    for bad, said in ((151645, "is not a token id of the vocabulary"), ("2", "text.eos_token_id")):
        m = json.loads((fam.pkg_dir / "vlmc.json").read_text())
        m["text"]["eos_token_id"] = bad
        (fam.pkg_dir / "vlmc.json").write_text(json.dumps(m))
        with pytest.raises(VlmcError, match=said):
            Package.load(fam.pkg_dir)
