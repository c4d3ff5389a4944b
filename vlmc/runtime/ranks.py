"""Tensor-parallel runtime: one process per rank, joined by a collective library (gloo on CPU, HCCL on cards).

A package written by the ``tensor_parallel`` pass holds, for every rank, its decoder as segments cut at
the all-reduce points, and the host plan in ``tensor_parallel.plan`` (segment, all-reduce, segment, ...).
:class:`RankGroup` starts one process per rank; each runs the runtime's one generation loop
(:class:`vlmc.runtime.pipeline.Pipeline`) with a :class:`RankDecoder`, which runs the rank's segments and
calls the collective's all-reduce between them, as the Ascend host calls ``HcclAllReduce`` between
``.om`` segments (hicann/hccl ``include/hccl.h``). The sum is the collective library's, never a sum
written here: the ranks are separate processes with separate memory.

What a rank runs is either the package's graphs on onnxruntime or a ``vlmc compile`` output's builds
(``vlmc run BUILD_DIR``): then every rank opens the build with :func:`runner.open_build` restricted to its
rank's builds, and follows compile.json's host plan. The collective is chosen from what runs the segments
(:mod:`vlmc.runtime.collective`): gloo for onnxruntime and the reference executor, torch_npu's hccl for acl.

Each rank keeps its own KV state (contiguous or paged) holding only its KV heads
(``tensor_parallel.kv_heads_per_rank``). Embedding, vision and the last segment (final norm, lm_head)
are replicated, so every rank computes the same logits and the same tokens; the group checks that.

torch is in the ``export`` extra: running a tensor-parallel package on CPU needs it for gloo.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import traceback
from pathlib import Path

import numpy as np

from vlmc.errors import VlmcError
from vlmc.runtime import collective as collective_mod
from vlmc.runtime.collective import COLLECTIVE_TIMEOUT_S, NEEDS_TORCH, require_torch  # noqa: F401

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 300
# After one rank failed, how long the others get to report before the group is stopped.
_GRACE_S = 10.0


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


def gloo_all_reduce(dist):
    """A sum all-reduce over the default process group (gloo), numpy in, numpy out."""
    import torch

    def all_reduce(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(x).copy())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.numpy()

    return all_reduce


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Target:
    """What the ranks run: a package on onnxruntime, or a compile output through an executor."""

    def __init__(self, path: str | Path, executor: str | None = None) -> None:
        from vlmc.backends.ascend import runner
        from vlmc.package import Package

        self.path = str(Path(path).resolve())
        self.build = runner.is_build_dir(Path(self.path))
        if self.build:
            summary, pkg = runner.read_build(self.path)
            self.executor = executor or "reference"
            if self.executor not in runner.EXECUTORS:
                raise VlmcError(
                    f"unknown executor {self.executor!r}; choose one of {', '.join(runner.EXECUTORS)}"
                )
            self.manifest = pkg.manifest
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
            self.plan = None
        tp = facts(self.manifest)
        if tp is None:
            raise VlmcError(f"{path} is not tensor-parallel (no tensor_parallel section in its manifest)")
        self.size = int(tp["size"])
        # acl: each rank on the card its rank-table entry names; elsewhere no device.
        self.devices: list[int | None] = (
            runner.rank_devices(self.path, self.size) if self.executor == "acl" else [None] * self.size
        )

    def check(self, collective: collective_mod.Collective) -> None:
        """Everything the ranks need that may be absent here, named in one line before any rank starts."""
        absent = collective.missing()
        if self.executor == "acl":
            from vlmc.backends.ascend import acl_device

            if not acl_device.available():
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
        from vlmc.runtime.pipeline import Pipeline

        if self.build:
            from vlmc.backends.ascend import runner

            device = self.devices[rank] if self.devices[rank] is not None else 0
            pkg, executor = runner.open_build(self.path, self.executor, device, rank=rank)
            decoder = RankDecoder(pkg.manifest, rank, all_reduce, plan=self.plan)
            for step in self.plan:  # each segment step names exactly the builds the executor picks from
                if step["step"] != "segment":
                    continue
                graph, named = step["graphs"][rank], set(step["builds"][rank].values())
                held = {b.name for b in executor.builds.get(graph, [])}
                if named != held:
                    raise VlmcError(
                        f"compile.json: the host plan names builds {sorted(named)} for {graph}, the build list "
                        f"has {sorted(held)}; re-run `vlmc compile`"
                    )
            return decoder, Pipeline(pkg, executor=executor, decoder=decoder)
        from vlmc.package import Package

        pkg = Package.load(self.path)
        decoder = RankDecoder(pkg.manifest, rank, all_reduce)
        return decoder, Pipeline(pkg, threads=threads, decoder=decoder)


def _worker(target: _Target, rank: int, port: int, threads: int | None, conn) -> None:
    """A rank's process: join the group, open the package or build, then serve requests until told to stop."""
    collective = collective_mod.for_executor(target.executor)
    try:
        collective.join(rank, target.size, port, target.devices[rank])
        decoder, pipe = target.open(rank, threads, collective.all_reduce)
        conn.send(("ready", None))
    except BaseException as exc:  # the parent reports it as one line
        conn.send(("error", _describe(exc)))
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
                conn.send(("error", _describe(exc)))
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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, VlmcError):
        return str(exc)
    logger.debug("".join(traceback.format_exception(exc)))
    return f"{type(exc).__name__}: {exc}"


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
        self.collective = collective_mod.for_executor(target.executor)
        self.path, self.size, self.executor = target.path, target.size, target.executor
        if threads is None:  # the ranks share the machine's cores
            threads = max(1, (os.cpu_count() or 1) // self.size)
        # forkserver, not fork: a forked onnxruntime or torch thread pool is not safe to use. The server
        # process imports torch and the runtime once, single-threaded, and forks every rank from there
        # (a spawned rank would import torch again, seconds each).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["torch.distributed", "onnxruntime", "vlmc.runtime.pipeline", "vlmc.backends.ascend.runner"]
        )
        port = _free_port()
        self._conns, self._procs = [], []
        try:
            with _blas_threads(threads):
                self._start(ctx, target, port, threads)
            self._collect("start", timeout=_STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _start(self, ctx, target: _Target, port: int, threads: int) -> None:
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(target, rank, port, threads, child), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)

    @staticmethod
    def preflight(package: str | Path, executor: str | None = None) -> _Target:
        """Read what the ranks would run and check that its collective and executor import here, without
        starting anything; raises a one-line VlmcError naming what is missing."""
        target = _Target(package, executor)
        target.check(collective_mod.for_executor(target.executor))
        return target

    def _collect(self, what: str, timeout: float | None = None) -> list:
        """Every rank's answer, rank 0 first. When one rank fails, the others may be blocked in a
        collective waiting for it: they get :data:`_GRACE_S` to answer (a bad prompt fails on every rank
        alike), then the group is stopped instead of waiting out the collective's timeout."""
        from multiprocessing.connection import wait

        pending = dict(enumerate(self._conns))
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            limit = None if deadline is None else max(0.0, deadline - time.monotonic())
            if errors:
                limit = _GRACE_S if limit is None else min(limit, _GRACE_S)
            ready = wait(list(pending.values()), timeout=limit)
            if not ready:
                if not errors:
                    errors.update({r: f"rank {r} did not answer within {timeout:.0f} s" for r in pending})
                break
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value = conn.recv()
                except EOFError:
                    errors[rank] = f"rank {rank} exited (code {self._procs[rank].exitcode})"
                    continue
                if status == "error":
                    errors[rank] = f"rank {rank}: {value}"
                else:
                    results[rank] = value
        if errors:
            self.close()
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
        for conn in self._conns:
            conn.send((method, args, kwargs))
        return self._collect(method)

    def open(self, package: str | Path) -> None:
        """Make the ranks run another package or build split over as many ranks, with the same executor
        (the processes and the group stay)."""
        target = _Target(package, None if self.executor == "ort" else self.executor)
        self.path = target.path
        self.call("open", target)

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

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
