"""passes/ loads once, as vlmc.passes: nothing imports it by its directory name (a second copy of it)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SOURCES = ("vlmc", "passes", "tests", "scripts")


def _imports_of_passes(path: Path) -> list[str]:
    """``import passes...`` / ``from passes... import`` statements in one file, as 'path:line'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n == "passes" or n.startswith("passes.") for n in names):
            found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}")
    return found


def test_no_source_imports_passes_by_its_directory_name():
    files = [f for d in SOURCES for f in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 100  # the scan saw the tree
    assert [hit for f in files for hit in _imports_of_passes(f)] == []


def test_the_scan_finds_an_import_of_passes(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\nfrom passes import merge\nimport passes.quantize\nfrom vlmc.passes import split\n"
    )
    assert _imports_of_passes(bad) == [f"{bad}:2", f"{bad}:3"]


_PROBE = """
import importlib, json, pkgutil, sys
sys.path.insert(0, {repo!r})  # as pytest's rootdir does: passes/ is importable by its directory name
import vlmc, vlmc.passes
from vlmc import pass_api
pass_api.registry()
failed = []
for pkg in (vlmc, vlmc.passes):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except ImportError as exc:  # an optional dependency (e.g. pyACL) missing is not this test's concern
            failed.append(f"{{info.name}}: {{exc}}")
print(json.dumps({{
    "top_level": sorted(m for m in sys.modules if m == "passes" or m.startswith("passes.")),
    "vlmc_passes": sorted(m for m in sys.modules if m.startswith("vlmc.passes")),
    "quantize_file": sys.modules["vlmc.passes.quantize.scheme"].__file__,
    "failed": failed,
}}))
"""


def test_importing_everything_loads_passes_once_as_vlmc_passes():
    code = _PROBE.format(repo=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["top_level"] == []
    assert {"vlmc.passes.quantize", "vlmc.passes.quantize.scheme", "vlmc.passes.merge"} <= set(
        got["vlmc_passes"]
    )
    assert Path(got["quantize_file"]) == REPO / "passes" / "quantize" / "scheme.py"
    assert got["failed"] == []
