"""Issue 30's figure: a traced `vlmc build` of the demo recipe crosses between the package, graph,
session and interop modules at most half as often as the tree before round 8 (b468f62) did.

The baseline was measured with scripts/trace_modules.py on b468f62 (docs/architecture.md, "Module
crossings, measured"): 56 entries from one of the four modules into another, at 11 places.
The build traced is the demo recipe doing the work b468f62's did: since then the ort target also fuses
norms, rotary and attention, checking each fusion in its own session, and slices the LM head to the last
position (a lowered decoder, written and checked against the package): more graphs opened, not more
crossings per graph, so the like-for-like trace turns those four options off. With them on, the demo
build still crosses no more often, at no more places, than b468f62's plain one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BASELINE_PING_PONG, BASELINE_PING_PONG_SITES = 56, 11
# the ort target's options (docs/ort.md) that do work b468f62's build did not
NEWER_WORK = ("fuse_norms", "fuse_rotary", "fuse_attention", "last_logits")


def _trace_script():
    spec = importlib.util.spec_from_file_location("vlmc_trace_modules", REPO / "scripts" / "trace_modules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _demo_without_newer_work(tmp_path: Path) -> Path:
    recipe = yaml.safe_load((REPO / "recipes" / "demo.yaml").read_text())
    recipe["target"] = {**recipe["target"], **dict.fromkeys(NEWER_WORK, False)}
    path = tmp_path / "demo-like-b468f62.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _crossings(recipe: Path) -> tuple[int, int, dict]:
    script = _trace_script()
    counts = script.trace(recipe, script.MODULES, detail=True)
    assert counts["vlmc/graphs.py"]["calls"] > 0  # the trace sees the modules at all (not a vacuous count)
    ping_pong = sum(c["ping_pong"] for c in counts.values())
    sites = sum(c["ping_pong_sites"] for c in counts.values())
    return ping_pong, sites, {m: c["ping_pong_by_site"] for m, c in counts.items() if c["ping_pong"]}


def test_a_build_moves_between_the_four_modules_at_most_half_as_often_as_before(tmp_path):
    ping_pong, sites, where = _crossings(_demo_without_newer_work(tmp_path))
    assert ping_pong <= BASELINE_PING_PONG // 2, where
    assert sites <= BASELINE_PING_PONG_SITES // 2, where


def test_the_demo_build_with_the_ort_fusions_crosses_no_more_than_the_plain_one_before():
    ping_pong, sites, where = _crossings(REPO / "recipes" / "demo.yaml")
    assert ping_pong <= BASELINE_PING_PONG and sites <= BASELINE_PING_PONG_SITES, where
