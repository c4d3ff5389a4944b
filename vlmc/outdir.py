"""Output directories: the one atomic writer every package, build and compile output goes through."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Files that mark a directory as a vlmc output, which --force may replace.
PACKAGE_MARKER = "vlmc.json"
BUILD_MARKER = "vlmc-build.json"


def check(out: Path, force: bool, source: Path | None = None) -> None:
    """Refuse to overwrite a directory unless --force and it is a previous vlmc output.

    With ``source`` (the input package), an output nested inside it or around it is refused too:
    writing there would change the input (or, with --force, delete it).
    """
    out = Path(out)
    if source is not None:
        src, dest = Path(source).resolve(), out.resolve()
        if src in dest.parents:
            raise VlmcError(
                f"output {out} is inside the input package {source}; choose a directory outside it"
            )
        if dest in src.parents or dest == src:
            raise VlmcError(
                f"output {out} contains the input package {source}; choose a directory outside it"
            )
    if not out.exists():
        return
    if not force:
        raise VlmcError(f"output {out} already exists; pass --force to replace it")
    if not out.is_dir() or not any((out / m).is_file() for m in (PACKAGE_MARKER, BUILD_MARKER)):
        raise VlmcError(
            f"output {out} exists and is not a vlmc output; refusing to replace it even with --force"
        )


@contextlib.contextmanager
def atomic(out: str | Path, force: bool = False, source: Path | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; on success it replaces ``out`` in one rename.

    If the body raises (an error, Ctrl-C, SIGTERM turned into an exception by the CLI), the temporary
    directory is removed and ``out`` is left exactly as it was. The body must write one of the marker
    files so that a later ``--force`` may replace the directory.
    """
    out = Path(out).resolve()
    check(out, force, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, out: Path) -> None:
    """Move tmp into place; an existing (vlmc) directory is swapped out and removed after."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def copy_file(src: Path, dest: Path) -> None:
    """Copy a file into an output: a copy-on-write clone where the filesystem can, else a kernel copy.

    Never a hard link: onnx.load and onnx.checker refuse external data files with more than one link
    (a hardlink-attack guard), so a hard-linked package would not open in users' own onnx code.
    """
    import fcntl

    ficlone = 0x40049409  # FICLONE: share extents (btrfs, xfs); filesystems without it raise
    with open(src, "rb") as s, open(dest, "wb") as d:
        try:
            fcntl.ioctl(d.fileno(), ficlone, s.fileno())
            return
        except OSError:
            pass
    shutil.copyfile(src, dest)  # sendfile/copy_file_range in the kernel on Linux
