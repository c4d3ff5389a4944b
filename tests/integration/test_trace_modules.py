"""Issue 30's figure: a traced `vlmc build` of the demo recipe crosses between the package, graph,
session and interop modules at most half as often as the tree before round 8 (b468f62) did.

The baseline was measured with scripts/trace_modules.py on b468f62 (docs/architecture.md, "Module
crossings, measured"): 56 entries from one of the four modules into another, at 11 places.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASELINE_PING_PONG, BASELINE_PING_PONG_SITES = 56, 11


def _trace_script():
    spec = importlib.util.spec_from_file_location("vlmc_trace_modules", REPO / "scripts" / "trace_modules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_build_moves_between_the_four_modules_at_most_half_as_often_as_before():
    script = _trace_script()
    counts = script.trace(REPO / "recipes" / "demo.yaml", script.MODULES, detail=True)
    ping_pong = sum(c["ping_pong"] for c in counts.values())
    sites = sum(c["ping_pong_sites"] for c in counts.values())
    where = {m: c["ping_pong_by_site"] for m, c in counts.items() if c["ping_pong"]}
    assert ping_pong <= BASELINE_PING_PONG // 2, where
    assert sites <= BASELINE_PING_PONG_SITES // 2, where
    assert counts["vlmc/graphs.py"]["calls"] > 0  # the trace sees the modules at all (not a vacuous count)
