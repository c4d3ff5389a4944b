"""Building one recipe twice gives byte-identical graphs, weights, samples and manifest; only reports differ."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vlmc.cli import main

RECIPE = """\
model: tiny-llava
passes:
  - fold_constants
  - simplify
"""
REPORTS = {"report.md", "report.json"}  # timings live here, by design


def _files(build: Path) -> dict[str, str]:
    return {
        p.relative_to(build).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(build.rglob("*"))
        if p.is_file()
    }


def _build_in_process(recipe: Path, out: Path) -> None:
    result = CliRunner().invoke(main, ["-q", "build", "-r", str(recipe), "-o", str(out)])
    assert result.exit_code == 0, result.stderr


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The same recipe built twice in this process and once in a fresh interpreter."""
    root = tmp_path_factory.mktemp("determinism")
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)
    _build_in_process(recipe, root / "a")
    _build_in_process(recipe, root / "b")
    subprocess.run(
        [sys.executable, "-m", "vlmc", "-q", "build", "-r", str(recipe), "-o", str(root / "c")],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return root / "a", root / "b", root / "c"


def test_same_recipe_gives_identical_bytes(builds):
    a, b, c = (_files(x) for x in builds)
    assert sorted(a) == sorted(b) == sorted(c)
    graphs = [f for f in a if f.endswith((".onnx", ".onnx.data"))]
    assert len(graphs) >= 6 and "package/vlmc.json" in a  # three graphs with their weights, the manifest
    differing = sorted(f for f in a if (a[f] != b[f] or a[f] != c[f]) and Path(f).name not in REPORTS)
    assert differing == [], f"not reproducible: {differing}"


def test_manifest_has_no_timings_or_timestamps(builds):
    text = (builds[0] / "package" / "vlmc.json").read_text()
    for word in ("seconds", "time", "date", "elapsed"):
        assert f'"{word}' not in text, word
    report = json.loads((builds[0] / "package" / "report.json").read_text())
    assert [p["pass"] for p in report["passes"]] == ["fold_constants", "simplify"]
    assert all(p["seconds"] >= 0 for p in report["passes"])


def test_a_different_recipe_gives_different_bytes(builds, tmp_path):
    """Guard against a comparison that cannot fail: one pass fewer must change the graphs."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: tiny-llava\npasses:\n  - fold_constants\n")
    _build_in_process(recipe, tmp_path / "d")
    a, d = _files(builds[0]), _files(tmp_path / "d")
    assert a["package/decoder.onnx"] != d["package/decoder.onnx"]
    assert a["package/vlmc.json"] != d["package/vlmc.json"]
