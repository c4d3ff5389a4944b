"""Run one command as a child process and print its wall time and peak RSS as JSON (used by bench.py).

    python scripts/_measure.py [--rss-limit BYTES] [--min-free BYTES:DIR] [--log FILE] COMMAND...

With ``--rss-limit`` the child is killed (with every process it started) as soon as its resident
set exceeds the limit (checked every 0.2 s), so a benchmark of a step that does not fit cannot
take a shared machine down; the JSON then says ``killed_over_rss``. ``--min-free`` does the same
for disk: the child is killed when the filesystem holding DIR has fewer than BYTES free
(``killed_low_disk``), so a step that writes more than the disk holds cannot fill a shared disk.
``--log`` keeps the child's whole stderr in FILE.

Steps: every stderr line ending in `` ...`` is a progress note that starts a step (vlmc prints one
per build phase and per pass: ``exporting ...``, ``pass 2/4: simplify ...``, ``saving package ...``).
``steps`` in the JSON lists each note with the seconds until the next note (or the end) and the
highest RSS sampled in between, so a build that fails or is killed still shows where its time and
memory went and which step it was in (``last_step``).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

INTERVAL = 0.2  # seconds between RSS samples


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_rss(pid: int) -> int:
    """RSS of a process and all its descendants (Linux /proc/PID/task/*/children)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _rss(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return total


def step_figures(notes: list[tuple[float, str]], samples: list[tuple[float, int]], end: float) -> list[dict]:
    """Per step (a progress note until the next): seconds from its note and the peak RSS sampled in it."""
    steps = []
    if notes and notes[0][0] > 0:  # interpreter start-up and whatever ran before the first note
        notes = [(0.0, "start-up (before the first note)"), *notes]
    for i, (t, line) in enumerate(notes):
        until = notes[i + 1][0] if i + 1 < len(notes) else end
        peak = max((r for s, r in samples if t <= s <= until), default=0)
        steps.append(
            {"step": line, "start": round(t, 3), "seconds": round(until - t, 3), "peak_rss_bytes": peak}
        )
    return steps


def main() -> None:
    argv = sys.argv[1:]
    limit = log = disk = None
    while argv[:1] in (["--rss-limit"], ["--log"], ["--min-free"]):
        if argv[0] == "--rss-limit":
            limit = int(argv[1])
        elif argv[0] == "--min-free":
            need, where = argv[1].split(":", 1)
            disk = (int(need), where)
        else:
            log = argv[1]
        argv = argv[2:]
    t0 = time.perf_counter()
    # wide enough that rich never wraps a progress note (it wraps at 80 columns off a terminal)
    env = {**os.environ, "COLUMNS": os.environ.get("COLUMNS", "400")}
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    err: list[str] = []
    notes: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:
            err.append(line)
            # rich may end a line with spaces; a progress bar's carriage returns are not notes
            text = line.rstrip()
            if text.endswith(" ...") and "\r" not in text:
                notes.append((time.perf_counter() - t0, text[: -len(" ...")]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed = low_disk = False
    samples: list[tuple[float, int]] = []
    while proc.poll() is None:
        now = _tree_rss(proc.pid)
        samples.append((time.perf_counter() - t0, now))
        killed = limit is not None and now > limit
        low_disk = disk is not None and shutil.disk_usage(disk[1]).free < disk[0]
        if killed or low_disk:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the child and whatever it started
            except OSError:
                proc.kill()
            break
        time.sleep(INTERVAL)
    proc.wait()
    reader.join(timeout=5)
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    text = "".join(err)
    if log:
        with open(log, "w") as f:
            f.write(text)
    tail = text[-2000:]
    last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
    steps = step_figures(notes, samples, wall)
    print(
        json.dumps(
            {
                "seconds": wall,
                "peak_rss_bytes": max(peak_kib * 1024, max((r for _, r in samples), default=0)),
                "returncode": proc.returncode,
                "killed_over_rss": killed,
                "killed_low_disk": low_disk,
                "last_line": last,
                "last_step": steps[-1]["step"] if len(notes) else None,
                "steps": steps,
                "stderr_tail": tail,
            }
        )
    )


if __name__ == "__main__":
    main()
