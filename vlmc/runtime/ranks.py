"""Tensor-parallel runtime: one process per rank, joined by a collective library (gloo on CPU, HCCL on cards).

A package written by the ``tensor_parallel`` pass holds, for every rank, its decoder as segments cut at
the all-reduce points, and the host plan in ``tensor_parallel.plan`` (segment, all-reduce, segment, ...).
:class:`RankGroup` starts one process per rank; each runs the runtime's one generation loop
(:class:`vlmc.runtime.pipeline.Pipeline`) with a :class:`RankDecoder`, which runs the rank's segments and
calls the collective's all-reduce between them, as the Ascend host calls ``HcclAllReduce`` between
``.om`` segments (hicann/hccl ``include/hccl.h``). The sum is the collective library's, never a sum
written here: the ranks are separate processes with separate memory.

What a rank runs is either the package's graphs on onnxruntime or a ``vlmc compile`` output's builds
(``vlmc run BUILD_DIR``): then every rank opens the build with :func:`vlmc.runtime.executors.open`
restricted to its rank's builds, and follows compile.json's host plan. The collective is chosen from what runs the segments
(:mod:`vlmc.runtime.collective`): gloo for onnxruntime and the reference executor, torch_npu's hccl for acl.

Each rank keeps its own KV state (contiguous or paged) holding only its KV heads
(``tensor_parallel.kv_heads_per_rank``). Embedding, vision and the last segment (final norm, lm_head)
are replicated, so every rank computes the same logits and the same tokens; the group checks that.

torch is in the ``export`` extra: running a tensor-parallel package on CPU needs it for gloo.

Faults and signals (docs/tensor_parallel.md "Faults and signals"): the ranks ignore SIGINT, the parent
turns SIGINT/SIGTERM into KeyboardInterrupt, kills every rank and waits for it; a rank that dies or stays
stopped ends the run with one line naming it; the size is checked against this machine's cores and
memory before any process starts (:func:`check_resources`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from vlmc import limits
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import collective as collective_mod
from vlmc.runtime import executors
from vlmc.runtime.collective import COLLECTIVE_TIMEOUT_S, NEEDS_TORCH, require_torch  # noqa: F401
from vlmc.runtime.pipeline import Pipeline

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = collective_mod.START_TIMEOUT_S
# After one rank failed, how long the others get to report before the group is stopped.
_GRACE_S = 10.0
# How often the parent looks at ranks it is waiting for (stopped?), and how long a clean stop may take.
_POLL_S = 0.25
_CLOSE_S = 5.0
# Ranks per core: past it the ranks spend their time waiting in all-reduces for each other.
MAX_RANKS_PER_CORE = limits._env_int("VLMC_MAX_RANKS_PER_CORE", 4)
# What one rank process needs besides its share of the weights (torch, onnxruntime, its arenas).
_RANK_OVERHEAD_BYTES = 256 << 20


def facts(manifest: dict) -> dict | None:
    """The manifest's tensor_parallel section, or None for an unsharded package."""
    return manifest.get("tensor_parallel") or None


