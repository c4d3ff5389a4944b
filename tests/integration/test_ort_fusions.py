"""`vlmc compile --target ort` fusions on the tiny built-ins: each fusion checked, the interface kept, tokens equal.

FP32 builds must give the package's greedy tokens (the fused kernels compute the same math in another
order); a paged package keeps its pools and block tables (attention stays unfused, the reason recorded).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _export import export_model

from vlmc import backends, manager, pass_api, recipe
from vlmc.backends import ort as ort_backend
from vlmc.backends.ort import fusions
from vlmc.package import Package
from vlmc.runtime import Pipeline

PROMPTS = ["Describe the image.", "What colors do you see?"]
IMAGES = [["demo"], ["demo"]]
OPS = {
    "rms_norm": ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"),
    "rotary": ("RotaryEmbedding",),
    "attention": ("MultiHeadAttention",),
}


def _ops(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _io(pkg: Package, name: str) -> tuple:
    info = pkg.info(name)
    return [(i["name"], i["dtype"]) for i in info["inputs"]], [
        (o["name"], o["dtype"]) for o in info["outputs"]
    ]


def _tokens(path, n: int = 8) -> list:
    pipe = Pipeline(Package.load(path))
    try:
        return pipe.generate(PROMPTS, IMAGES, max_new_tokens=n).tokens
    finally:
        pipe.close()


def test_fp32_build_fuses_norms_rotary_and_attention_with_the_packages_tokens(mha, tmp_path):
    pkg = Package.load(mha)
    layers = pkg.manifest["kv"]["layers"]
    out = tmp_path / "build"
    summary = backends.get("ort").compile(pkg, out, {"backend": "ort"})
    entry = summary["graphs"]["decoder"]
    facts = entry["fusions"]
    assert facts["rms_norm"]["fused"] == 2 * layers + 1  # two per layer and the final norm
    assert (
        facts["rms_norm"]["skip_simplified"] == 2 * layers
    )  # every norm after the first reads a residual Add
    assert facts["rotary"]["fused"] == 2 * layers  # q and k
    assert facts["attention"]["fused"] == layers and facts["attention"]["kept"] == {}
    for kind in OPS:  # each fusion checked against the graph before it, within the float bound
        check = facts[kind]["check"]
        assert check["within_bound"] and check["bound_rms_relative"] == ort_backend.TOLERANCE["float"]
        assert all(o["rms_relative"] <= ort_backend.TOLERANCE["float"] for o in check["outputs"].values())
    # and the whole fused graph against the package's, as written
    assert all(
        o["rms_relative"] <= ort_backend.TOLERANCE["float"] for o in entry["check"]["outputs"].values()
    )
    assert json.loads((out / "compile.json").read_text()) == summary
    build = Package.load(out / "package")
    ops = _ops(build.model("decoder"))
    assert ops["MultiHeadAttention"] == layers and ops["RotaryEmbedding"] == 2 * layers
    assert "Softmax" not in ops and "ReduceMean" not in ops
    assert build.info("decoder")["ort"]["fusions"] == {k: facts[k]["fused"] for k in OPS}
    for name in pkg.graph_names:  # the graph interface stays
        assert _io(build, name) == _io(pkg, name)
    assert "MultiHeadAttention" not in _ops(Package.load(mha).model("decoder"))  # package untouched
    assert _tokens(out / "package") == _tokens(mha)


@pytest.fixture(scope="module")
def mrope_mha(tmp_path_factory) -> Path:
    """tiny-qwen2-vl (M-RoPE) with as many KV heads as query heads (the built-in has 4 over 2)."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from vlmc.exporters import qwen2_vl

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(qwen2_vl.tiny_qwen2_vl_config(num_key_value_heads=4)).eval()
    return export_model(tmp_path_factory, model, "tiny-qwen2-vl-mha", "qwen2_vl")


def test_fewer_kv_heads_keep_their_attention_with_the_reason(tiny_llava, tmp_path):
    pkg = Package.load(tiny_llava)  # 4 query heads over 2 KV heads: repeat_kv in the graph
    out = tmp_path / "build"
    facts = backends.get("ort").compile(pkg, out, {"backend": "ort"})["graphs"]["decoder"]["fusions"]
    layers = pkg.manifest["kv"]["layers"]
    assert facts["attention"]["fused"] == 0 and len(facts["attention"]["kept"]) == layers
    assert all(why == fusions.GROUPED for why in facts["attention"]["kept"].values())
    assert facts["rotary"]["fused"] == 2 * layers and facts["rms_norm"]["fused"] == 2 * layers + 1
    ops = _ops(Package.load(out / "package").model("decoder"))
    assert ops["Softmax"] == layers and "MultiHeadAttention" not in ops
    assert _tokens(out / "package") == _tokens(tiny_llava)


