"""Executors: what runs each graph of the runtime's one generation loop, and the one place that opens them.

The loop (:class:`vlmc.runtime.pipeline.Pipeline`) asks an executor which inputs a graph declares,
feeds them by name and reads the outputs by name (:class:`Executor`). What differs is what runs them:

- :mod:`.ort`: a package's graphs on onnxruntime CPU (:class:`OrtExecutor`);
- :mod:`.build`: a ``vlmc compile`` output's builds (:class:`BuildExecutor`: the gear choice, the
  padding and the dims vector), on a device: :mod:`.reference` (the lowered graphs on CPU, as strict as
  the .om) or :mod:`.acl` (the .om files through pyACL on a 910B).

:func:`open` is the one entry the runtime's openers use (:func:`vlmc.runtime.open`, each rank of a
:class:`vlmc.runtime.ranks.RankGroup`): a package or a compile output in, its package and executor out.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime.executors import acl, build
from vlmc.runtime.executors.build import (
    BuildExecutor,
    agreement,
    is_build_dir,
    open_build,
    rank_devices,
    read_build,
)
from vlmc.runtime.executors.ort import Executor, OrtExecutor

logger = logging.getLogger(__name__)

__all__ = [
    "BUILD_EXECUTORS",
    "BuildExecutor",
    "Executor",
    "OrtExecutor",
    "agreement",
    "available",
    "default",
    "is_build_dir",
    "open",
    "open_build",
    "rank_devices",
    "read_build",
]

# What runs a compile output's builds (`vlmc run BUILD_DIR --executor ...`); a package runs on "ort".
BUILD_EXECUTORS = build.EXECUTORS


def default() -> str:
    """The executor of a compile output when none is named: ``acl`` where pyACL imports, else ``reference``."""
    return build.default_executor()


def available(executor: str) -> bool:
    """True where ``executor`` can run here (only acl needs something that may be absent: pyACL)."""
    return acl.available() if executor == "acl" else True


def open(
    path: str | Path,
    executor: str | None = None,
    device_id: int = 0,
    rank: int | None = None,
    threads: int | None = None,
) -> tuple[Package, Executor]:
    """The package and the executor of a package directory or a compile output.

    Args:
        path: a package, or what `vlmc compile --target ascend` wrote.
        executor: for a compile output, ``reference`` or ``acl`` (default: :func:`default`); a package
            runs on onnxruntime, and naming an executor for it is an error.
        device_id: the NPU (acl only).
        rank: for a tensor-parallel compile output, the rank whose builds the executor holds.
        threads: onnxruntime intra-op threads (a package's graphs).

    Raises:
        VlmcError: the directory is neither, or is broken (the message says how).
    """
    path = Path(path)
    if is_build_dir(path):
        return open_build(path, executor or default(), device_id, rank=rank)
    if executor is not None:
        raise VlmcError(f"--executor applies to a compile output; {path} is a package (run it without it)")
    pkg = Package.load(path)
    return pkg, OrtExecutor(pkg, threads)
