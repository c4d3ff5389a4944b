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

import fnmatch
import json
import os
import stat
from pathlib import Path, PurePosixPath

from vlmc.errors import VlmcError

# A package-relative path: at most this many characters (a sanity bound, not a filesystem limit).
MAX_PATH_CHARS = 1024
# Text files a package carries (tokenizer JSON, chat template): larger ones are refused unread.
MAX_TEXT_BYTES = 64 * 1024 * 1024


def _refuse(where: str, key: str, rel: object, why: str, owner: str = "a package") -> VlmcError:
    return VlmcError(f"{where}: {key} {rel!r} {why}; {owner} may only name files inside itself")


def check_relative(rel: object, key: str, where: str = "vlmc.json", owner: str = "a package") -> str:
    """The lexical half of the rule (no filesystem access): a non-empty relative POSIX path without '..'."""
    if not isinstance(rel, str) or not rel:
        raise VlmcError(f"{where}: {key} must be a non-empty relative path, got {type(rel).__name__}")
    if len(rel) > MAX_PATH_CHARS or "\0" in rel or "\\" in rel:
        raise _refuse(where, key, rel[:80], "is not a plain relative path", owner)
    p = PurePosixPath(rel)
    if p.is_absolute() or rel.startswith("~"):
        raise _refuse(where, key, rel, "is absolute", owner)
    if ".." in p.parts:
        raise _refuse(where, key, rel, "climbs out with '..'", owner)
    return rel


def inside(
    root: str | Path, rel: object, key: str, where: str = "vlmc.json", fence: str | Path | None = None
) -> Path:
    """``root/rel`` resolved (symlinks followed); VlmcError naming ``key`` unless it stays inside ``root``.

    ``fence``: the directory the target must stay in when it is wider than ``root`` (a model
    directory in the Hugging Face cache: :func:`model_fence`); the message then speaks of a model.
    """
    check_relative(rel, key, where, "a package" if fence is None else "a model directory")
    base = Path(root).resolve()
    wall = base if fence is None else Path(fence).resolve()
    target = (base / str(rel)).resolve()
    if target != wall and wall not in target.parents:
        if fence is None:
            raise _refuse(where, key, rel, "resolves outside the package (a symlink?)")
        raise _refuse(where, key, rel, f"resolves outside {wall} (a symlink?)", "a model directory")
    return target


def regular_file(
    root: str | Path, rel: object, key: str, where: str = "vlmc.json", fence: str | Path | None = None
) -> Path:
    """:func:`inside`, and the target must be an existing regular file."""
    target = inside(root, rel, key, where, fence)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        if fence is not None:
            raise VlmcError(f"{where}: {key} {rel!r} is missing from the model directory") from None
        raise VlmcError(f"{where}: {key} {rel!r} is missing from the package; re-export it") from None
    except OSError as exc:
        raise VlmcError(f"{where}: {key} {rel!r} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        owner = "a package" if fence is None else "a model directory"
        raise _refuse(where, key, rel, "is not a regular file", owner)
    return target


def read_text(
    root: str | Path, rel: object, key: str, where: str = "vlmc.json", fence: str | Path | None = None
) -> str:
    """A UTF-8 text file the package (or model directory, with ``fence``) names, confined and bounded
    (MAX_TEXT_BYTES)."""
    target = regular_file(root, rel, key, where, fence)
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
    root: str | Path,
    rel: object,
    key: str,
    where: str = "vlmc.json",
    limit: int | None = None,
    fence: str | Path | None = None,
) -> bytes:
    target = regular_file(root, rel, key, where, fence)
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


# ---- model directories (`vlmc export DIR`, a hub snapshot): untrusted like packages ----------------------------

