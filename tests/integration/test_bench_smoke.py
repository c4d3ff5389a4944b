"""`make bench` at tiny size: the whole benchmark script runs and writes its report and plots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_quick_writes_report_and_plots(tmp_path):
    out = tmp_path / "benchmarks.md"
    # A hand-written section survives the run; a generated one is replaced, not appended again.
    out.write_text(
        "# Benchmarks\n\nold preamble\n\n## Machine\n\nstale machine table\n\n"
        "## Notes written by hand\n\nmeasured with `some command`: 1.23 s\n"
    )
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = out.read_text()
    assert "| tiny |" in text and "time ratio" in text
    assert "## Notes written by hand\n\nmeasured with `some command`: 1.23 s\n" in text
    assert "stale machine table" not in text and "old preamble" not in text
    assert text.count("## Machine") == 1 and "| cores |" in text
    for bench in ("prune_visual_tokens", "quantize", "paged_kv", "merge"):
        assert bench in text, f"no {bench} rows in the report"
    for png in ("pipeline_time.png", "pipeline_rss.png"):
        assert (tmp_path / "bench" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
