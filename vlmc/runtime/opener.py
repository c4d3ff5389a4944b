"""Open what a path holds for generation: a package, a compile output, or a tensor-parallel group of either.

:func:`open` is the one dispatch between the three (`vlmc run`, `vlmc serve`, verify): it returns a
:class:`vlmc.runtime.pipeline.Pipeline` (one process, its executor from :func:`vlmc.runtime.executors.open`)
or a started :class:`vlmc.runtime.ranks.RankGroup` (one process per rank). Both have ``manifest``,
``generate(prompts, images, max_new_tokens)`` and ``close()``. :func:`target` is its first half: what
the path is and which executor runs it, read and checked with nothing opened or started, for a caller
that refuses some requests before paying for a device or the ranks' processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import collective, executors
from vlmc.runtime.pipeline import Pipeline
from vlmc.runtime.ranks import RankGroup

logger = logging.getLogger(__name__)


class Target:
    """What a path runs as, read and checked; nothing opened yet.

    Attributes:
        path: the directory.
        build: True for a `vlmc compile` output (its builds run on ``executor``).
        executor: ``ort`` for a package, ``reference`` or ``acl`` for a compile output.
        package: the package (for a compile output, its runtime package: manifest and tokenizer).
        ranks: the tensor-parallel size when the path runs as a rank group, else None.
        device_id: the NPU of a one-process acl run.
    """

    def __init__(self, path: str | Path, executor: str | None = None, device_id: int = 0) -> None:
        self.path = Path(path)
        self.device_id = int(device_id)
        self.build = executors.is_build_dir(self.path)
        if self.build:
            self.executor = executor or executors.default()
            summary, self.package = executors.read_build(self.path)
            parallel = summary.get("tensor_parallel")
            if parallel and self.device_id != 0:
                raise VlmcError(
                    "--device-id: a tensor-parallel build runs each rank on the device its rank_table.json names"
                )
        else:
            if executor is not None:
                raise VlmcError(
                    f"--executor applies to a compile output; {self.path} is a package (run it without it)"
                )
            self.executor = "ort"
            self.package = Package.load(self.path)
            parallel = self.package.manifest.get("tensor_parallel")
        self.ranks: int | None = int(parallel["size"]) if parallel else None

    @property
    def manifest(self) -> dict:
        return self.package.manifest

    def start(
        self, threads: int | None = None, on_start: Callable[[str], None] | None = None
    ) -> Pipeline | RankGroup:
        """The Pipeline of a one-process run, or the started RankGroup of a tensor-parallel one.

        Args:
            threads: onnxruntime intra-op threads (per rank for a group).
            on_start: told, in one line, that the ranks are starting (after their preflight passed).
        """
        if self.ranks is not None:
            build_executor = self.executor if self.build else None
            RankGroup.preflight(self.path, build_executor)  # a missing torch / torch_npu / pyACL: one line
            if on_start is not None:
                backend = collective.for_executor(self.executor).backend
                what = f", each on the {self.executor} executor" if self.build else ""
                on_start(f"starting {self.ranks} ranks (torch.distributed, {backend}{what})")
            return RankGroup(self.path, threads=threads, executor=build_executor)
        if self.build:
            pkg, executor = executors.open(self.path, self.executor, self.device_id)
        else:  # the package is already read: not a second time
            pkg, executor = self.package, executors.OrtExecutor(self.package, threads)
        try:
            return Pipeline(pkg, threads=threads, executor=executor)
        except BaseException:
            executor.close()  # an open device session (acl) is released and acl.finalize reached
            raise


def target(path: str | Path, executor: str | None = None, device_id: int = 0) -> Target:
    """What ``path`` runs as (:class:`Target`), with nothing opened.

    Raises:
        VlmcError: the directory is neither a package nor a compile output, is broken, or the
            executor / device does not apply to it.
    """
    return Target(path, executor, device_id)


def open(
    path: str | Path,
    executor: str | None = None,
    device_id: int = 0,
    threads: int | None = None,
    on_start: Callable[[str], None] | None = None,
) -> Pipeline | RankGroup:
    """The runnable thing for a package, a compile output or a tensor-parallel group of either.

    Args:
        path: a package directory or what `vlmc compile --target ascend` wrote.
        executor: for a compile output, ``reference`` or ``acl`` (default: acl where pyACL imports).
        device_id: the NPU of a one-process acl run.
        threads: onnxruntime intra-op threads.
        on_start: see :meth:`Target.start`.

    Example::

        runnable = vlmc.runtime.open("out/demo-910b", executor="reference")
        try:
            result = runnable.generate(["Describe the image."], [["demo"]], max_new_tokens=8)
        finally:
            runnable.close()
    """
    return target(path, executor, device_id).start(threads, on_start)
