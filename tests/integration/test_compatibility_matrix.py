"""A fast subset of the compatibility matrix (scripts/matrix.py): a few cells run again here, and each
status (ok / refused / FAIL) and refusal reason must be what `make matrix` recorded in
docs/compatibility.json, and what docs/compatibility.md shows."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

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
