"""Run one command as a child process and print its wall time and peak RSS as JSON (used by bench.py)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time


def main() -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    print(
        json.dumps(
            {
                "seconds": wall,
                "peak_rss_bytes": peak_kib * 1024,
                "returncode": proc.returncode,
                "stderr_tail": proc.stderr[-2000:],
            }
        )
    )


if __name__ == "__main__":
    main()
