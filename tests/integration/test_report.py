"""report.md on a real tiny build (pruned, compiled for Ascend, then verified) and `vlmc inspect` printing the same."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from vlmc import graphs
from vlmc.cli import main

RECIPE = """\
model: tiny-llava
passes:
  - fold_constants
  - prune_visual_tokens: {keep: 16}
target: {backend: ascend, sequence_buckets: [128], past_buckets: [128]}
"""


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    (root / "recipe.yaml").write_text(RECIPE)
    cli("-q", "build", "-r", str(root / "recipe.yaml"), "-o", str(root / "out"))
    return root / "out"


@pytest.fixture(scope="module")
def verified(built, tmp_path_factory) -> Path:
    """A copy of the built package after `vlmc verify` (which writes into the package)."""
    pkg = tmp_path_factory.mktemp("verified") / "package"
    shutil.copytree(built / "package", pkg)
    cli("-q", "verify", str(pkg), "--max-new-tokens", "3")
    return pkg


def test_report_has_graphs_ops_weights_precision_tokens_kv(built):
    pkg = built / "package"
    text = (pkg / "report.md").read_text()
    m = json.loads((pkg / "vlmc.json").read_text())
    for name, info in m["graphs"].items():
        row = next(
            line
            for line in text.splitlines()
            if line.startswith(f"| {name} | {info['role']} | {info['precision']} |")
        )
        for io in info["inputs"][:6] + info["outputs"][:4]:
            assert f"`{io['name']}`" in row, (name, io["name"])
        ops = graphs.op_histogram(graphs.load_ir(pkg / info["file"]))
        ops_line = next(line for line in text.splitlines() if line.startswith(f"- **{name}**: "))
        assert ops_line == f"- **{name}**: " + ", ".join(f"{k}×{v}" for k, v in ops.items())
        precision = text.split("## Precision", 1)[1]
        assert re.search(
            rf"^\| {name} \| {info['precision']} \| .*float32 [0-9.]+ KiB.* \|$", precision, re.M
        ), name
    assert m["vision"]["tokens_per_image"] == 16
    assert "- visual tokens per image: 16\n" in text
    kv = m["kv"]
    assert f"- KV layout: {kv['layout']}\n" in text
    assert f"- KV bytes per token: {2 * kv['layers'] * kv['kv_heads'] * kv['head_dim'] * 4}\n" in text
    assert "- unique weight bytes: " in text and "KiB" in text


def test_report_has_pass_timings(built):
    pkg = built / "package"
    text = (pkg / "report.md").read_text()
    timings = json.loads((pkg / "report.json").read_text())["passes"]
    assert [t["pass"] for t in timings] == ["fold_constants", "prune_visual_tokens"]
    for t in timings:
        assert f"| {t['index']} | {t['pass']} | True | {t['seconds']} |" in text


def test_report_has_the_pruning_picture(built):
    pkg = built / "package"
    assert "![pruning](pruning.png)" in (pkg / "report.md").read_text()
    with Image.open(pkg / "pruning.png") as im:
        assert im.format == "PNG" and im.size[0] > 0


def test_report_has_the_atc_commands(built):
    text = (built / "package" / "report.md").read_text()
    compiled = json.loads((built / "build" / "compile.json").read_text())
    assert compiled["builds"]
    assert "## Compile" in text and f"SoC {compiled['soc_version']}" in text
    for b in compiled["builds"]:
        assert b["command"].startswith("atc ") and f"\n{b['command']}\n" in text


def test_report_before_verify_says_not_run(built):
    assert "not run (run `vlmc verify PACKAGE`)" in (built / "package" / "report.md").read_text()


def test_inspect_prints_report_md(built, verified):
    for pkg in (built / "package", verified):
        assert cli("inspect", str(pkg)).stdout == (pkg / "report.md").read_text()


def test_verify_puts_fidelity_numbers_in_the_report(verified):
    v = json.loads((verified / "verify.json").read_text())
    text = (verified / "report.md").read_text()
    assert v["exact_package"] is False  # pruning is lossy: fidelity, not parity
    assert "lossy package: fidelity" in text
    assert f"| prefill logits max abs diff | {v['prefill_logits_max_abs_diff']:.3g} |" in text
    assert f"| prefill logits cosine | {v['prefill_logits_cosine']:.6f} |" in text
    assert f"| token agreement | {v['token_agreement']:.3f} over 3 new tokens |" in text
    summary = json.loads(cli("inspect", "--json", str(verified)).stdout)
    assert summary["verify"]["prefill_logits_cosine"] == v["prefill_logits_cosine"]
    assert (
        json.loads((verified / "report.json").read_text())["verify"]["token_agreement"]
        == v["token_agreement"]
    )


def test_exact_package_reports_parity(tiny_llava, tmp_path):
    pkg = tmp_path / "package"
    shutil.copytree(tiny_llava, pkg)
    cli("-q", "verify", str(pkg), "--max-new-tokens", "3")
    text = (pkg / "report.md").read_text()
    v = json.loads((pkg / "verify.json").read_text())
    assert v["exact_package"] and v["passed"] and v["prefill_logits_max_abs_diff"] <= 1e-4
    assert "exact package: parity" in text and "| result | PASS |" in text


def test_optimized_package_does_not_inherit_verify_numbers(verified, tmp_path):
    out = tmp_path / "opt"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("passes: [simplify]\n")
    cli("-q", "optimize", str(verified), "-r", str(recipe), "-o", str(out))
    assert not (out / "verify.json").exists()
    assert "not run (run `vlmc verify PACKAGE`)" in (out / "report.md").read_text()
    assert (
        "## Verification\n\nlossy package" in (verified / "report.md").read_text()
    )  # the input keeps its own


def test_paged_kv_layout_in_report(tiny_llava, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("passes: [{paged_kv: {block_size: 16}}]\n")
    cli("-q", "optimize", str(tiny_llava), "-r", str(recipe), "-o", str(tmp_path / "paged"))
    assert "- KV layout: paged (block size 16)\n" in (tmp_path / "paged" / "report.md").read_text()
