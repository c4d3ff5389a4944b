"""A fast subset of the compatibility matrix (scripts/matrix.py): a few cells run again here, and each
status (ok / refused / FAIL) and refusal reason must be what `make matrix` recorded in
docs/compatibility.json, and what docs/compatibility.md shows."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import onnx
import pytest

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "docs" / "compatibility.json"


def _matrix():
    spec = importlib.util.spec_from_file_location("vlmc_matrix", REPO / "scripts" / "matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


matrix = _matrix()


def _unplaced(reason: str | None) -> str | None:
    # the run's own directories appear in some reasons
    return None if reason is None else re.sub(r"/[^\s:;,()']+", "PATH", reason)


def test_the_record_covers_every_builtin_recipe_and_executor():
    record = json.loads(RECORD.read_text())
    assert sorted(record["cells"]) == matrix.builtins()
    for row in record["cells"].values():
        assert sorted(row) == sorted(matrix.RECIPES)
        for cell in row.values():
            for e in matrix.EXECUTORS:
                assert cell[e]["status"] in ("ok", "refused", "FAIL")
                assert ("reason" in cell[e]) == (cell[e]["status"] != "ok")
    counts = matrix.summary(record)
    text = (REPO / "docs" / "compatibility.md").read_text()
    assert f"{counts['ok']} working, {counts['refused']} refused, {counts['FAIL']} failing" in text
    assert "docs/compatibility.md" in (REPO / "README.md").read_text()


@pytest.mark.parametrize(
    "builtin, recipe",
    [
        ("tiny-llava", "int8-vision-merge"),
        ("tiny-llava", "prune"),
        ("tiny-blip2", "prune"),
    ],
)
def test_a_cell_runs_as_the_matrix_recorded(builtin, recipe, exported, tmp_path):
    want = json.loads(RECORD.read_text())["cells"][builtin][recipe]
    got = matrix.run_cell(exported(builtin), recipe, tmp_path / "cell")
    for e in matrix.EXECUTORS:
        assert got[e]["status"] == want[e]["status"], (e, got[e], want[e])
        assert _unplaced(got[e].get("reason")) == _unplaced(want[e].get("reason"))
        if got[e]["status"] == "ok":
            assert got[e]["tokens"] == want[e]["tokens"]


def _agreement(agree: int, cosine: float = 1.0, top1: float = 1.0, top5: float = 1.0) -> dict:
    return {
        "tokens_agree": agree,
        "tokens": 6,
        "prefill_logits_cosine": cosine,
        "prefill_top1": top1,
        "prefill_top5": top5,
    }


def test_the_judge_is_token_exact_unless_lossy_and_then_holds_the_fidelity_rule():
    # not lossy: every token
    assert matrix.judge(_agreement(6), None) is None
    assert "5 of 6 tokens agree" in matrix.judge(_agreement(5), None)
    # lossy: every token in exact arithmetic, and the fidelity bounds with fp16
    assert matrix.judge(_agreement(4, cosine=0.9999, top5=0.8), _agreement(6)) is None
    assert "exact arithmetic 5 of 6" in matrix.judge(_agreement(6), _agreement(5))
    assert "first token agreement 0 < 1" in matrix.judge(_agreement(0, top1=0.0), _agreement(6))
    assert "cosine 0.98 < 0.99" in matrix.judge(_agreement(4, cosine=0.98), _agreement(6))
    assert "top-5 overlap 0.4 < 0.6" in matrix.judge(_agreement(4, top5=0.4), _agreement(6))
    assert matrix.judge(_agreement(4, cosine=float("nan")), _agreement(6)) is not None


def test_a_lossy_build_with_a_wrong_activation_scale_fails_both_legs(exported, tmp_path):
    """The rule can fail: the INT8 vision build with AscendQuant's scale s where the deploy form has 1/s
    (docs/atc-facts.md, "Quantized models") runs, and the matrix calls it FAIL in exact arithmetic and
    with fp16 alike, where the build as compiled is ok."""
    work = tmp_path / "cell"
    cell = matrix.run_cell(exported("tiny-llava"), "int8-vision", work)["reference"]
    assert cell["status"] == "ok" and cell["lossy"] == ["vision_encoder"], cell
    assert not matrix.shortfalls(cell["fidelity"]) and cell["fidelity"]["exact_agree"] == "6/6"
    graph = work / "build" / "graphs" / "vision_encoder.onnx"
    model = onnx.load(graph, load_external_data=False)  # the weights stay in the .data file beside it
    quants = [n for n in model.graph.node if n.op_type == "AscendQuant"]
    assert quants
    for node in quants:
        scale = next(a for a in node.attribute if a.name == "scale")
        scale.f = 1.0 / scale.f
    onnx.save(model, graph)
    broken = matrix.reference_cell(work / "package", work / "build")
    assert broken["status"] == "FAIL", broken
    assert "in exact arithmetic" in broken["reason"]
    assert matrix.shortfalls(broken["fidelity"]), broken["fidelity"]


def test_a_weight_only_build_is_judged_against_the_package_in_its_storage_formats(exported, tmp_path):
    """A weight-only INT4 paged build holds its antiquant_scale and its KV pools in float16 (what
    NPUWeightQuantBatchMatmulV2 and ReshapeAndCache take), so its exact-arithmetic leg runs against the
    package holding the same: there the lowered graph's logits are the package's to float32 rounding,
    and a build wired wrong (layer 0's gate and up weights swapped) fails."""
    work = tmp_path / "cell"
    cell = matrix.run_cell(exported("tiny-qwen2-vl"), "fold-awq4-paged", work)["reference"]
    assert cell["status"] == "ok" and cell["lossy"] == ["decoder"], cell
    fid = cell["fidelity"]
    assert fid["exact_agree"] == "6/6" and fid["exact_max_logit_diff"] < 1e-4, fid
    assert any("antiquant_scale in float16" in f for f in fid["exact_formats"]), fid
    assert any("KV pools in float16" in f for f in fid["exact_formats"]), fid
    graph = work / "build" / "graphs" / "decoder.onnx"
    model = onnx.load(graph, load_external_data=False)  # the weights stay in the .data file beside it
    ops = {n.name: n for n in model.graph.node if n.op_type == "NPUWeightQuantBatchMatmulV2"}
    gate, up = (
        next(n for name, n in ops.items() if f"layers.0/mlp/{p}" in name) for p in ("gate_proj", "up_proj")
    )
    for i in (1, 2):  # the weight and its antiquant_scale
        gate.input[i], up.input[i] = up.input[i], gate.input[i]
    onnx.save(model, graph)
    exact = matrix.exact_agreement(work / "package", work / "build")
    assert exact["max_logit_diff"] > 1e-2, exact
    broken = matrix.reference_cell(work / "package", work / "build")
    assert broken["status"] == "FAIL" and "in exact arithmetic" in broken["reason"], broken


def test_a_paged_build_is_judged_token_exact_against_the_package_with_float16_pools(exported, tmp_path):
    """A paged build that is not lossy holds its KV pools in float16 (what ReshapeAndCache takes), so it
    is judged token-exact against the package holding the same: the tensor-parallel paged build passes,
    and the same build wired wrong (rank 0's layer-0 k_proj and v_proj weights swapped) fails."""
    work = tmp_path / "cell"
    cell = matrix.run_cell(exported("tiny-llava"), "fold-tp2-paged", work)["reference"]
    assert cell["status"] == "ok" and "lossy" not in cell and cell["agree"] == "6/6", cell
    assert cell["formats"] and all(f.endswith("KV pools in float16") for f in cell["formats"]), cell
    graph = work / "build" / "graphs" / "decoder.rank0.0.onnx"
    model = onnx.load(graph, load_external_data=False)  # the weights stay in the .data file beside it
    ops = {n.name: n for n in model.graph.node if n.op_type == "MatMul"}
    k, v = (
        next(n for name, n in ops.items() if f"layers.0/self_attn/{p}/" in name) for p in ("k_proj", "v_proj")
    )
    k.input[1], v.input[1] = v.input[1], k.input[1]
    onnx.save(model, graph)
    broken = matrix.reference_cell(work / "package", work / "build")
    assert broken["status"] == "FAIL" and "tokens agree with the package" in broken["reason"], broken
    assert broken["formats"] == cell["formats"], broken


def test_prune_recipes_take_the_method_the_manifest_supports(exported):
    """Scored by CLS attention where the attention facts name a CLS query, by the attention received
    where they name none, uniform where the exporter recorded no attention facts."""
    for builtin, method in (
        ("tiny-llava", "cls_attention"),
        ("tiny-qwen2-vl", "attention_received"),
        ("tiny-qwen-vl", "uniform"),
    ):
        (step,) = [s["prune_visual_tokens"] for s in matrix._passes("prune", exported(builtin))]
        assert step["method"] == method, (builtin, step)
        assert step["keep"] >= 1
