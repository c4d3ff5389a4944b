"""onnxruntime backend: the compiled form is the package itself, runnable here with `vlmc run`."""

from __future__ import annotations

import logging
from pathlib import Path

from vlmc import ortsession, outdir
from vlmc.backends import build_output
from vlmc.errors import CheckFailed, VlmcError
from vlmc.package import Package

logger = logging.getLogger(__name__)

NAME = "ort"
TARGET_OPTIONS = ()


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
    out_dir = Path(out_dir)  # not resolved: a symlink output is refused, never followed
    outdir.check(out_dir, force, source=package.root)
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
    with build_output(out_dir, NAME, summary, force=force) as tmp:
        package.save(tmp / "package", adopt=False)
    return summary
