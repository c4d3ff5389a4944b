"""Backends: lower a package into what a target compiler accepts and emit the build.

Each backend module exposes ``NAME``, ``TARGET_OPTIONS`` (typed like pass options) and
``compile(package, out_dir, target) -> dict`` (the compile.json summary).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from vlmc import outdir, pass_api
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

BACKENDS = {"ort": "vlmc.backends.ort", "ascend": "vlmc.backends.ascend"}
# Written into every build directory (compile output and `vlmc build`): --force replaces only such directories.
BUILD_MARKER = outdir.BUILD_MARKER


def get(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise VlmcError(f"unknown backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


@contextlib.contextmanager
def build_output(out_dir: Path, backend: str, summary: dict, force: bool = False) -> Iterator[Path]:
    """A temporary directory for a backend to fill that becomes ``out_dir`` atomically (:func:`vlmc.outdir.atomic`).

    After the body, ``compile.json`` (the summary, which the body may still fill in) and the build
    marker are written; if anything fails, ``out_dir`` is left as it was.
    """
    with outdir.atomic(out_dir, force) as tmp:
        yield tmp
        (tmp / "compile.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        (tmp / BUILD_MARKER).write_text(
            json.dumps({"backend": backend, "compile": "compile.json"}, indent=2) + "\n"
        )


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
