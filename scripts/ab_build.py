"""`vlmc build` of two versions of vlmc side by side: alternating runs, medians and their ratio.

    python scripts/ab_build.py --before REV [--after REV] [--recipe FILE | --plain] [--runs 3] [--scratch DIR]

Each revision is checked out into a temporary git worktree and run from there (PYTHONPATH), with
this checkout's venv; ``--after`` defaults to this working tree as it is. Builds alternate
(before, after, before, ...) so that both sides see the same machine load, and each is measured
by scripts/_measure.py (wall time, exact peak RSS of the process tree). Without ``--recipe`` the
build is the 512 M scale row of `make bench` (bench.py --only-scale): LLaVA-1.5 widths, random
weights, the issue-20 quantized recipe, Ascend910B4; ``--plain`` builds that checkpoint with the plain
recipe instead (fold_constants, simplify, the same target).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

import bench  # noqa: E402  (a sibling script)

PLAIN_PASSES = "passes: [fold_constants, simplify]\n"  # bench.py's pipeline-cost recipe


def _tree(rev: str | None, root: Path, name: str) -> Path:
    """A checkout of ``rev`` under ``root`` (None: this working tree)."""
    if rev is None:
        return REPO
    path = root / name
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    (path / "vlmc" / "passes").symlink_to("../passes")  # as the editable install maps vlmc.passes
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision of the first side")
    ap.add_argument("--after", help="git revision of the second side (default: this working tree)")
    ap.add_argument("--recipe", type=Path, help="recipe file with its model (default: the 512 M scale row)")
    ap.add_argument(
        "--plain", action="store_true", help="the 512 M row's checkpoint with fold_constants, simplify only"
    )
    ap.add_argument("--runs", type=int, default=3, help="builds per side")
    ap.add_argument("--scratch", type=Path, help="where checkpoints, trees and builds go")
    args = ap.parse_args()
    vlmc = str(Path(sys.executable).parent / "vlmc")
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        root = Path(tmp)
        recipe = args.recipe
        if recipe is None:
            model_dir, _ = bench.make_model_dir("llava-1.5", root)
            recipe = root / "recipe.yaml"
            passes = PLAIN_PASSES if args.plain else bench.QUANT_PASSES
            recipe.write_text(f"model: {model_dir}\n" + passes + bench.SCALE_TARGET)
        trees = {"before": _tree(args.before, root, "before"), "after": _tree(args.after, root, "after")}
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        try:
            for i in range(args.runs):
                for side, tree in trees.items():
                    os.environ["PYTHONPATH"] = str(tree)
                    cmd = [vlmc, "build", "--recipe", str(recipe), "-o", str(root / f"out-{side}"), "--force"]
                    r = bench.measure(cmd, disk=root)
                    r["load_average"] = bench._load_average()
                    runs[side].append(r)
                    print(
                        f"{side} {i + 1}: {r['seconds']:.1f} s, peak {r['peak_rss_bytes']:,} B, "
                        f"load {r['load_average']}",
                        flush=True,
                    )
        finally:
            for side, rev in (("before", args.before), ("after", args.after)):
                if rev is not None:
                    subprocess.run(
                        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees[side])]
                    )
    med = {
        side: (
            statistics.median(r["seconds"] for r in rs),
            statistics.median(r["peak_rss_bytes"] for r in rs),
        )
        for side, rs in runs.items()
    }
    print(f"\n| | `vlmc build` s ({args.runs} runs) | median | peak RSS B | median |")
    print("|---|---|---|---|---|")
    for side, rs in runs.items():
        secs = " / ".join(f"{r['seconds']:.1f}" for r in rs)
        peaks = " / ".join(f"{r['peak_rss_bytes']:,}" for r in rs)
        print(f"| {side} | {secs} | {med[side][0]:.1f} | {peaks} | {med[side][1]:,} |")
    t, m = med["after"][0] / med["before"][0], med["after"][1] / med["before"][1]
    print(f"\nafter / before: time {t:.3f}x, peak RSS {m:.3f}x")
    print(
        json.dumps(
            {
                "runs": {
                    s: [{k: r[k] for k in ("seconds", "peak_rss_bytes")} for r in rs]
                    for s, rs in runs.items()
                }
            }
        )
    )


if __name__ == "__main__":
    main()
