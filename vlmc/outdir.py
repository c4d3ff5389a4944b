"""Output directories: the one atomic writer every package, build and compile output goes through."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Files that mark a directory as a vlmc output, which --force may replace.
PACKAGE_MARKER = "vlmc.json"
BUILD_MARKER = "vlmc-build.json"


def check(out: Path, force: bool, source: Path | None = None, inputs: Iterable[Path] = ()) -> None:
    """Refuse to overwrite a directory unless --force and it is a previous vlmc output.

    With ``source`` (the input package) or ``inputs`` (other input directories: a model directory), an
    output nested inside one or around one is refused too: writing there would change the input (or,
    with --force, delete it). A symbolic link as the output is always refused, dangling or not: vlmc
    never writes through a link, and --force never replaces what one points at.
    """
    out = Path(out)
    sources = [(source, "input package")] + [(i, "input directory") for i in inputs]
    if out.is_symlink():
        raise VlmcError(
            f"output {out} is a symbolic link; vlmc does not write through links, name a real directory"
        )
    dest = _resolved(out)
    for s, what in sources:
        if s is None:
            continue
        src = Path(s).resolve()
        if src in dest.parents:
            raise VlmcError(f"output {out} is inside the {what} {s}; choose a directory outside it")
        if dest in src.parents or dest == src:
            raise VlmcError(f"output {out} contains the {what} {s}; choose a directory outside it")
    if not out.exists():
        return
    if not force:
        raise VlmcError(f"output {out} already exists; pass --force to replace it")
    if not out.is_dir() or not any(_is_marker(out / m) for m in (PACKAGE_MARKER, BUILD_MARKER)):
        raise VlmcError(
            f"output {out} exists and is not a vlmc output; refusing to replace it even with --force"
        )


def _is_marker(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def _resolved(out: Path) -> Path:
    """The output's path with its parent's links resolved, the last component kept as named."""
    out = Path(out)
    return out.parent.resolve() / out.name


@contextlib.contextmanager
def atomic(
    out: str | Path, force: bool = False, source: Path | None = None, inputs: Iterable[Path] = ()
) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; on success it replaces ``out`` in one rename.

    If the body raises (an error, Ctrl-C, SIGTERM turned into an exception by the CLI, a full disk),
    the temporary directory is removed, and so are the parent directories this call created, so
    ``out`` and its surroundings are left exactly as they were. The body must write one of the
    marker files so that a later ``--force`` may replace the directory.
    """
    check(Path(out), force, source, inputs)
    out = _resolved(Path(out))
    made = _mkdirs(out.parent)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()  # only if still empty
        raise


def _mkdirs(d: Path) -> list[Path]:
    """mkdir -p, returning the directories it created (outermost first)."""
    missing = []
    while not d.exists():
        missing.append(d)
        d = d.parent
    made = []
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:
            continue
        except BaseException:
            for x in reversed(made):
                with contextlib.suppress(OSError):
                    x.rmdir()
            raise
        made.append(m)
    return made


def write_file(root: str | Path, rel: str, data: bytes | str) -> Path:
    """Write one file into an existing vlmc directory (verify's report), atomically and never through a link.

    The bytes go to a fresh temporary file beside the target (created exclusively, links not followed),
    which is then renamed over the target: a symlink at the target is replaced, never written through,
    and a failed write leaves the old file as it was.
    """
    from vlmc import paths

    root = Path(root)
    paths.check_relative(rel, rel, str(root))
    target = root.resolve() / rel
    if target.parent.resolve() != target.parent or not target.parent.is_dir():
        raise VlmcError(f"{root}: {rel} would be written through a link or outside the directory")
    blob = data.encode() if isinstance(data, str) else data
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


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
