"""Tensor-parallel ranks under signals and faults, through the real CLI (`vlmc run` on the tiny TP package).

Each case synchronises on the phase, not on time: a module the forkserver preloads (written below, only
for these tests) makes every rank write a marker holding its pid when it reaches the phase (opening its
package during start-up, its first decoder step during generation) and pause there. The test then
signals the parent or the process group, or kills or stops one rank, and checks the exit code, the one
line on stderr, the time it took, that every process of the run is gone (by pid), and that the private
rendezvous directory was removed. One case reads the ranks' listening sockets from /proc.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from vlmc import manager, recipe
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import ranks
from vlmc.runtime.ranks import RankGroup, check_resources

START_TIMEOUT = 180  # seconds for the ranks to reach the phase (torch import on a busy 2-core machine)
SIGNAL_BOUND = 1.0  # an interrupt ends the run within this (the parent's exit code)
GONE_BOUND = 10.0  # then every process of the run is gone within this

# Imported by the forkserver (added to its preload list by PARENT): pause each rank once at the phase.
RANK_MODULE = """\
import os, time
from vlmc.runtime import ranks as tp
marker, phase = os.environ["VLMC_TEST_MARKER"], os.environ["VLMC_TEST_PHASE"]
pause = float(os.environ["VLMC_TEST_PAUSE"])
def pausing(real):
    def wrapper(self, *args, **kwargs):
        rank = self.rank if isinstance(self, tp.RankDecoder) else args[0]
        path = f"{marker}.{rank}"
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            time.sleep(pause)
        return real(self, *args, **kwargs)
    return wrapper
if phase == "start":
    tp._Target.open = pausing(tp._Target.open)
elif phase == "generate":
    tp.RankDecoder.run = pausing(tp.RankDecoder.run)
"""

# As at a terminal: a test runner started in the background (`make test &`) hands its children SIGINT
# ignored (POSIX shells do that without job control), and vlmc, like Python, keeps an inherited SIG_IGN.
PARENT = """\
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
from multiprocessing import context
real = context.ForkServerContext.set_forkserver_preload
context.ForkServerContext.set_forkserver_preload = lambda self, names: real(self, [*names, "vlmc_test_ranks"])
from vlmc.cli import main
main()
"""


@pytest.fixture(scope="module")
def tp2(tiny_llava, tmp_path_factory) -> Path:
    """tiny-llava split over 2 ranks (the tensor_parallel pass), as recipes/tiny-llava-tp2-paged.yaml does."""
    pkg = manager.run(
        Package.load(tiny_llava), recipe.from_dict({"passes": [{"tensor_parallel": {"size": 2}}]}).steps
    )
    out = tmp_path_factory.mktemp("tp2") / "pkg"
    pkg.save(out)
    return out


def _session(sid: int) -> dict[int, str]:
    """pid -> state of every live (not zombie) process in session ``sid``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out[int(entry)] = fields[0]
    return out


def _alive(pids, sid: int) -> list[int]:
    live = _session(sid)
    return sorted(p for p in pids if p in live)


