"""Tensor-parallel runtime: one process per rank, joined by torch.distributed (gloo on CPU).

A package written by the ``tensor_parallel`` pass holds, for every rank, its decoder as segments cut at
the all-reduce points, and the host plan in ``tensor_parallel.plan`` (segment, all-reduce, segment, ...).
:class:`RankGroup` starts one process per rank; each runs the runtime's one generation loop
(:class:`vlmc.runtime.pipeline.Pipeline`) with a :class:`RankDecoder`, which runs the rank's segments and
calls ``torch.distributed.all_reduce`` between them, as the Ascend host calls ``HcclAllReduce`` between
``.om`` segments (hicann/hccl ``include/hccl.h``). The sum is the collective library's, never a sum
written here: the ranks are separate processes with separate memory.

Each rank keeps its own KV state (contiguous or paged) holding only its KV heads
(``tensor_parallel.kv_heads_per_rank``). Embedding, vision and the last segment (final norm, lm_head)
are replicated, so every rank computes the same logits and the same tokens; the group checks that.

torch is in the ``export`` extra: running a tensor-parallel package on CPU needs it for gloo.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# A rank waits this long in a collective for the others before it gives up (a crashed peer).
COLLECTIVE_TIMEOUT_S = 300
_STARTUP_TIMEOUT_S = 300

NEEDS_TORCH = (
    "running a tensor-parallel package on CPU needs torch (torch.distributed with the gloo backend joins "
    "the ranks); install the export extra: pip install 'vlmc[export]'"
)


def facts(manifest: dict) -> dict | None:
    """The manifest's tensor_parallel section, or None for an unsharded package."""
    return manifest.get("tensor_parallel") or None


def require_torch():
    """torch.distributed, or a one-line VlmcError saying why it is needed."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise VlmcError(NEEDS_TORCH) from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise VlmcError("this torch build has no gloo backend, which the tensor-parallel CPU runtime needs")
    return dist


class RankDecoder:
    """One rank's decoder: runs the host plan (segments, and all-reduces through ``all_reduce``)."""

    def __init__(self, manifest: dict, rank: int, all_reduce) -> None:
        tp = facts(manifest)
        if tp is None:
            raise VlmcError("the package is not tensor-parallel (no tensor_parallel section in vlmc.json)")
        if not 0 <= rank < int(tp["size"]):
            raise VlmcError(f"rank {rank} is outside the package's {tp['size']} ranks")
        self.tp = tp
        self.rank = rank
        self.all_reduce = all_reduce
        self.collectives = 0  # all-reduces run so far (the benchmark and tests read it)

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


def _worker(path: str, rank: int, size: int, port: int, threads: int | None, conn) -> None:
    """A rank's process: join the group, open the package, then serve requests until told to stop."""
    try:
        dist = require_torch()
        import torch

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        from vlmc.package import Package
        from vlmc.runtime.pipeline import Pipeline

        all_reduce = gloo_all_reduce(dist)

        def open_package(where: str):
            pkg = Package.load(where)
            decoder = RankDecoder(pkg.manifest, rank, all_reduce)
            if int(decoder.tp["size"]) != size:
                raise VlmcError(f"{where} is split over {decoder.tp['size']} ranks, the group has {size}")
            return decoder, Pipeline(pkg, threads=threads, decoder=decoder)

        decoder, pipe = open_package(path)
        conn.send(("ready", None))
    except BaseException as exc:  # the parent reports it as one line
        conn.send(("error", _describe(exc)))
        return
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            method, args, kwargs = msg
            try:
                if method == "collectives":
                    result = decoder.collectives
                elif method == "open":
                    decoder, pipe = open_package(*args)
                    result = None
                else:
                    result = getattr(pipe, method)(*args, **kwargs)
                conn.send(("ok", result))
            except BaseException as exc:
                conn.send(("error", _describe(exc)))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # the group may never have formed
            pass
        conn.close()
        # Nothing is left to clean up, and tearing down torch's interpreter state takes seconds.
        os._exit(0)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, VlmcError):
        return str(exc)
    logger.debug("".join(traceback.format_exception(exc)))
    return f"{type(exc).__name__}: {exc}"


class RankGroup:
    """The ranks of a tensor-parallel package, as processes joined by gloo; a context manager.

    Start it once and send it several requests: process start and torch's import cost seconds.

    Example::

        with RankGroup("out/tiny-llava-tp2") as group:
            result = group.generate(["Describe the image."], [["demo"]], max_new_tokens=8)
    """

    def __init__(self, package: str | Path, threads: int | None = None) -> None:
        import multiprocessing as mp

        from vlmc.package import Package

        require_torch()
        self.path = str(Path(package).resolve())
        manifest = Package.load(self.path).manifest
        tp = facts(manifest)
        if tp is None:
            raise VlmcError(f"{package} is not a tensor-parallel package")
        self.size = int(tp["size"])
        if threads is None:  # the ranks share the machine's cores
            threads = max(1, (os.cpu_count() or 1) // self.size)
        # forkserver, not fork: a forked onnxruntime or torch thread pool is not safe to use. The server
        # process imports torch and the runtime once, single-threaded, and forks every rank from there
        # (a spawned rank would import torch again, seconds each).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch.distributed", "onnxruntime", "vlmc.runtime.pipeline"])
        port = _free_port()
        self._conns, self._procs = [], []
        try:
            for rank in range(self.size):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_worker, args=(self.path, rank, self.size, port, threads, child), daemon=True
                )
                p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
            self._collect("start", timeout=_STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _collect(self, what: str, timeout: float | None = None) -> list:
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            if timeout is not None and not conn.poll(timeout):
                errors.append(f"rank {rank} did not answer within {timeout:.0f} s")
                continue
            try:
                status, value = conn.recv()
            except EOFError:
                errors.append(f"rank {rank} exited (code {self._procs[rank].exitcode})")
                continue
            if status == "error":
                errors.append(f"rank {rank}: {value}")
            results.append(value)
        if errors:
            self.close()
            first = errors[0].split(": ", 1)[-1]
            if all(e.split(": ", 1)[-1] == first for e in errors) and len(errors) == self.size:
                raise VlmcError(first)  # every rank refused the same way (e.g. a bad prompt)
            raise VlmcError(f"tensor-parallel {what} failed: {'; '.join(errors)}")
        return results

    def call(self, method: str, *args, **kwargs) -> list:
        """Call ``Pipeline.<method>`` on every rank; returns each rank's result, rank 0 first."""
        if not self._conns:
            raise VlmcError("the rank group is closed")
        for conn in self._conns:
            conn.send((method, args, kwargs))
        return self._collect(method)

    def open(self, package: str | Path) -> None:
        """Make the ranks run another package split over as many ranks (the processes and group stay)."""
        self.path = str(Path(package).resolve())
        self.call("open", self.path)

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
