"""vlmc build: export + optimize + compile (when the recipe names a target) into one directory."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from vlmc import backends, exporters, manager, memory, outdir, report, ui
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.recipe import Recipe

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _phase(phases: dict, name: str):
    """Time a build phase and record its peak RSS (report.json, read by `make bench`)."""
    t0 = time.perf_counter()
    with memory.peak() as p:
        yield
    phases[name] = {"seconds": round(time.perf_counter() - t0, 3), "peak_rss_bytes": p.bytes}


@dataclass
class BuildResult:
    package: Package
    output: Path
    compile: dict | None


def build(
    recipe: Recipe,
    output: str | Path,
    check: bool = False,
    force: bool = False,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> BuildResult:
    """Run the whole recipe; the output appears only when everything succeeded."""
    if not recipe.model:
        raise VlmcError(f"{recipe.source}: `vlmc build` needs a 'model' key in the recipe")
    out = Path(output).resolve()
    model_dir = [Path(recipe.model)] if Path(recipe.model).is_dir() else []
    outdir.check(out, force, inputs=model_dir)
    phases: dict[str, dict] = {}
    with _phase(phases, "load"), ui.progress(f"loading {recipe.model}"):
        source = exporters.load_source(
            recipe.model,
            trust_remote_code=trust_remote_code,  # the command line's only: a recipe cannot turn it on
            allow_pickle=allow_pickle,  # the command line's only, as trust_remote_code
            revision=recipe.export.get("revision"),
            lazy=True,
        )
    with outdir.atomic(out, force, inputs=model_dir) as tmp:
        # Exported graphs are written once, into a scratch directory beside the output (same
        # filesystem), and moved into the package when it is saved; passes read their weights from
        # there, memory-mapped, and only weights a pass replaces are ever held in memory.
        with _phase(phases, "export"):
            pkg = exporters.export(source, scratch=tmp / "scratch")
            del source  # frees the torch model: nothing else refers to it
        with _phase(phases, "passes"):
            pkg = manager.run(pkg, recipe.steps, check=check)
        with _phase(phases, "save"), ui.progress("saving the package"):
            pkg.save(tmp / "package")
            shutil.rmtree(tmp / "scratch", ignore_errors=True)
        compiled = None
        if recipe.target:
            with _phase(phases, "compile"), ui.progress(f"compiling for {recipe.target['backend']}"):
                compiled = backends.get(recipe.target["backend"]).compile(pkg, tmp / "build", recipe.target)
            pkg.report["compile"] = report.compile_summary(compiled)  # the ATC commands go into report.md
        pkg.report["build_phases"] = phases
        report.write(pkg, tmp / "package")
        (tmp / outdir.BUILD_MARKER).write_text(
            json.dumps(
                {
                    "recipe": recipe.to_dict(),
                    "package": "package",
                    "build": "build" if compiled is not None else None,
                },
                indent=2,
                sort_keys=True,
            )
            + "\n"
        )
    pkg.reroot(out / "package")
    return BuildResult(pkg, out, compiled)
