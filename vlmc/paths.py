"""The one confinement rule for paths a package names (packages are untrusted input: docs/security.md).

Every reader and writer of a file a package names goes through :func:`inside`: graph files,
``weights_file``, ``text.tokenizer_file``, ``text.chat_template``, samples, pictures, ONNX external-data
locations and any path added later. A path is relative, and resolves (symlinks followed) inside the
package directory, or the package is refused with one line naming the manifest key (exit 2).
Files copied into an output go through :func:`regular_file`: a regular file resolving inside the
source package, never a symlink out of it, a FIFO or a device.

Limits: the check is made when the path is used, on the local filesystem; a package directory that
another process rewrites while vlmc reads it (a race) is outside the threat model.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from vlmc.errors import VlmcError

# A package-relative path: at most this many characters (a sanity bound, not a filesystem limit).
MAX_PATH_CHARS = 1024
# Text files a package carries (tokenizer JSON, chat template): larger ones are refused unread.
MAX_TEXT_BYTES = 64 * 1024 * 1024


def _refuse(where: str, key: str, rel: object, why: str) -> VlmcError:
    return VlmcError(f"{where}: {key} {rel!r} {why}; a package may only name files inside itself")


def check_relative(rel: object, key: str, where: str = "vlmc.json") -> str:
    """The lexical half of the rule (no filesystem access): a non-empty relative POSIX path without '..'."""
    if not isinstance(rel, str) or not rel:
        raise VlmcError(f"{where}: {key} must be a non-empty relative path, got {type(rel).__name__}")
    if len(rel) > MAX_PATH_CHARS or "\0" in rel or "\\" in rel:
        raise _refuse(where, key, rel[:80], "is not a plain relative path")
    p = PurePosixPath(rel)
    if p.is_absolute() or rel.startswith("~"):
        raise _refuse(where, key, rel, "is absolute")
    if ".." in p.parts:
        raise _refuse(where, key, rel, "climbs out with '..'")
    return rel


def inside(root: str | Path, rel: object, key: str, where: str = "vlmc.json") -> Path:
    """``root/rel`` resolved (symlinks followed); VlmcError naming ``key`` unless it stays inside ``root``."""
    check_relative(rel, key, where)
    base = Path(root).resolve()
    target = (base / str(rel)).resolve()
    if target != base and base not in target.parents:
        raise _refuse(where, key, rel, "resolves outside the package (a symlink?)")
    return target


def regular_file(root: str | Path, rel: object, key: str, where: str = "vlmc.json") -> Path:
    """:func:`inside`, and the target must be an existing regular file."""
    target = inside(root, rel, key, where)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        raise VlmcError(f"{where}: {key} {rel!r} is missing from the package; re-export it") from None
    except OSError as exc:
        raise VlmcError(f"{where}: {key} {rel!r} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise _refuse(where, key, rel, "is not a regular file")
    return target


def read_text(root: str | Path, rel: object, key: str, where: str = "vlmc.json") -> str:
    """A UTF-8 text file the package names, confined and bounded (MAX_TEXT_BYTES)."""
    target = regular_file(root, rel, key, where)
    size = target.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise VlmcError(f"{where}: {key} {rel!r} is {size} bytes, above the {MAX_TEXT_BYTES}-byte limit")
    try:
        return target.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VlmcError(f"{where}: {key} {rel!r} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise VlmcError(f"{where}: {key} {rel!r} cannot be read ({exc.strerror})") from None


def read_bytes(
    root: str | Path, rel: object, key: str, where: str = "vlmc.json", limit: int | None = None
) -> bytes:
    target = regular_file(root, rel, key, where)
    if limit is not None and target.stat().st_size > limit:
        raise VlmcError(f"{where}: {key} {rel!r} is larger than the {limit}-byte limit")
    try:
        return target.read_bytes()
    except OSError as exc:
        raise VlmcError(f"{where}: {key} {rel!r} cannot be read ({exc.strerror})") from None


def package_files(root: str | Path, where: str) -> list[tuple[str, Path]]:
    """Every file under a package as (relative name, resolved path), each checked by :func:`regular_file`.

    Directories are walked without following symlinks; a symlink to a file is allowed only if it
    resolves to a regular file inside ``root`` (it is then copied as that file's content); any other
    entry (a symlink out, a symlinked directory, a FIFO, a socket, a device) refuses the package.
    """
    base = Path(root).resolve()
    out = []
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        d = Path(dirpath)
        for name in sorted(dirnames):
            if (d / name).is_symlink():
                rel = (d / name).relative_to(base).as_posix()
                raise _refuse(where, "file", rel, "is a symlinked directory")
        for name in sorted(filenames):
            rel = (d / name).relative_to(base).as_posix()
            out.append((rel, regular_file(base, rel, "file", where)))
    return sorted(out)
