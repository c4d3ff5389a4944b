"""vlmc build: export + optimize + compile (when the recipe names a target) into one directory."""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from vlmc import exporters, manager
from vlmc import package as P
from vlmc.backends import BUILD_MARKER
from vlmc.errors import VlmcError
from vlmc.recipe import Recipe

logger = logging.getLogger(__name__)


@dataclass
class BuildResult:
    package: P.Package
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
    P.check_output_dir(out, force, marker=BUILD_MARKER)
    source = exporters.load_source(
        recipe.model,
        trust_remote_code=trust_remote_code or recipe.export.get("trust_remote_code", False),
        allow_pickle=allow_pickle or recipe.export.get("allow_pickle", False),
        revision=recipe.export.get("revision"),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        # Graphs wait on disk between steps (export stages, passes, save, compile), so only the graph
        # being worked on is resident, never all of them beside the source model or each other.
        pkg = exporters.export(source, staging=tmp / "staging")
        del source  # frees the torch model: nothing else refers to it
        pkg = manager.run(pkg, recipe.steps, check=check)
        pkg.save(tmp / "package")
        pkg.unstage()  # the saved package holds every graph now: read them from there
        shutil.rmtree(tmp / "staging")
        compiled = None
        if recipe.target:
            from vlmc import backends

            compiled = backends.get(recipe.target["backend"]).compile(pkg, tmp / "build", recipe.target)
            from vlmc import report

            pkg.report["compile"] = report.compile_summary(compiled)  # the ATC commands go into report.md
            report.write(pkg, tmp / "package")
        (tmp / BUILD_MARKER).write_text(
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
        P._replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pkg.root = out / "package"
    return BuildResult(pkg, out, compiled)
