"""onnxruntime backend: the compiled form is the package itself, runnable here with `vlmc run`."""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path

from vlmc import ortsession
from vlmc.errors import CheckFailed, VlmcError
from vlmc.package import Package, _replace_dir, check_output_dir

logger = logging.getLogger(__name__)

NAME = "ort"
TARGET_OPTIONS = ()
BUILD_MARKER = "vlmc-build.json"


def compile(package: Package, out_dir: Path, target: dict | None = None, force: bool = False) -> dict:
    """Write ``out_dir/package`` (runnable with `vlmc run`) plus compile.json, atomically.

    Every graph is opened in an onnxruntime CPU session first, so a package that would fail at run
    time fails here.

    Args:
        package: the package (not modified; its on-disk location is kept).
        out_dir: the build directory to create.
        target: ``{"backend": "ort"}``; no other options exist.
        force: replace an existing vlmc build at ``out_dir``.
    """
    extra = [k for k in (target or {}) if k != "backend"]
    if extra:
        raise VlmcError(f"target (ort): unknown option {extra[0]!r}; the ort backend has no options")
    out_dir = Path(out_dir).resolve()
    check_output_dir(out_dir, force, marker=BUILD_MARKER)
    graphs = {}
    for name in package.graph_names:
        try:
            sess = ortsession.for_graph(package, name)
        except VlmcError:
            raise
        except Exception as exc:  # onnxruntime raises its own exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckFailed(f"ort: graph {name!r} does not load in onnxruntime: {first}") from exc
        graphs[name] = {
            "role": package.info(name)["role"],
            "precision": package.info(name).get("precision"),
            "providers": sess.get_providers(),
        }
    summary = {"backend": NAME, "package": "package", "graphs": graphs}
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    root = package.root
    try:
        tmp.mkdir()
        package.save(tmp / "package")
        (tmp / "compile.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        (tmp / BUILD_MARKER).write_text(
            json.dumps({"backend": NAME, "compile": "compile.json"}, indent=2) + "\n"
        )
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        # save() re-roots the package at the temporary directory, which is renamed away.
        package.root = root
    return summary
