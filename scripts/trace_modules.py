"""Count how often a `vlmc build` enters the package, graph, session and interop modules.

    python scripts/trace_modules.py [--recipe recipes/demo.yaml] [--module vlmc/graphs.py ...]

The build runs in this process under ``sys.setprofile``. An *entry* into a module is a call of one
of its functions from code in another file (calls inside the module, and its import, are not
entries; contextlib's frames are looked through, so a ``with`` block's context manager is entered
from the code holding the block). Per module it prints ``calls`` (every entry at run time), ``sites`` (distinct caller
line -> callee function pairs: the places the flow crosses into the module, which is what issue 30
counts by following one recipe through the calls), and ``ping_pong`` / ``ping_pong_sites``: the
entries whose caller is another of the counted modules (package -> graphs -> interop -> graphs ...).
The build's output goes to a temporary directory that is removed afterwards. The code traced is
the one ``vlmc`` imports (this checkout, or another one first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODULES = ("vlmc/package.py", "vlmc/graphs.py", "vlmc/ortsession.py", "vlmc/interop.py")


def trace(recipe: Path, modules: tuple[str, ...], detail: bool = False) -> dict[str, dict]:
    """Run ``vlmc build --recipe recipe`` and count the entries into each of ``modules``.

    ``detail`` adds, per module, its ping-pong entries by site (``caller.py:line func -> callee``).
    """
    from click.testing import CliRunner

    from vlmc import cli

    root = Path(cli.__file__).resolve().parent.parent  # the checkout whose vlmc is traced
    files = {str((root / m).resolve()): m for m in modules}
    calls: collections.Counter[str] = collections.Counter()
    sites: dict[str, set] = collections.defaultdict(set)
    pong: collections.Counter[str] = collections.Counter()
    pong_sites: dict[str, set] = collections.defaultdict(set)
    pong_by_site: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_site: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def profile(frame, event, arg):  # noqa: ARG001 (the sys.setprofile signature)
        if event != "call":
            return
        mod = files.get(frame.f_code.co_filename)
        if mod is None or frame.f_code.co_name == "<module>":
            return
        caller = frame.f_back
        while caller is not None and caller.f_code.co_filename == contextlib.__file__:
            caller = caller.f_back  # a `with` block's generator is entered by the code holding the block
        if caller is None or caller.f_code.co_filename == frame.f_code.co_filename:
            return
        site = (caller.f_code.co_filename, caller.f_lineno, frame.f_code.co_name)
        calls[mod] += 1
        sites[mod].add(site)
        by_site[mod][
            f"{_short(caller.f_code.co_filename, root)}:{caller.f_lineno} {caller.f_code.co_name} -> {frame.f_code.co_name}"
        ] += 1
        if caller.f_code.co_filename in files:
            pong[mod] += 1
            pong_sites[mod].add(site)
            where = f"{files[caller.f_code.co_filename]}:{caller.f_lineno} {caller.f_code.co_name}"
            pong_by_site[mod][f"{where} -> {frame.f_code.co_name}"] += 1

    with tempfile.TemporaryDirectory(prefix="vlmc-trace-") as tmp:
        args = ["build", "--recipe", str(recipe), "-o", str(Path(tmp) / "out")]
        sys.setprofile(profile)
        try:
            result = CliRunner().invoke(cli.main, args, catch_exceptions=False)
        finally:
            sys.setprofile(None)
    if result.exit_code != 0:
        raise SystemExit(f"vlmc build failed ({result.exit_code}): {result.output}")
    return {
        m: {
            "calls": calls[m],
            "sites": len(sites[m]),
            "ping_pong": pong[m],
            "ping_pong_sites": len(pong_sites[m]),
            **({"ping_pong_by_site": dict(pong_by_site[m].most_common())} if detail else {}),
            **({"sites_by_caller": dict(sorted(by_site[m].items()))} if detail else {}),
        }
        for m in modules
    }


def _short(path: str, root: Path) -> str:
    """``path`` relative to the traced checkout when inside it."""
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "demo.yaml")
    ap.add_argument("--module", action="append", help="a module file to count (repeatable)")
    ap.add_argument("--detail", action="store_true", help="list each module's ping-pong entries by site")
    args = ap.parse_args()
    counts = trace(args.recipe.resolve(), tuple(args.module) if args.module else MODULES, args.detail)
    total = {
        k: sum(c[k] for c in counts.values()) for k in ("calls", "sites", "ping_pong", "ping_pong_sites")
    }
    print(json.dumps({**counts, "total": total}, indent=2))


if __name__ == "__main__":
    main()
