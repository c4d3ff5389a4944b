"""Qwen-VL (native rebuild of Qwen-VL-Chat's remote code): tokenizer conversion against tiktoken, the chatml
prompt layout with numbered pictures, 448² bicubic + CLIP preprocessing, and a hub-directory copy exported and run.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from _qwen_vl_hub import ranks_file, train_ranks, write_hub_copy
from PIL import Image

from vlmc import exporters
from vlmc.errors import VlmcError
from vlmc.exporters import qwen_vl, qwen_vl_tokenizer
from vlmc.package import Package
from vlmc.runtime import Pipeline, preprocess

TEXTS = [
    "Hello world! 12345 你好，世界。",
    "<|im_start|>user\nPicture 1: <img></img>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\n\n\nnewlines\t tabs   trailing   ",
    "I'M sure WE'LL see they've said it's 2024-06-01.",
    "cafe\u0301 caf\u00e9 \u212b 🤖🙂 ﬁ",  # NFC composes e + combining acute and the angstrom sign
    "<imgpad><imgpad></img><ref>x</ref><box>(1,2),(3,4)</box><|extra_7|><|endoftext|>",
    "    indented = [1, 2, 3]\r\n\tdone!!!??",
    "",
]


@pytest.fixture(scope="module")
def ranks():
    return train_ranks()


def test_converted_tokenizer_equals_tiktoken(ranks):
    tiktoken = pytest.importorskip("tiktoken")
    specials = qwen_vl_tokenizer.special_ids(len(ranks))
    # tokenization_qwen.QWenTokenizer: tiktoken.Encoding("Qwen", PAT_STR, ranks, specials) on the NFC text
    enc = tiktoken.Encoding(
        "Qwen", pat_str=qwen_vl_tokenizer.PAT_STR, mergeable_ranks=ranks, special_tokens=specials
    )
    tok = qwen_vl_tokenizer.convert(qwen_vl_tokenizer.read_ranks(ranks_file(ranks)))
    for text in TEXTS:
        want = enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        assert tok.encode(text).ids == want, text
        assert tok.decode(want, skip_special_tokens=False) == enc.decode(want)
    assert len(specials) == 217
    assert specials["<img>"] == len(ranks) + 214 and specials["<imgpad>"] == len(ranks) + 216


def test_rank_file_damage_is_one_line(ranks):
    data = ranks_file(ranks)
    with pytest.raises(VlmcError, match="line 2 is not"):
        qwen_vl_tokenizer.read_ranks(data.replace(b"\n", b"\n!!! x\n", 1))
    dropped = b"".join(line + b"\n" for line in data.splitlines()[1:])
    with pytest.raises(VlmcError, match="ranks are not 0"):
        qwen_vl_tokenizer.read_ranks(dropped)


@pytest.fixture(scope="module")
def hub_copy(tmp_path_factory):
    return write_hub_copy(tmp_path_factory.mktemp("qwen_vl_hub") / "Qwen-VL-Chat")


@pytest.fixture(scope="module")
def hub_package(hub_copy, tmp_path_factory):
    source = exporters.load_source(str(hub_copy), trust_remote_code=True)
    out = tmp_path_factory.mktemp("qwen_vl_pkg") / "pkg"
    exporters.export(source).save(out)
    return Package.load(out), source


def _make_context_ids(ranks, query: str, image_refs: list[str]) -> list[int]:
    """qwen_generation_utils.make_context (chatml, no history) over QWenTokenizer.tokenize's image spans, written
    with tiktoken here as the remote code does: the picture's reference text goes inside <img>...</img> as bytes,
    padded with <imgpad> to 256."""
    tiktoken = pytest.importorskip("tiktoken")
    sp = qwen_vl_tokenizer.special_ids(len(ranks))
    enc = tiktoken.Encoding(
        "Qwen", pat_str=qwen_vl_tokenizer.PAT_STR, mergeable_ranks=ranks, special_tokens=sp
    )
    image_st = {"<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>", "<img>", "</img>", "<imgpad>"}

    def encode(text):
        ids = enc.encode(unicodedata.normalize("NFC", text), allowed_special=image_st, disallowed_special=())
        out, i = [], 0
        while i < len(ids):
            if ids[i] == sp["<img>"]:
                end = ids.index(sp["</img>"], i)
                url = b"".join(enc.decode_single_token_bytes(t) for t in ids[i + 1 : end])
                span = list(url) + [sp["<imgpad>"]] * (256 - len(url))
                out += [sp["<img>"]] + span + [sp["</img>"]]
                i = end + 1
            else:
                out.append(ids[i])
                i += 1
        return out

    # tokenization_qwen.from_list_format: "Picture N: <img>ref</img>\n" per picture, then the text
    listed = "".join(f"Picture {n + 1}: <img>{ref}</img>\n" for n, ref in enumerate(image_refs)) + query
    nl = encode("\n")

    def turn(role, content):
        return [sp["<|im_start|>"]] + encode(role) + nl + encode(content) + [sp["<|im_end|>"]]

    return (
        turn("system", "You are a helpful assistant.")
        + nl
        + turn("user", listed)
        + nl
        + [sp["<|im_start|>"]]
        + encode("assistant")
        + nl
    )


def _check_same_but_image_rows(got: list[int], want: list[int], pad: int, img_start: int):
    assert len(got) == len(want)
    starts = [i for i, t in enumerate(want) if t == img_start]
    image_rows = {i + 1 + k for i in starts for k in range(256)}
    assert {i for i, t in enumerate(got) if t == pad} == image_rows
    assert [t for i, t in enumerate(got) if i not in image_rows] == [
        t for i, t in enumerate(want) if i not in image_rows
    ]


def test_hub_copy_prompt_layout_is_make_context(hub_package, ranks):
    pkg, source = hub_package
    v, t = pkg.manifest["vision"], pkg.manifest["text"]
    assert pkg.manifest["model"]["family"] == "qwen_vl" and t["tokenizer"] == "source"
    sp = qwen_vl_tokenizer.special_ids(len(ranks))
    assert v["image_token_id"] == sp["<imgpad>"] == source.config.visual["image_start_id"] + 2
    assert t["eos_token_id"] == [sp["<|endoftext|>"], sp["<|im_end|>"], sp["<|im_start|>"]]
    pipe = Pipeline(pkg)
    for n_images in (1, 2):
        query = "What is in the picture?"
        inp = pipe.prepare([query], [["demo:0"] * n_images])
        got = inp.input_ids[0].tolist()
        want = _make_context_ids(ranks, query, [f"img{n}.png" for n in range(n_images)])
        _check_same_but_image_rows(got, want, sp["<imgpad>"], sp["<img>"])


def test_path_in_prompt_is_never_loaded(hub_package, tmp_path):
    pkg, _ = hub_package
    pipe = Pipeline(pkg)
    planted = tmp_path / "planted.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(planted)
    # the picture comes from the images given, whatever path the text names: the text is only tokenized
    inp = pipe.prepare([f"<img>{planted}</img> what is this?"], [["demo:0"]])
    assert int((inp.input_ids == pkg.manifest["vision"]["image_token_id"]).sum()) == 256
    assert np.array_equal(
        inp.vision["pixel_values"],
        preprocess.preprocess(["demo:0"], pkg.manifest["vision"]["preprocess"])["pixel_values"],
    )


def test_preprocess_is_448_bicubic_with_clip_stats():
    # visual.py: transforms.Resize((448, 448), BICUBIC) on the PIL image, ToTensor (/255), Normalize(CLIP)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (300, 517, 3), dtype=np.uint8)
    facts = qwen_vl.preprocess_facts(qwen_vl.tiny_qwen_vl_config())
    got = preprocess.preprocess([raw], facts)["pixel_values"]
    resized = np.asarray(Image.fromarray(raw).resize((448, 448), Image.BICUBIC), np.float32) / 255.0
    mean = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
    std = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
    want = ((resized - mean) / std).transpose(2, 0, 1)[None]
    assert got.shape == (1, 3, 448, 448)
    assert float(np.abs(got - want).max()) < 1e-5


def test_hub_copy_loads_into_the_native_model(hub_copy, hub_package):
    from safetensors.torch import load_file

    _, source = hub_package
    model = source.model
    hub = load_file(str(hub_copy / "model.safetensors"))
    # the split q/k/v rows are c_attn's, in order; QWenMLP's w2 is the gated (silu) branch
    q = model.language_model.model.layers[1].self_attn
    c_attn = hub["transformer.h.1.attn.c_attn.weight"]
    assert torch.equal(torch.cat([q.q_proj.weight, q.k_proj.weight, q.v_proj.weight]), c_attn)
    assert torch.equal(
        model.language_model.model.layers[0].mlp.gate_proj.weight, hub["transformer.h.0.mlp.w2.weight"]
    )
    assert torch.equal(model.visual.proj, hub["transformer.visual.proj"])


def test_hub_copy_runs_like_the_native_model(hub_package):
    pkg, source = hub_package
    pipe = Pipeline(pkg)
    inp = pipe.prepare(["Describe the image."], [["demo:1"]])
    got = pipe.generate_from(inp, 6)
    feeds = {
        k: torch.from_numpy(v)
        for k, v in {"input_ids": inp.input_ids, "attention_mask": inp.attention_mask, **inp.vision}.items()
    }
    want = source.model.generate(**feeds, max_new_tokens=6, eos_token_id=pkg.manifest["text"]["eos_token_id"])
    want = want[0, inp.input_ids.shape[1] :].tolist()
    assert list(got.tokens[0]) == want


def test_long_context_is_refused_in_one_line(hub_package):
    pkg, _ = hub_package
    assert pkg.manifest["text"]["max_positions"] == 2048  # seq_length: dynamic NTK and logn start past it
    with pytest.raises(VlmcError, match="longer than the model's context of 2048"):
        Pipeline(pkg).prepare(["word " * 2100], [["demo:0"]])
    # nor does generation run past it: logn attention scales every query past position 2048, decode steps too
    pipe = Pipeline(pkg)
    inp = pipe.prepare(["Describe the image."], [["demo:0"]])
    n = inp.input_ids.shape[1]
    with pytest.raises(
        VlmcError, match=f"exceed the model's context of 2048 tokens; give at most {2048 - n}"
    ):
        pipe.generate_from(inp, 2048 - n + 1)


def test_unsupported_configs_are_refused(tmp_path):
    with pytest.raises(VlmcError, match="partial rotary"):
        qwen_vl.check_supported(qwen_vl.tiny_qwen_vl_config(rotary_pct=0.5), "x")
    cfg = qwen_vl.tiny_qwen_vl_config()
    del cfg.visual["image_start_id"]
    with pytest.raises(VlmcError, match="text only"):
        qwen_vl.check_supported(cfg, "x")


def test_verify_against_the_remote_layout_ignores_only_image_rows(hub_package):
    from vlmc import verify

    pkg, source = hub_package
    res = verify.verify(pkg, max_new_tokens=4, prompts=["What is this?"], images=[["demo:0"]])
    # the reference writes "image 1" as bytes into the picture's rows: only those ids may differ
    assert res.inputs["ids_equal"] is True and res.inputs["passed"] is True
    assert res.passed and res.token_agreement == 1.0
    ref = qwen_vl.reference_inputs(
        source.directory, pkg.manifest, ["What is this?"], [[Image.new("RGB", (9, 9))]]
    )
    inp = Pipeline(pkg).prepare(["What is this?"], [[np.zeros((9, 9, 3), np.uint8)]])
    pad = pkg.manifest["vision"]["image_token_id"]
    assert int((ref["input_ids"] == pad).sum()) < 256  # path bytes took some rows
    assert verify.compare_inputs(inp, ref, pad)["ids_equal"]
    assert not verify.compare_inputs(inp, ref)["ids_equal"]
    ref["input_ids"][0, 3] += 1  # a text row: still compared
    assert "position 3" in verify.compare_inputs(inp, ref, pad)["first_difference"]


def test_tiny_builtin_verifies(exported):
    from vlmc import verify

    pkg = Package.load(exported("tiny-qwen-vl"))
    assert pkg.manifest["vision"]["tokens_per_image"] == 256 and pkg.manifest["text"]["max_positions"] == 2048
    res = verify.verify(pkg, max_new_tokens=4, prompts=["Describe the image."], images=[["demo:0"]])
    assert res.passed and res.token_agreement == 1.0


@pytest.fixture(scope="module")
def deployment_build(tmp_path_factory):
    from click.testing import CliRunner

    from vlmc.cli import main

    out = tmp_path_factory.mktemp("qwen_vl_910b") / "build"
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen-vl-chat-910b.yaml"
    res = CliRunner().invoke(main, ["-q", "build", "-r", str(recipe), "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_deployment_recipe_quant_kernels_differ_from_the_package_only_by_fp16_rounding(deployment_build):
    """The build's AscendQuant is the package's QuantizeLinear, computed the way the 910B computes it (fp16):
    on the very inputs the package's quantizers see, the fp32 form of the kernel gives the package's int8 values
    (ties of x*(1/s) against x/s aside), the fp16 form moves about 1% of them by one step. That rounding, not a
    lowering difference, is what the build's tokens diverge by (docs/families.md, Qwen-VL)."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from vlmc import samples
    from vlmc.runtime.executors import reference

    pkg = Package.load(deployment_build / "package")
    model = onnx.load(str(pkg.path_of("vlm")))
    inits = {t.name: t for t in model.graph.initializer}
    quant = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[1] in inits]
    assert len(quant) >= 10  # the vision side's activations (INT8 static)
    names = [x for n in quant for x in (n.input[0], n.output[0])]
    del model.graph.output[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=x) for x in names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = samples.load(pkg, "vlm")
    values = dict(zip(names, session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))
    flipped = {True: 0, False: 0}
    total = 0
    for n in quant:
        x, want = values[n.input[0]], values[n.output[0]].astype(np.int64)
        scale = float(numpy_helper.to_array(inits[n.input[1]]))
        zero = float(numpy_helper.to_array(inits[n.input[2]])) if len(n.input) > 2 else 0.0
        total += want.size
        for fp16 in (True, False):
            got = reference.ascend_quant(x, np.float32(1.0 / scale), zero, fp16).astype(np.int64)
            assert int(np.abs(got - want).max()) <= 1, n.name
            flipped[fp16] += int((got != want).sum())
    assert flipped[False] <= 1e-5 * total
    assert 1e-3 * total < flipped[True] < 3e-2 * total


