"""Run one command as a child process and print its wall time and peak RSS as JSON (used by bench.py).

    python scripts/_measure.py [--rss-limit BYTES] COMMAND...

With ``--rss-limit`` the child is killed as soon as its resident set exceeds the limit (checked
every 0.2 s), so a benchmark of a step that does not fit cannot take a shared machine down; the
JSON then says ``killed_over_rss`` and the step that was running (the child's last stderr line).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import threading
import time


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    argv = sys.argv[1:]
    limit = None
    if argv[:1] == ["--rss-limit"]:
        limit, argv = int(argv[1]), argv[2:]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    killed = False
    while proc.poll() is None:
        if limit is not None and _rss(proc.pid) > limit:
            proc.kill()
            killed = True
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(timeout=5)
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    tail = "".join(err)[-2000:]
    last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
    print(
        json.dumps(
            {
                "seconds": wall,
                "peak_rss_bytes": peak_kib * 1024,
                "returncode": proc.returncode,
                "killed_over_rss": killed,
                "last_line": last,
                "stderr_tail": tail,
            }
        )
    )


if __name__ == "__main__":
    main()