class Run:
    """`vlmc run` of the TP package in its own session, paused at ``phase`` in every rank."""

    def __init__(self, package: Path, tmp: Path, phase: str, pause: float = 120.0, **env: str) -> None:
        self.tmp = tmp
        (tmp / "mod").mkdir()
        (tmp / "mod" / "vlmc_test_ranks.py").write_text(RANK_MODULE)
        # The run's TMPDIR: short, because multiprocessing's forkserver puts an AF_UNIX socket in it
        # (108 bytes at most), and pytest-xdist's tmp_path can be longer than that alone.
        self.tmpdir = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
        self.marker = tmp / "reached"
        self.err = tmp / "stderr.txt"
        self.env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(tmp / "mod"), os.environ.get("PYTHONPATH", "")]),
            TMPDIR=str(self.tmpdir),
            VLMC_TEST_MARKER=str(self.marker),
            VLMC_TEST_PHASE=phase,
            VLMC_TEST_PAUSE=str(pause),
            **env,
        )
        with open(self.err, "wb") as stderr:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    PARENT,
                    "run",
                    str(package),
                    "--prompt",
                    "Hi",
                    "--max-new-tokens",
                    "4",
                ],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )

    def reached(self, ranks: int = 2) -> list[int]:
        """Wait until every rank is paused at the phase; their pids, rank 0 first."""
        paths = [Path(f"{self.marker}.{r}") for r in range(ranks)]
        deadline = time.monotonic() + START_TIMEOUT
        while not all(p.exists() for p in paths):
            if self.proc.poll() is not None:
                pytest.fail(f"vlmc exited ({self.proc.returncode}) before the phase: {self.err.read_text()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail("the ranks never reached the phase")
            time.sleep(0.02)
        return [int(p.read_text()) for p in paths]

    def processes(self) -> list[int]:
        return sorted(_session(self.proc.pid))

    def wait(self, bound: float) -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            code = self.proc.wait(timeout=bound + 60)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"vlmc did not exit within {bound + 60} s")
        return code, time.monotonic() - t0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def assert_all_gone(self, pids: list[int]) -> None:
        deadline = time.monotonic() + GONE_BOUND
        while _alive(pids, self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _alive(pids, self.proc.pid)
        if left:
            self.kill()
        assert left == [], f"processes of the run still alive {GONE_BOUND} s after it ended: {left}"
        assert list(self.tmpdir.glob("vlmc-ranks-*")) == [], "the rendezvous directory was left behind"

    def stderr(self) -> str:
        return self.err.read_text()


@pytest.fixture
def run(tp2, tmp_path):
    started: list[Run] = []

    def start(phase: str, **kwargs) -> Run:
        r = Run(tp2, tmp_path, phase, **kwargs)
        started.append(r)
        return r

    yield start
    for r in started:
        if r.proc.poll() is None:
            r.kill()
        shutil.rmtree(r.tmpdir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["parent", "group"])
@pytest.mark.parametrize("phase", ["start", "generate"])
@pytest.mark.parametrize(
    "sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_ends_the_run_at_once_and_leaves_no_process(run, phase, to, sig, code):
    r = run(phase)
    ranks = r.reached()
    pids = r.processes()
    assert set(ranks) <= set(pids) and len(pids) >= 4  # parent, forkserver (+ its resource tracker), ranks
    if to == "parent":
        r.proc.send_signal(sig)
    else:
        os.killpg(r.proc.pid, sig)
    got, took = r.wait(SIGNAL_BOUND)
    message = r.stderr()
    assert got == code, message
    assert message.splitlines()[-1] == "vlmc: interrupted; nothing was written", message
    assert "Traceback" not in message and "KeyboardInterrupt" not in message, message
    assert took < SIGNAL_BOUND, f"took {took:.2f} s to exit"
    r.assert_all_gone(pids)


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_with_one_line_naming_it(run):
    r = run("generate", pause=1.0)
    ranks = r.reached()
    pids = r.processes()
    os.kill(ranks[1], signal.SIGKILL)  # while rank 1 is inside its first decoder step
    code, took = r.wait(10)
    lines = r.stderr().strip().splitlines()
    assert code == 2, lines
    assert lines[-1] == "vlmc: error: tensor-parallel generate failed: rank 1 was killed by SIGKILL", lines
    assert lines[:-1] == ["starting 2 ranks (torch.distributed, gloo)"], (
        lines
    )  # no gloo C++ text, no traceback
    assert took < 10, f"took {took:.2f} s"
    r.assert_all_gone(pids)


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_collective_timeout(run):
    r = run("generate", pause=0.5, VLMC_TP_TIMEOUT="3")
    ranks = r.reached()
    pids = r.processes()
    os.kill(ranks[1], signal.SIGSTOP)
    code, took = r.wait(20)
    lines = r.stderr().strip().splitlines()
    assert code == 2, lines
    assert lines[-1].startswith("vlmc: error: tensor-parallel generate failed: rank 1 (pid "), lines
    assert "is stopped and has not run for 3 s" in lines[-1], lines
    assert lines[:-1] == ["starting 2 ranks (torch.distributed, gloo)"], lines
    assert 3 <= took < 20, f"took {took:.2f} s"  # the timeout, then at once
    r.assert_all_gone(pids)  # the stopped rank too (SIGKILL ends a stopped process)


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] != "0A" or f[9] not in inodes:  # 0A: TCP_LISTEN
                    continue
                hex_addr, hex_port = f[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints the address as 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
                out.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return out


def _outside_address() -> str | None:
    """This machine's address on its default route (not loopback), or None (no such interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: no packet is sent
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.mark.slow
def test_ranks_listen_on_loopback_only_and_meet_in_a_private_directory(run):
    r = run("generate")
    ranks = r.reached()
    pids = r.processes()
    sockets = {pid: _listening(pid) for pid in pids}
    listening = [s for held in sockets.values() for s in held]
    assert listening, "the ranks' gloo sockets should be listening now"
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in listening), sockets
    outside = _outside_address()
    if outside is not None:  # a connection from another address of this machine is refused
        for _, port in listening:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                with pytest.raises(OSError):
                    s.connect((outside, port))
    # The rendezvous: a FileStore in a directory only this user can open, nothing listening for it.
    (store_dir,) = r.tmpdir.glob("vlmc-ranks-*")
    assert store_dir.stat().st_mode & 0o777 == 0o700
    assert ranks and all(p in sockets for p in ranks)
    os.killpg(r.proc.pid, signal.SIGINT)
    assert r.wait(SIGNAL_BOUND)[0] == 130
    r.assert_all_gone(pids)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"VLMC_TP_ADDRESS": "not-an-address"}, "VLMC_TP_ADDRESS='not-an-address' is not an IP address"),
        ({"VLMC_TP_ADDRESS": "192.0.2.1"}, "VLMC_TP_ADDRESS=192.0.2.1: cannot bind it here"),
        ({"VLMC_TP_TIMEOUT": "0"}, "VLMC_TP_TIMEOUT='0': give the all-reduce timeout in seconds, above 0"),
        ({"VLMC_TP_TIMEOUT": "nan"}, "VLMC_TP_TIMEOUT='nan'"),
    ],
)
def test_bad_rank_settings_are_one_line_before_any_process(tp2, monkeypatch, env, message):
    def started(*args, **kwargs):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(RankGroup, "_start", started)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    res = CliRunner().invoke(main, ["run", str(tp2), "--prompt", "Hi", "--max-new-tokens", "2"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("starting 2 ranks"), (
        lines
    )  # the info line, then the refusal
    assert lines[-1].startswith("vlmc: error: ") and message in lines[-1], lines


def test_size_is_bounded_by_cores_and_memory():
    cores = os.cpu_count() or 1
    most = cores * ranks.MAX_RANKS_PER_CORE
    check_resources(2, 1 << 20)  # what the tiny package needs fits
    with pytest.raises(VlmcError, match=f"tensor_parallel.size {most + 1}: this machine has {cores} cores"):
        check_resources(most + 1, 0)
    with pytest.raises(VlmcError, match=r"tensor_parallel.size 2: the ranks need about .* GiB available"):
        check_resources(2, 1 << 50)  # a petabyte of weights per rank


def test_a_tampered_size_of_64_starts_no_process(tp2, tmp_path, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(RankGroup, "_start", started)
    pkg = tmp_path / "pkg"
    shutil.copytree(tp2, pkg)
    m = json.loads((pkg / "vlmc.json").read_text())
    m["tensor_parallel"]["size"] = 64
    (pkg / "vlmc.json").write_text(json.dumps(m))
    res = CliRunner().invoke(main, ["run", str(pkg), "--prompt", "Hi", "--max-new-tokens", "2"])
    assert res.exit_code == 2, res.output
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("vlmc: error: ") and "64" in last, last
    assert "Traceback" not in res.output
