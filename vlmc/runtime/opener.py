"""Open what a path holds for generation: a package, a compile output, or a tensor-parallel group of either.

:func:`open` is the one dispatch between the three (`vlmc run`, `vlmc serve`): it returns a
:class:`vlmc.runtime.pipeline.Pipeline` (one process, its executor from :func:`vlmc.runtime.executors.open`)
or a started :class:`vlmc.runtime.ranks.RankGroup` (one process per rank). Both have ``manifest``,
``generate(prompts, images, max_new_tokens)``, ``generate_from(inputs, max_new_tokens)`` and
``close()``. :func:`target` is its first half: what the path is and which executor runs it, read and
checked with nothing opened or started, for a caller that refuses some requests before paying for a
device or the ranks' processes. :func:`prepare` gives the inputs the runtime feeds a package (ids,
mask, pixels), made on the host with nothing opened, for a caller that compares or records them
(`vlmc verify`) before running them with :func:`open`'s ``generate_from``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from vlmc.errors import VlmcError
from vlmc.outdir import BUILD_MARKER
from vlmc.package import Package
from vlmc.runtime import collective, executors
from vlmc.runtime.pipeline import Inputs, Pipeline
from vlmc.runtime.ranks import RankGroup

logger = logging.getLogger(__name__)

_MAX_ORT_MARKER_BYTES = 4096


class Target:
    """What a path runs as, read and checked; nothing opened yet.

    Attributes:
        path: the directory.
        build: True for a `vlmc compile --target ascend` output (its builds run on ``executor``).
        ort_build: True for a `vlmc compile --target ort` output (its lowered package runs on onnxruntime).
        executor: ``ort`` for a package, ``reference`` or ``acl`` for a compile output.
        package: the package (for a compile output, its runtime package: manifest and tokenizer).
        ranks: the tensor-parallel size when the path runs as a rank group, else None.
        device_id: the NPU of a one-process acl run.
    """

    def __init__(self, path: str | Path | Package, executor: str | None = None, device_id: int = 0) -> None:
        # A package already read is not read again; one changed in memory (its root None, or graphs not
        # saved) runs as it is in this process, but ranks run what its directory holds.
        given = path if isinstance(path, Package) else None
        self.path = Path(path if given is None else (given.root or "."))
        self.device_id = int(device_id)
        self.build = given is None and executors.is_build_dir(self.path)
        self.ort_build = False
        if given is not None:
            if executor is not None:
                raise VlmcError(f"--executor applies to a compile output; {self.path} is a package")
            self.executor = "ort"
            self.package = given
            parallel = given.manifest.get("tensor_parallel")
            if parallel and given.root is None:
                raise VlmcError(
                    "a tensor-parallel package runs as rank processes from its directory; save it first"
                )
        elif self.build:
            self.executor = executor or executors.default()
            summary, self.package = executors.read_build(self.path)
            parallel = summary.get("tensor_parallel")
            if parallel and self.device_id != 0:
                raise VlmcError(
                    "--device-id: a tensor-parallel build runs each rank on the device its rank_table.json names"
                )
        else:
            ort_package = ort_build_package(self.path)  # an ort compile output runs its lowered package
            self.ort_build = ort_package is not None
            if executor is not None:
                if self.ort_build:
                    raise VlmcError(
                        f"--executor applies to an ascend compile output; {self.path} runs on onnxruntime"
                    )
                raise VlmcError(
                    f"--executor applies to a compile output; {self.path} is a package (run it without it)"
                )
            self.executor = "ort"
            self.package = Package.load(ort_package or self.path)
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
            return RankGroup(
                self.path if self.build else self.package.root, threads=threads, executor=build_executor
            )
        if self.build:
            pkg, executor = executors.open(self.path, self.executor, self.device_id)
        else:  # the package is already read: not a second time
            pkg, executor = self.package, executors.OrtExecutor(self.package, threads)
        try:
            return Pipeline(pkg, threads=threads, executor=executor)
        except BaseException:
            executor.close()  # an open device session (acl) is released and acl.finalize reached
            raise


def ort_build_package(path: str | Path) -> Path | None:
    """The runnable package inside a `vlmc compile --target ort` output, or None if ``path`` is not one.

    Raises:
        VlmcError: ``path`` claims to be an ort build (its marker names ort) but is broken.
    """
    marker = Path(path) / BUILD_MARKER
    if not marker.is_file() or marker.is_symlink() or marker.stat().st_size > _MAX_ORT_MARKER_BYTES:
        return None
    try:
        claimed = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(claimed, dict) or claimed.get("backend") != "ort":
        return None
    pkg = Path(path) / "package"
    if pkg.is_symlink() or not pkg.is_dir():
        raise VlmcError(
            f"{path} is an ort compile output without its package/ directory; re-run `vlmc compile`"
        )
    return pkg


def target(path: str | Path | Package, executor: str | None = None, device_id: int = 0) -> Target:
    """What ``path`` runs as (:class:`Target`), with nothing opened.

    ``path`` may be a :class:`~vlmc.package.Package` already read (its directory is what runs).

    Raises:
        VlmcError: the directory is neither a package nor a compile output, is broken, or the
            executor / device does not apply to it.
    """
    return Target(path, executor, device_id)


def open(
    path: str | Path | Package,
    executor: str | None = None,
    device_id: int = 0,
    threads: int | None = None,
    on_start: Callable[[str], None] | None = None,
) -> Pipeline | RankGroup:
    """The runnable thing for a package, a compile output or a tensor-parallel group of either.

    Args:
        path: a package directory or what `vlmc compile --target ascend` wrote, or a package already
            read (:class:`~vlmc.package.Package`; a tensor-parallel one runs from its directory).
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


def prepare(pkg: Package, prompts: list[str], images: list[list]) -> Inputs:
    """The inputs the runtime feeds ``pkg`` for ``prompts`` and ``images`` (ids, mask, vision inputs).

    Made on the host from the manifest and the tokenizer; no graph, device or rank is opened, so it
    also serves a package variant that is never run (verify's unpruned inputs for the source model).
    Feed them to :func:`open`'s ``generate_from``.
    """
    return Pipeline(pkg).prepare(prompts, images)  # a Pipeline opens a session only when a graph runs
