"""Output directories: the one atomic writer every package, build and compile output goes through."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from vlmc import paths
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
    before = _identity(out)  # what --force was allowed to replace (None: nothing was there)
    made = _mkdirs(out.parent)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        _replace(tmp, out, before)
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


# renameat2(2) flags (include/uapi/linux/fs.h); https://man7.org/linux/man-pages/man2/rename.2.html
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _identity(p: Path) -> tuple[int, int] | None:
    """(device, inode) of what is at ``p`` (links not followed), or None when nothing is."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


@functools.cache
def _renameat2_fn():
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    except OSError:
        return None


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags): True when done, False where the kernel, filesystem or libc lacks it.

    Raises OSError for any other failure (EEXIST: ``dst`` exists under RENAME_NOREPLACE).
    """
    fn = _renameat2_fn()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _lost(out: Path, what: str) -> VlmcError:
    return VlmcError(
        f"output {out} {what} while vlmc was writing it (another writer?); it is left as it is and "
        "this run's output was discarded; run again"
    )


def _replace(tmp: Path, out: Path, before: tuple[int, int] | None) -> None:
    """Move tmp into place, replacing only what :func:`check` allowed: nothing, or the vlmc output ``before``.

    The target is checked again at the swap, and the swap itself is atomic so that nothing another
    process puts at ``out`` meanwhile is replaced: a concurrent writer loses cleanly (VlmcError; the
    caller removes its temporary directory). A plain rename(2) is not enough: it silently replaces an
    empty directory, and a check followed by a rename leaves a window between the two. So:

    - nothing was there: renameat2(RENAME_NOREPLACE) fails with EEXIST if anything appeared. Where
      renameat2 is missing (another OS, an old kernel or a filesystem without it), mkdir(out) claims
      the name exclusively first (it fails if anything is there) and rename(2) then replaces only
      that empty directory of ours (it fails with ENOTEMPTY if someone wrote into it);
    - a vlmc output was there (--force): renameat2(RENAME_EXCHANGE) swaps the two in one step, and
      what came out must be the very directory (device, inode) that was checked, else it is swapped
      back. Without renameat2 the old output is renamed aside, checked the same way, and put back if
      it is not the checked one. (A directory deleted and made again in between under the same
      inode number is not told apart; a writer that replaces by rename, as vlmc does, is.)
    """
    if before is None:
        try:
            if _renameat2(tmp, out, _RENAME_NOREPLACE):
                return
        except FileExistsError:
            raise _lost(out, "appeared") from None
        try:
            os.mkdir(out)
        except FileExistsError:
            raise _lost(out, "appeared") from None
        try:
            os.rename(tmp, out)
        except OSError:
            raise _lost(out, "was written into") from None
        return
    if _identity(out) != before or not (_is_marker(out / PACKAGE_MARKER) or _is_marker(out / BUILD_MARKER)):
        raise _lost(out, "changed")
    if _renameat2(tmp, out, _RENAME_EXCHANGE):
        if _identity(tmp) != before:  # replaced between the check and the exchange: undo the exchange
            _renameat2(tmp, out, _RENAME_EXCHANGE)
            raise _lost(out, "changed")
        shutil.rmtree(tmp, ignore_errors=True)  # the old output, now at tmp's name
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    if _identity(old) != before:
        os.rename(old, out)
        raise _lost(out, "changed")
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
