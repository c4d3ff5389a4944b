"""Backends: lower a package into what a target compiler accepts and emit the build.

Each backend module exposes ``NAME``, ``TARGET_OPTIONS`` (typed like pass options) and
``compile(package, out_dir, target) -> dict`` (the compile.json summary).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from vlmc import pass_api
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

BACKENDS = {"ort": "vlmc.backends.ort", "ascend": "vlmc.backends.ascend"}
# Written into every build directory (compile output and `vlmc build`): --force replaces only such directories.
BUILD_MARKER = "vlmc-build.json"


def get(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise VlmcError(f"unknown backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


@contextlib.contextmanager
def build_output(out_dir: Path, backend: str, summary: dict) -> Iterator[Path]:
    """A temporary sibling of ``out_dir`` for a backend to fill; then it becomes ``out_dir`` atomically.

    After the body, ``compile.json`` (the summary) and the build marker are written and the directory
    replaces ``out_dir``; if anything fails, it is removed and ``out_dir`` is left as it was.
    """
    from vlmc.package import _replace_dir

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        yield tmp
        (tmp / "compile.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        (tmp / BUILD_MARKER).write_text(
            json.dumps({"backend": backend, "compile": "compile.json"}, indent=2) + "\n"
        )
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def validate_target(target: Any, where: str = "target") -> dict:
    """Validate a recipe's ``target`` mapping for its backend; returns it with defaults filled."""
    if not isinstance(target, dict):
        raise VlmcError(f"{where}: must be a mapping with a 'backend' key ({', '.join(BACKENDS)})")
    backend = target.get("backend")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise VlmcError(f"{where}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    mod = get(backend)
    rest = {k: v for k, v in target.items() if k != "backend"}
    out = pass_api.validate(mod.TARGET_OPTIONS, rest, f"{where} ({backend})")
    check = getattr(mod, "check_target", None)
    if check is not None:
        check(out, where)
    return {"backend": backend, **out}


def target_schema() -> dict:
    variants = []
    for name in BACKENDS:
        mod = get(name)
        s = pass_api.schema_json(mod.TARGET_OPTIONS, getattr(mod, "__doc__", "") or "")
        s["properties"] = {"backend": {"const": name}, **s["properties"]}
        s["required"] = ["backend"]
        variants.append(s)
    return {"oneOf": variants}
