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

# As at a terminal: a test runner started in the background (`make test &`) hands its children SIGINT
# ignored (POSIX shells do that without job control), and vlmc, like Python, keeps an inherited SIG_IGN.
# Hence the harness's first lines. It runs the real CLI with one step made to pause: the step writes a
# marker file, then sleeps, so the test signals the process at a known point (inside the export of the
# first stage, or while the package is being written) instead of racing a build that may finish first.
PAUSED = """\
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from vlmc import graphs, interop
from vlmc.exporters import base
marker, phase = os.environ["VLMC_TEST_MARKER"], os.environ["VLMC_TEST_PHASE"]
def pausing(real):
    def wrapper(*args, **kwargs):
        if phase != "none" and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(60)
        return real(*args, **kwargs)
    return wrapper
if phase == "exporting":
    base.export_graph = pausing(base.export_graph)
elif phase == "writing":
    interop.save = pausing(interop.save)
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
    """Run the build to completion; return what libraries leave in TMPDIR (torch's cache dir...).

    It also shows the harness builds a complete package when left alone, so the tests below can fail.
    """
    root = tmp_path_factory.mktemp("uninterrupted")
    (root / "tmp").mkdir()
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)
    out = root / "out"
    proc = subprocess.run(
        [sys.executable, "-c", PAUSED, "-q", "build", "-r", str(recipe), "-o", str(out)],
        capture_output=True,
        timeout=300,
        env=dict(
            os.environ, TMPDIR=str(root / "tmp"), VLMC_TEST_MARKER=str(root / "m"), VLMC_TEST_PHASE="none"
        ),
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
    marker = tmp_path / "paused"
    # TMPDIR: torch.onnx.export's temp files must go too
    env = dict(os.environ, TMPDIR=str(tmpdir), VLMC_TEST_MARKER=str(marker), VLMC_TEST_PHASE=phase)
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", PAUSED, "build", "-r", str(recipe), "-o", str(out)],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        _wait_for(marker.exists, f"the build to reach {phase}", proc)
        assert _leftovers(work, "out"), "the temporary output directory exists at this point"
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


def test_a_recorded_signal_stops_the_export_writer_between_blocks_and_in_its_thread(tmp_path):
    """What the CLI's handler records is raised again before the next block of work: in the thread that
    queues blocks, and in the writer thread (through the block's future), as KeyboardInterrupt or, for
    SIGTERM, Terminated (exit 143)."""
    from vlmc import interrupts
    from vlmc.exporters import base

    with open(tmp_path / "data", "wb") as f, base._DataWriter(f) as writer:
        try:
            writer._submit(memoryview(b"a" * 64), None, None)  # nothing recorded: written
            writer.drain()
            assert writer.offset == 64
            interrupts.record(signal.SIGINT)
            with pytest.raises(KeyboardInterrupt):
                writer._submit(memoryview(b"b" * 64), None, None)
            with pytest.raises(KeyboardInterrupt):  # in the writer thread itself
                writer._writer.submit(writer._write, memoryview(b"c" * 64)).result()
            interrupts.record(signal.SIGTERM)
            with pytest.raises(interrupts.Terminated):
                interrupts.check()
        finally:
            interrupts.clear()
        interrupts.check()  # cleared: no-op
    assert (tmp_path / "data").read_bytes() == b"a" * 64