def test_mrope_attention_fuses_with_its_rotary_left_as_it_is(mrope_mha, tmp_path):
    """M-RoPE's cos/sin are gathered per section from [3, batch, seq] positions: RotaryEmbedding does not
    take those, so the rotary stays (skipped, with the reason) and attention reads its output."""
    pkg = Package.load(mrope_mha)
    layers = pkg.manifest["kv"]["layers"]
    out = tmp_path / "build"
    entry = backends.get("ort").compile(pkg, out, {"backend": "ort"})["graphs"]["decoder"]
    facts = entry["fusions"]
    assert facts["rotary"]["fused"] == 0 and "position_ids" in facts["rotary"]["skipped"]
    assert facts["attention"]["fused"] == layers and facts["attention"]["kept"] == {}
    for check in [facts["attention"]["check"], entry["check"]]:
        assert all(o["rms_relative"] <= ort_backend.TOLERANCE["float"] for o in check["outputs"].values())
    build = Package.load(out / "package")
    ops = _ops(build.model("decoder"))
    assert ops["MultiHeadAttention"] == layers and "Softmax" not in ops and "RotaryEmbedding" not in ops
    for name in pkg.graph_names:  # the graph interface stays (position_ids [3, batch, seq] too)
        assert _io(build, name) == _io(pkg, name)
    assert _tokens(out / "package") == _tokens(mrope_mha)


def test_fusion_options_turn_each_off(tiny_llava, tmp_path):
    out = tmp_path / "build"
    summary = backends.get("ort").compile(
        Package.load(tiny_llava), out, {"backend": "ort", "fuse_attention": False, "fuse_rotary": False}
    )
    facts = summary["graphs"]["decoder"]["fusions"]
    assert set(facts) == {"rms_norm"} and facts["rms_norm"]["fused"] > 0
    ops = _ops(Package.load(out / "package").model("decoder"))
    assert "Softmax" in ops and "RotaryEmbedding" not in ops and "SimplifiedLayerNormalization" in ops
    none = backends.get("ort").compile(
        Package.load(tiny_llava),
        tmp_path / "plain",
        {"backend": "ort", "fuse_attention": False, "fuse_rotary": False, "fuse_norms": False},
    )
    assert not any("fusions" in g for g in none["graphs"].values())


def test_paged_package_keeps_its_interface_and_skips_attention(tiny_llava, tmp_path):
    paged = pass_api.get("paged_kv")(block_size=16).run(Package.load(tiny_llava)).package
    src = tmp_path / "paged"
    paged.save(src)
    pkg = Package.load(src)
    out = tmp_path / "build"
    summary = backends.get("ort").compile(pkg, out, {"backend": "ort"})
    facts = summary["graphs"]["decoder"]["fusions"]
    assert "paged KV layout" in facts["attention"]["skipped"]
    assert facts["rms_norm"]["fused"] > 0 and facts["rotary"]["fused"] > 0
    build = Package.load(out / "package")
    assert build.manifest["kv"]["layout"] == "paged"
    assert _io(build, "decoder") == _io(pkg, "decoder")  # pools, block tables, slot mapping, new_key rows
    assert _tokens(out / "package") == _tokens(src)


def test_int4_build_with_fusions_and_matmul_nbits(mha, tmp_path):
    scheme = {"weights": "int4", "group_size": 32}
    steps = recipe.from_dict(
        {"passes": [{"quantize": {"decoder": scheme, "eval_samples": 0, "eval_tokens": 0}}]}
    ).steps
    src = tmp_path / "int4"
    manager.run(Package.load(mha), steps).save(src)
    out = tmp_path / "build"
    summary = backends.get("ort").compile(Package.load(src), out, {"backend": "ort", "accuracy_level": 1})
    entry = summary["graphs"]["decoder"]
    assert entry["lowering"]["nodes_lowered"] > 0 and entry["fusions"]["attention"]["fused"] > 0
    ops = _ops(Package.load(out / "package").model("decoder"))
    assert ops["MatMulNBits"] == entry["lowering"]["nodes_lowered"] and "MultiHeadAttention" in ops
    assert _tokens(out / "package") == _tokens(src)


@pytest.mark.parametrize("option", ["fuse_norms", "fuse_rotary", "fuse_attention"])
def test_fusion_options_are_validated(option):
    assert backends.validate_target({"backend": "ort"})[option] is True
    with pytest.raises(Exception, match=option):
        backends.validate_target({"backend": "ort", option: "yes"})