# What vlmc or transformers may open in a model directory: the patterns `vlmc export ORG/NAME` downloads, pickle
# weights and model code. Each must be a regular file inside the model's fence (model_fence).
MODEL_FILE_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.model",
    "*.txt",
    "*.jinja",
    "*.bin",
    "*.pt",
    "*.py",
    "*.tiktoken",
)
# Subdirectories transformers reads files from (named chat templates, transformers >= 4.54).
_MODEL_SUBDIRS = ("additional_chat_templates",)
# Weights are memory-mapped or streamed, never read whole; every other model file is bounded by MAX_TEXT_BYTES.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
# The files a tokenizer's or processor's own code is declared in (transformers' ``auto_map``), and the auto
# classes that load it (config.json's auto_map may name them beside the model's classes).
_CODE_DECLARING = (
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "config.json",
)
_PROCESSING_CLASSES = (
    "AutoTokenizer",
    "AutoProcessor",
    "AutoImageProcessor",
    "AutoVideoProcessor",
    "AutoFeatureExtractor",
)


def model_fence(directory: str | Path) -> Path:
    """The directory a model directory's files must resolve inside.

    A local directory is its own fence. A Hugging Face cache snapshot, ``models--org--name/snapshots/<rev>``,
    holds links to ``../../blobs/<sha>`` (https://huggingface.co/docs/huggingface_hub/guides/manage-cache):
    its fence is the repo's cache folder ``models--org--name``, never wider.
    """
    d = Path(directory).resolve()
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        return d.parent.parent
    return d


def model_files(directory: str | Path) -> list[Path]:
    """Every file of a model directory vlmc or transformers may open, resolved, each checked first.

    A file matching MODEL_FILE_PATTERNS (top level, or in additional_chat_templates/) must be a regular file
    resolving inside :func:`model_fence` (no link out, FIFO, device or directory), and, unless it is weights,
    at most MAX_TEXT_BYTES; anything else refuses the directory in one line naming the file (exit 2).
    """
    base = Path(directory)
    fence = model_fence(base)
    where = str(base)
    out = []
    for sub in ("", *_MODEL_SUBDIRS):
        if sub and not os.path.lexists(base / sub):
            continue
        if sub and not inside(base, sub, "directory", where, fence).is_dir():
            raise _refuse(where, "directory", sub, "is not a directory", "a model directory")
        for entry in sorted(os.listdir(base / sub)):
            if not any(fnmatch.fnmatchcase(entry, p) for p in MODEL_FILE_PATTERNS):
                continue
            rel = f"{sub}/{entry}" if sub else entry
            target = regular_file(base, rel, "file", where, fence)
            size = target.stat().st_size
            if not entry.endswith(_WEIGHT_SUFFIXES) and size > MAX_TEXT_BYTES:
                raise VlmcError(
                    f"{where}: file {rel!r} is {size} bytes, above the {MAX_TEXT_BYTES}-byte limit"
                )
            out.append(target)
    return out


def model_bytes(directory: str | Path, name: str, limit: int = MAX_TEXT_BYTES) -> bytes | None:
    """A model directory's file ``name`` (confined to its fence, regular, bounded), or None when it has none."""
    base = Path(directory)
    if not os.path.lexists(base / name):
        return None
    return read_bytes(base, name, "file", str(base), limit, model_fence(base))


def model_json(directory: str | Path, name: str) -> dict | None:
    """A model directory's JSON file as a mapping (None when absent); one line naming it when it is not one."""
    data = model_bytes(directory, name)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        why = str(exc).splitlines()[0][:120] if isinstance(exc, ValueError) else "nested too deeply"
        raise VlmcError(f"{Path(directory) / name}: not valid JSON ({why})") from None
    if not isinstance(value, dict):
        raise VlmcError(f"{Path(directory) / name}: must be a JSON object, got {type(value).__name__}")
    return value


def custom_code(directory: str | Path) -> str | None:
    """The first file of a model directory (or a package's ``source/``) whose ``auto_map`` gives the tokenizer
    or processor its own code (which transformers runs only with trust_remote_code); None when none does."""
    for name in _CODE_DECLARING:
        auto_map = (model_json(directory, name) or {}).get("auto_map")
        if isinstance(auto_map, dict) and any(k in auto_map for k in _PROCESSING_CLASSES):
            return name
        if auto_map and not isinstance(auto_map, dict):  # a list in old tokenizer configs: the tokenizer's
            return name
    return None