def test_deployment_recipe_runs_on_the_reference_executor(deployment_build):
    from vlmc.runtime.executors import build as build_exec

    pkg = Package.load(deployment_build / "package")
    want = Pipeline(pkg).generate(["What is in the picture?"], [["demo:0"]], max_new_tokens=6)
    target = build_exec.open_build(deployment_build / "build", "reference")
    pipe = Pipeline(target[0], executor=target[1])
    try:
        got = pipe.generate(["What is in the picture?"], [["demo:0"]], max_new_tokens=6)
    finally:
        pipe.close()
    a = build_exec.agreement(want, got)
    # the first token and the prefill logits' top-1 agree; the rounding of the INT8 vision's fp16 quantizers moves
    # the logits by cosine < 1e-3 (later tokens of this random-weight model then part at near ties)
    assert got.tokens[0][0] == want.tokens[0][0] and a["prefill_top1"] == 1.0
    assert a["prefill_logits_cosine"] > 0.999


def test_hub_download_fetches_every_file_the_family_reads(hub_copy, tmp_path, monkeypatch):
    """`vlmc export Qwen/Qwen-VL-Chat`: snapshot_download's patterns take qwen.tiktoken (the tokenizer) and the
    json/safetensors files, never the repository's Python. (No network here: the download is the hub copy's files
    the patterns select, copied into a directory as the hub cache holds them.)"""
    import fnmatch
    import shutil

    import huggingface_hub

    asked = {}

    def download(repo_id, revision=None, allow_patterns=None, **_):
        asked["patterns"] = list(allow_patterns)
        out = tmp_path / "snapshot"
        out.mkdir()
        for f in hub_copy.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, out / f.name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    source = exporters.load_source("Qwen/Qwen-VL-Chat", trust_remote_code=True)
    assert source.family == "qwen_vl" and source.name == "Qwen/Qwen-VL-Chat"
    assert "*.tiktoken" in asked["patterns"] and not any(
        fnmatch.fnmatch("modeling_qwen.py", p) for p in asked["patterns"]
    )
    assert (source.directory / "qwen.tiktoken").is_file()
    pkg = exporters.export(source)
    assert pkg.manifest["text"]["tokenizer"] == "source"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("drop", "the checkpoint has no weights for transformer.h.1.attn.c_attn.weight (1 missing)"),
        ("int16", "weight transformer.ln_f.weight is I16, not a float"),
        ("narrow", "weight transformer.h.0.attn.c_attn.bias has shape [96], the config implies [768]"),
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_damaged_checkpoints_are_refused_in_one_line(hub_copy, tmp_path, damage, message, streamed):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "copy"
    if streamed:  # deep enough that `vlmc export` cuts it (qwen_vl.load_reduced checks the same map)
        write_hub_copy(src, layers=3, vision_layers=3)
    else:
        shutil.copytree(hub_copy, src)
    state = load_file(str(src / "model.safetensors"))
    if damage == "drop":
        del state["transformer.h.1.attn.c_attn.weight"]
    elif damage == "int16":
        state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"].to(torch.int16)
    else:
        state["transformer.h.0.attn.c_attn.bias"] = state["transformer.h.0.attn.c_attn.bias"][:96].clone()
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(VlmcError, match=re.escape(message)):
        exporters.load_source(str(src), lazy=streamed)
