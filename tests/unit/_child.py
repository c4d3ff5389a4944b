"""Memory probes run in a child process, so one test's allocations cannot blur another's peak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def peak_growth(code: str, *args: str) -> int:
    """Run ``code`` as ``python -c`` with ``args``; its last stdout line is JSON with ``base`` and
    ``peak`` (bytes): returns how far the peak rose above the base."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, cwd=REPO
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["peak"] - r["base"]
