"""SIGINT or SIGTERM during a real `vlmc build` subprocess leaves no output and no temporary directories."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RECIPE = "model: tiny-llava\npasses:\n  - fold_constants\n  - simplify\n"

# Runs the real CLI with a slow disk: every graph write waits first, so the signal lands while the
# temporary output directory exists (the tiny model alone is written in a few milliseconds).
SLOW_DISK = """\
import sys, time
from vlmc import graphs
_save = graphs.save
def slow_save(model, path):
    time.sleep(0.4)
    _save(model, path)
graphs.save = slow_save
from vlmc.cli import main
main()
"""

START_TIMEOUT = 180  # seconds to reach the phase under test (torch import on a busy 2-core machine)


def _wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"build exited ({proc.returncode}) before {what}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((f".{name}.tmp-", f".{name}.old-")))


@pytest.fixture(scope="module")
def library_caches(tmp_path_factory) -> set[str]:
    """Run the slow-disk build to completion; return what libraries leave in TMPDIR (torch's cache dir...).

    It also shows the harness builds a complete package when left alone, so the tests below can fail.
    """
    root = tmp_path_factory.mktemp("uninterrupted")
    (root / "tmp").mkdir()
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)
    out = root / "out"
    proc = subprocess.run(
        [sys.executable, "-c", SLOW_DISK, "-q", "build", "-r", str(recipe), "-o", str(out)],
        capture_output=True,
        timeout=300,
        env=dict(os.environ, TMPDIR=str(root / "tmp")),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert (out / "package" / "vlmc.json").is_file() and (out / "vlmc-build.json").is_file()
    assert _leftovers(root, "out") == []
    return {p.name for p in (root / "tmp").iterdir()}


@pytest.mark.parametrize(
    ("phase", "sig"),
    [("exporting", signal.SIGTERM), ("writing", signal.SIGINT), ("writing", signal.SIGTERM)],
    ids=["exporting-SIGTERM", "writing-SIGINT", "writing-SIGTERM"],
)
def test_signal_during_build_leaves_nothing(phase: str, sig: signal.Signals, tmp_path: Path, library_caches):
    work, tmpdir = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmpdir.mkdir()
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE)
    out = work / "out"
    err = tmp_path / "stderr.txt"
    env = dict(os.environ, TMPDIR=str(tmpdir))  # torch.onnx.export's temp files must go too
    cmd = [sys.executable, "-c", SLOW_DISK] if phase == "writing" else [sys.executable, "-m", "vlmc"]
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            cmd + ["build", "-r", str(recipe), "-o", str(out)],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        if phase == "exporting":
            _wait_for(lambda: b"exporting tiny-llava" in err.read_bytes(), "the export to start", proc)
        else:
            _wait_for(lambda: bool(_leftovers(work, "out")), "the temporary output directory", proc)
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    message = err.read_text()
    assert code == (130 if sig == signal.SIGINT else 143), message
    assert "vlmc: interrupted; nothing was written" in message
    assert "Traceback" not in message
    assert not out.exists()
    assert _leftovers(work, "out") == []
    assert sorted(p.name for p in work.iterdir()) == ["recipe.yaml"]
    assert {p.name for p in tmpdir.iterdir()} <= library_caches  # no temporary directories of ours
