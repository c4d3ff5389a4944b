"""Ascend backend: precheck, lower and plan a package into ATC builds (commands, configs, build.sh).

The work is split by stage: :mod:`.options` (the target schema), :mod:`.prepare` (everything planned
in memory) and :mod:`.write` (the build directory and compile.json). Running a compile output
(`vlmc run BUILD_DIR`) is the runtime's: :mod:`vlmc.runtime.executors.build`.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from vlmc import outdir
from vlmc.backends.ascend import soc
from vlmc.backends.ascend import write as writer
from vlmc.backends.ascend.options import (
    DEFAULT_SEQUENCE_BUCKETS,
    NAME,
    PRECISIONS,
    QUANTIZED_PRECISIONS,
    TARGET_OPTIONS,
    check_target,
    options,
)
from vlmc.backends.ascend.prepare import prepare
from vlmc.backends.ascend.write import paged_kv_host_write, run_builds
from vlmc.errors import CheckFailed
from vlmc.package import Package

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SEQUENCE_BUCKETS",
    "NAME",
    "PRECISIONS",
    "QUANTIZED_PRECISIONS",
    "TARGET_OPTIONS",
    "check_target",
    "compile",
    "options",
    "paged_kv_host_write",
    "prepare",
    "run_builds",
]


def compile(package: Package, out_dir: Path, target: dict, force: bool = False) -> dict:
    """Precheck, lower and plan every graph, then write the ATC build directory atomically.

    Nothing is written unless the precheck passes. With ``run`` and ``atc`` on PATH, ATC is run
    afterwards and its .om files collected.

    Args:
        package: the package to compile (it is not modified).
        out_dir: the build directory to create.
        target: target options (see TARGET_OPTIONS); a 'backend' key is ignored.
        force: replace an existing vlmc build at ``out_dir``.

    Returns:
        The compile.json summary.

    Raises:
        VlmcError: bad options, an unresolvable dim or an impossible gear plan.
        CheckFailed: the precheck or the lowering failed; the message names the nodes.
    """
    opts = options(target)
    out_dir = Path(out_dir)  # not resolved: a symlink output is refused, never followed
    outdir.check(out_dir, force, source=package.root)
    resolution = soc.resolve(opts["soc"], opts.get("soc_variant"))
    # The lowering's deploy-form weights are written here as they are made (beside the output, so
    # on its disk, not in a RAM-backed /tmp), streamed into the build, and removed.
    with tempfile.TemporaryDirectory(prefix=".vlmc-lower-", dir=_existing_parent(out_dir)) as scratch:
        plan = prepare(package, opts, resolution.soc_version, scratch=Path(scratch))
        summary = writer.summary(package, opts, resolution, plan)
        writer.write(out_dir, plan, summary, force, package)
        del plan["files"]  # close the lowered graphs' maps of the scratch file before it goes
    if opts["run"]:
        summary["run"] = run_builds(out_dir, plan["commands"])
        (out_dir / "compile.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        failed = [n for n, r in summary["run"]["builds"].items() if r["status"] != "ok"]
        if failed:
            r = summary["run"]["builds"][failed[0]]
            first = r["errors"][0] if r["errors"] else "see the log"
            raise CheckFailed(f"ATC failed for {failed[0]}: {first} (log: {r['log']})")
    return summary


def _existing_parent(path: Path) -> Path:
    """The nearest directory above ``path`` that exists (compile creates the rest)."""
    p = path.absolute().parent
    while not p.is_dir():
        p = p.parent
    return p