class RankDecoder:
    """One rank's decoder: runs the host plan (segments, and all-reduces through ``all_reduce``)."""

    def __init__(self, manifest: dict, rank: int, all_reduce, plan: list[dict] | None = None) -> None:
        """
        Args:
            manifest: the (runtime) package's manifest.
            rank: this process's rank.
            all_reduce: the collective's sum all-reduce, numpy in and out.
            plan: the host plan to follow instead of the manifest's: compile.json's
                ``tensor_parallel.plan`` for a compile output. It must run the same graphs and
                collectives as the manifest's plan (it adds only the build names).
        """
        tp = facts(manifest)
        if tp is None:
            raise VlmcError("the package is not tensor-parallel (no tensor_parallel section in vlmc.json)")
        if not 0 <= rank < int(tp["size"]):
            raise VlmcError(f"rank {rank} is outside the package's {tp['size']} ranks")
        if plan is not None:
            keys = ("step", "graphs", "input", "output")
            if [tuple(s.get(k) for k in keys) for s in plan] != [
                tuple(s.get(k) for k in keys) for s in tp["plan"]
            ]:
                raise VlmcError(
                    "compile.json's tensor_parallel.plan does not match the runtime package's; "
                    "re-run `vlmc compile`"
                )
            tp = {**tp, "plan": plan}
        self.tp = tp
        self.rank = rank
        self.all_reduce = all_reduce
        self.collectives = 0  # all-reduces run so far (the benchmark and tests read it)

    def graphs(self) -> list[str]:
        """This rank's segment graphs, in plan order."""
        return [s["graphs"][self.rank] for s in self.tp["plan"] if s["step"] == "segment"]

    def kv_facts(self, kv: dict) -> dict:
        """The KV facts this rank's state uses: its share of the heads."""
        return {**kv, "kv_heads": int(self.tp["kv_heads_per_rank"])}

    def run(self, pipeline, available: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the plan; returns every segment output (logits, presents or new KV rows)."""
        env = dict(available)
        produced: dict[str, np.ndarray] = {}
        for step in self.tp["plan"]:
            if step["step"] == "segment":
                out = pipeline.run_graph(step["graphs"][self.rank], env)
                env.update(out)
                produced.update(out)
            elif step["step"] == "all_reduce":
                env[step["output"]] = self.all_reduce(env[step["input"]])
                self.collectives += 1
            else:
                raise VlmcError(f"tensor_parallel.plan: unknown step {step['step']!r}; upgrade vlmc")
        return produced


def _available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or None off Linux."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_resources(size: int, rank_bytes: int, what: str = "tensor_parallel.size") -> None:
    """Refuse, in one line and before any process starts, more ranks than this machine can hold: at most
    :data:`MAX_RANKS_PER_CORE` per core, and each rank's weights plus its process within the memory
    available now."""
    cores = os.cpu_count() or 1
    most = cores * MAX_RANKS_PER_CORE
    if size > most:
        raise VlmcError(
            f"{what} {size}: this machine has {cores} cores, at most {most} ranks run here "
            f"({MAX_RANKS_PER_CORE} per core; VLMC_MAX_RANKS_PER_CORE raises it)"
        )
    available = _available_memory()
    need = size * (rank_bytes + _RANK_OVERHEAD_BYTES)
    if available is not None and need > available:
        raise VlmcError(
            f"{what} {size}: the ranks need about {need / 2**30:.1f} GiB "
            f"({rank_bytes / 2**20:.0f} MiB of weights and {_RANK_OVERHEAD_BYTES >> 20} MiB of process each), "
            f"this machine has {available / 2**30:.1f} GiB available"
        )


def _rank_weight_bytes(root: Path, manifest: dict, size: int) -> int:
    """The largest one rank's graphs on disk: its own graphs and every replicated one (stat only)."""
    per_rank = [0] * size
    shared = 0
    for graph in manifest.get("graphs", {}).values():
        file = graph.get("file") if isinstance(graph, dict) else None
        total = 0
        for f in [file, f"{file}.data"] if isinstance(file, str) else []:  # the graph and its external data
            with contextlib.suppress(OSError):
                total += (root / f).stat().st_size
        rank = graph.get("rank") if isinstance(graph, dict) else None
        if isinstance(rank, int) and 0 <= rank < size:
            per_rank[rank] += total
        else:
            shared += total
    return shared + max(per_rank, default=0)


class _Target:
    """What the ranks run: a package on onnxruntime, or a compile output through an executor."""

    def __init__(self, path: str | Path, executor: str | None = None) -> None:
        self.path = str(Path(path).resolve())
        self.build = executors.is_build_dir(Path(self.path))
        if self.build:
            summary, pkg = executors.read_build(self.path)
            self.executor = executor or "reference"
            if self.executor not in executors.BUILD_EXECUTORS:
                raise VlmcError(
                    f"unknown executor {self.executor!r}; choose one of {', '.join(executors.BUILD_EXECUTORS)}"
                )
            self.manifest = pkg.manifest
            self.root = Path(pkg.root)  # where the manifest's graph files are (the build's runtime package)
            self.plan = (summary.get("tensor_parallel") or {}).get("plan")
            if facts(self.manifest) is not None and self.plan is None:
                raise VlmcError(
                    f"{path}: compile.json has no tensor_parallel host plan; re-run `vlmc compile`"
                )
        else:
            if executor is not None:
                raise VlmcError(f"--executor applies to a compile output; {path} is a package")
            self.executor = "ort"
            self.manifest = Package.load(self.path).manifest
            self.root = Path(self.path)
            self.plan = None
        tp = facts(self.manifest)
        if tp is None:
            raise VlmcError(f"{path} is not tensor-parallel (no tensor_parallel section in its manifest)")
        self.size = int(tp["size"])
        # acl: each rank on the card its rank-table entry names; elsewhere no device.
        self.devices: list[int | None] = (
            executors.rank_devices(self.path, self.size) if self.executor == "acl" else [None] * self.size
        )

    def check(self, collective: collective_mod.Collective) -> None:
        """Everything the ranks need that may be absent here, named in one line before any rank starts."""
        absent = collective.missing()
        if not executors.available(self.executor):
            absent.append("acl (pyACL)")
        if self.executor == "acl" and absent:
            raise VlmcError(
                f"--executor acl on a tensor-parallel build runs each rank's .om files through pyACL and joins "
                f"the ranks with torch_npu's hccl backend, but {' and '.join(absent)} "
                f"{'does' if len(absent) == 1 else 'do'} not import here: install "
                "CANN (source set_env.sh) and the matching torch_npu (Ascend/pytorch), or run --executor reference"
            )
        collective.check()

    def open(self, rank: int, threads: int | None, all_reduce):
        """(RankDecoder, Pipeline) of one rank, in the rank's process."""
        if not self.build:
            pkg, executor = executors.open(self.path, threads=threads)
            decoder = RankDecoder(pkg.manifest, rank, all_reduce)
            return decoder, Pipeline(pkg, threads=threads, executor=executor, decoder=decoder)
        device = self.devices[rank] if self.devices[rank] is not None else 0
        pkg, executor = executors.open(self.path, self.executor, device, rank=rank)
        decoder = RankDecoder(pkg.manifest, rank, all_reduce, plan=self.plan)
        for step in self.plan:  # each segment step names exactly the builds the executor picks from
            if step["step"] != "segment":
                continue
            graph, named = step["graphs"][rank], set(step["builds"][rank].values())
            held = {b.name for b in executor.builds.get(graph, [])}
            if named != held:
                executor.close()
                raise VlmcError(
                    f"compile.json: the host plan names builds {sorted(named)} for {graph}, the build list "
                    f"has {sorted(held)}; re-run `vlmc compile`"
                )
        return decoder, Pipeline(pkg, executor=executor, decoder=decoder)


def _worker(
    target: _Target, rank: int, rendezvous: collective_mod.Rendezvous, threads: int | None, conn
) -> None:
    """A rank's process: join the group, open the package or build, then serve requests until told to stop."""
    # The forkserver's ranks start with SIGINT ignored (_start_forkserver); said again for a forkserver
    # started elsewhere. SIGTERM keeps its default: a rank someone terminates dies, and the parent names it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    collective = collective_mod.for_executor(target.executor)
    try:
        collective.join(rank, target.size, rendezvous, target.devices[rank])
        decoder, pipe = target.open(rank, threads, collective.all_reduce)
        conn.send(("ready", None))
    except BaseException as exc:  # the parent reports it as one line
        conn.send(_failure(exc))
        collective.close()
        conn.close()
        os._exit(0)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            method, args, kwargs = msg
            try:
                if method == "collectives":
                    result = decoder.collectives
                elif method == "backend":
                    result = collective.backend_in_use()
                elif method == "runs":
                    result = dict(getattr(pipe.executor, "runs", {}))
                elif method == "open":
                    new = args[0]
                    if new.size != target.size or new.executor != target.executor:
                        raise VlmcError(
                            f"{new.path} runs on {new.size} ranks with {new.executor}; the group has "
                            f"{target.size} with {target.executor}"
                        )
                    pipe.close()
                    target = new
                    decoder, pipe = target.open(rank, threads, collective.all_reduce)
                    result = None
                else:
                    result = getattr(pipe, method)(*args, **kwargs)
                conn.send(("ok", result))
            except BaseException as exc:
                conn.send(_failure(exc))
    except (EOFError, OSError):  # the parent is gone: nothing to answer
        pass
    finally:
        collective.close()
        conn.close()
        # Nothing is left to clean up, and tearing down torch's interpreter state takes seconds.
        os._exit(0)


# numpy's OpenBLAS (and an OpenMP runtime) size their thread pools from these when they load, and their
# idle threads spin: two ranks each spinning a pool the size of the machine starve each other at every
# all-reduce (measured on the reference executor, TP=2, 12 tokens: 10.4 s with the default pools, 2.1 s
# with one thread per rank). The forkserver process that the ranks fork from imports numpy, so they are
# set, where the user has not set them, while that process starts.
_BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def _blas_threads(threads: int):
    added = [name for name in _BLAS_THREAD_VARS if name not in os.environ]
    for name in added:
        os.environ[name] = str(threads)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _nothing() -> None:
    """The forkserver's first child (RankGroup._start)."""


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM wait (blocked) in this thread for the block's duration, then are delivered."""
    held = {signal.SIGINT, signal.SIGTERM}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _exit_with_parent() -> None:
    """In a rank: end the process when the parent is gone (killed, say), whatever the rank is doing."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="vlmc-parent-watch", daemon=True).start()


def _start_forkserver() -> None:
    """Start multiprocessing's forkserver (once per process) with SIGINT ignored.

    Ctrl-C reaches the whole foreground process group; the parent alone acts on it (it kills the ranks
    and exits 130). An ignored signal stays ignored across fork and exec, and Python then installs no
    KeyboardInterrupt handler, so the server, and every rank it forks, ignores SIGINT from its first
    instruction (a KeyboardInterrupt in the server while it imports torch would print a traceback and
    lose the ranks). SIGINT is blocked meanwhile, so one that comes in these microseconds waits and is
    then delivered to the parent."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _stop_forkserver() -> None:
    """Kill multiprocessing's forkserver and reap it, for an interrupted run: the parent is about to exit,
    and the server, while it still imports torch on a busy machine, would outlive it by seconds. The next
    RankGroup in this process (a library caller's) starts a new one. ``_stop`` is the module's own
    shutdown (CPython's tests use it); without it the server ends by itself when the parent is gone."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError, ChildProcessError):
        server._stop()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, VlmcError):
        return str(exc)
    logger.debug("".join(traceback.format_exception(exc)))
    return f"{type(exc).__name__}: {exc}"


def _failure(exc: BaseException) -> tuple[str, str]:
    """A rank's answer for a failure: ``peer`` when it only saw another rank go away, else ``error``."""
    return ("peer" if isinstance(exc, collective_mod.PeerLost) else "error", _describe(exc))


def _state(pid: int | None) -> str | None:
    """The process's state letter from /proc (R, S, T stopped, t traced, Z...), or None if it is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _death(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited (code {code})"
    return f"rank {rank} {how}"


class RankGroup:
    """The ranks of a tensor-parallel package or compile output, as processes joined by a collective.

    Start it once and send it several requests: process start and torch's import cost seconds.

    Example::

        with RankGroup("out/tiny-llava-tp2") as group:
            result = group.generate(["Describe the image."], [["demo"]], max_new_tokens=8)

        with RankGroup("out/tiny-llava-tp2-910b", executor="reference") as group:  # `vlmc run BUILD_DIR`
            ...
    """

    def __init__(self, package: str | Path, threads: int | None = None, executor: str | None = None) -> None:
        """
        Args:
            package: a tensor-parallel package, or a `vlmc compile` output of one.
            threads: onnxruntime threads per rank (default: the machine's cores shared out).
            executor: for a compile output, ``reference`` (default) or ``acl``; the collective follows
                from it (:func:`vlmc.runtime.collective.for_executor`).
        """
        import multiprocessing as mp

        target = self.preflight(package, executor)
        check_resources(target.size, _rank_weight_bytes(target.root, target.manifest, target.size))
        self.collective = collective_mod.for_executor(target.executor)
        self.path, self.size, self.executor = target.path, target.size, target.executor
        self.manifest = target.manifest  # what the ranks run (a build's runtime manifest)
        if threads is None:  # the ranks share the machine's cores
            threads = max(1, (os.cpu_count() or 1) // self.size)
        self.timeout = collective_mod.collective_timeout()
        address = collective_mod.bind_address()
        # forkserver, not fork: a forked onnxruntime or torch thread pool is not safe to use. The server
        # process imports torch and the runtime once, single-threaded, and forks every rank from there
        # (a spawned rank would import torch again, seconds each).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["torch.distributed", "onnxruntime", "vlmc.runtime.pipeline", "vlmc.runtime.executors.build"]
        )
        _start_forkserver()
        self._conns, self._procs = [], []
        # The rendezvous: a FileStore in a directory only this user can open, keys under a per-run secret.
        self._rendezvous_dir: str | None = tempfile.mkdtemp(prefix="vlmc-ranks-")
        rendezvous = collective_mod.Rendezvous(
            store=os.path.join(self._rendezvous_dir, "store"),
            secret=secrets.token_hex(16),
            address=address,
            timeout=self.timeout,
            start_timeout=_STARTUP_TIMEOUT_S,
        )
        try:
            with _blas_threads(threads):
                self._start(ctx, target, rendezvous, threads)
            logger.debug("ranks started: %s", [p.pid for p in self._procs])
            self._collect("start", timeout=_STARTUP_TIMEOUT_S)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: no process of ours outlives the parent
            self.close(kill=True)
            _stop_forkserver()
            raise
        except BaseException:  # a start that failed: no rank outlives it
            self.close(kill=True)
            raise

    def _start(self, ctx, target: _Target, rendezvous: collective_mod.Rendezvous, threads: int) -> None:
        # A first process that does nothing, started and awaited where a signal may interrupt: the wait
        # is the forkserver importing torch (seconds). Interrupted, that process exits by itself.
        probe = ctx.Process(target=_nothing, daemon=True)
        probe.start()
        probe.join()
        # Then each rank's start (a fork of the warm server, ms) with SIGINT and SIGTERM held, so the
        # parent learns every pid it must kill; a signal meanwhile is delivered right after.
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(target, rank, rendezvous, threads, child), daemon=True)
            self._conns.append(parent)
            self._procs.append(p)
            with _signals_held():
                p.start()
            child.close()

    def pids(self) -> list[int | None]:
        """The ranks' process ids, rank 0 first."""
        return [p.pid for p in self._procs]

    @staticmethod
    def preflight(package: str | Path, executor: str | None = None) -> _Target:
        """Read what the ranks would run and check that its collective and executor import here, without
        starting anything; raises a one-line VlmcError naming what is missing."""
        target = _Target(package, executor)
        target.check(collective_mod.for_executor(target.executor))
        return target

    def _collect(self, what: str, timeout: float | None = None) -> list:
        """Every rank's answer, rank 0 first.

        A rank that dies, or stays stopped (SIGSTOP) longer than the all-reduce timeout, ends the wait at
        once with one line naming it; what the other ranks then say (a lost peer) only goes to the debug
        log. When one rank fails otherwise, the others may be blocked in a collective waiting for it: they
        get :data:`_GRACE_S` to answer (a bad prompt fails on every rank alike), then the group is stopped.
        """
        from multiprocessing.connection import wait

        pending = dict(enumerate(self._conns))
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        lost: dict[int, str] = {}  # ranks that only saw another rank go away
        fatal: dict[int, str] = {}  # ranks that died or stopped
        stopped_since: dict[int, float] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        first_error = None
        while pending and not fatal:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                if not errors:
                    errors.update({r: f"rank {r} did not answer within {timeout:.0f} s" for r in pending})
                break
            if first_error is not None and now - first_error >= _GRACE_S:
                break
            sentinels = {self._procs[r].sentinel: r for r in pending}
            limit = _POLL_S if deadline is None else min(_POLL_S, deadline - now)
            ready = wait([*pending.values(), *sentinels], timeout=max(0.0, limit))
            answered = {
                next(r for r, c in pending.items() if c is conn) for conn in ready if conn in pending.values()
            }
            died = {sentinels[s] for s in ready if s in sentinels}
            for rank in sorted(answered | died):
                conn = pending.pop(rank)
                message = None
                if rank in answered or conn.poll():  # a rank may answer, then die
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        message = None
                if message is None:
                    self._procs[rank].join(timeout=1)
                    fatal[rank] = _death(rank, self._procs[rank].exitcode)
                    continue
                status, value = message
                if status == "ok" or status == "ready":
                    results[rank] = value
                elif status == "peer":
                    lost[rank] = f"rank {rank}: {value}"
                else:
                    errors[rank] = f"rank {rank}: {value}"
                if status not in ("ok", "ready") and first_error is None:
                    first_error = time.monotonic()
            now = time.monotonic()
            for rank in list(pending):
                if _state(self._procs[rank].pid) in ("T", "t"):
                    since = stopped_since.setdefault(rank, now)
                    if now - since >= self.timeout:
                        fatal[rank] = (
                            f"rank {rank} (pid {self._procs[rank].pid}) is stopped and has not run for "
                            f"{self.timeout:g} s"
                        )
                else:
                    stopped_since.pop(rank, None)
        if fatal or errors or lost:
            for rank in sorted(lost):
                logger.debug("%s", lost[rank])
            self.close(kill=bool(fatal or lost or pending))  # a rank still inside a collective: no wait
            if fatal:
                raise VlmcError(
                    f"tensor-parallel {what} failed: {'; '.join(fatal[r] for r in sorted(fatal))}"
                )
            if not errors:  # the failing ranks only lost a peer, and no rank is dead or stopped
                errors = {r: f"rank {r} did not answer" for r in pending} or lost
            messages = [errors[r] for r in sorted(errors)]
            first = messages[0].split(": ", 1)[-1]
            if len(errors) == self.size and all(m.split(": ", 1)[-1] == first for m in messages):
                raise VlmcError(first)  # every rank refused the same way (e.g. a bad prompt)
            raise VlmcError(f"tensor-parallel {what} failed: {'; '.join(messages)}")
        return [results[r] for r in range(self.size)]

    def call(self, method: str, *args, **kwargs) -> list:
        """Call ``Pipeline.<method>`` on every rank; returns each rank's result, rank 0 first."""
        if not self._conns:
            raise VlmcError("the rank group is closed")
        try:
            for conn in self._conns:
                conn.send((method, args, kwargs))
            return self._collect(method)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: no process of ours outlives the parent
            self.close(kill=True)
            _stop_forkserver()
            raise

    def open(self, package: str | Path) -> None:
        """Make the ranks run another package or build split over as many ranks, with the same executor
        (the processes and the group stay)."""
        target = _Target(package, None if self.executor == "ort" else self.executor)
        self.call("open", target)
        self.path, self.manifest = target.path, target.manifest

    def generate(self, prompts: list[str], images: list[list], max_new_tokens: int = 20):
        """Generate on every rank; returns rank 0's result after checking every rank produced the same tokens."""
        return self._agreed(self.call("generate", prompts, images, max_new_tokens))

    def generate_from(self, inputs, max_new_tokens: int = 20):
        """:meth:`Pipeline.generate_from` on every rank (prepared inputs, e.g. verify's); rank 0's result."""
        return self._agreed(self.call("generate_from", inputs, max_new_tokens))

    @staticmethod
    def _agreed(results: list):
        for rank, r in enumerate(results[1:], start=1):
            if r.tokens != results[0].tokens:
                raise VlmcError(
                    f"tensor-parallel ranks disagree: rank 0 generated {results[0].tokens}, rank {rank} {r.tokens}"
                )
        return results[0]

    def collectives(self) -> list[int]:
        """All-reduces each rank has run so far."""
        return self.call("collectives")

    def backends(self) -> list[str]:
        """The torch.distributed backend each rank's default group runs (``gloo``, ``hccl``)."""
        return self.call("backend")

    def runs(self) -> list[dict[str, int]]:
        """For a compile output: build -> executions so far, per rank."""
        return self.call("runs")

    def close(self, kill: bool = False) -> None:
        """Stop every rank and wait until it is gone. ``kill``: at once (SIGKILL; an interrupt, a dead or
        stopped rank), else ask each to stop, and kill what has not stopped within :data:`_CLOSE_S`."""
        procs = self._procs
        if not kill:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(None)
            deadline = time.monotonic() + _CLOSE_S
            for p in procs:
                with contextlib.suppress(ValueError, AssertionError):  # a process that never started
                    p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            # os.kill, not p.kill(): if the forkserver died, p.exitcode reads 255 while the rank may live.
            if p.pid is not None and _state(p.pid) not in (None, "Z"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(ValueError, AssertionError):
                p.join(timeout=_CLOSE_S)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if getattr(self, "_rendezvous_dir", None):
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(kill=exc_type is not None and not issubclass(exc_type, VlmcError))
