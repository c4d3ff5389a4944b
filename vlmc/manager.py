"""The pass manager: runs a validated recipe over a package, checking each pass's contract."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlmc import interop, interrupts, manifest, memory, ortsession, samples, ui
from vlmc.errors import CheckFailed, PassFailed, PassRefused, VlmcError
from vlmc.package import Package
from vlmc.pass_api import check_requirements, contract_violations
from vlmc.recipe import Step

logger = logging.getLogger(__name__)

NUMERICS_RTOL = 1e-4
NUMERICS_ATOL = 1e-4


@dataclass
class _Before:
    state: dict[str, str]
    manifest: str
    graphs: dict[str, object]  # name -> a file holding the graph as it was, kept only for --check
    package: Package | None  # the package as it was, for a lossy pass's evaluate()
    # For a pass that declares changes_input = False: the graph objects the package held, by name, with
    # their fingerprints then; the pass must leave each as it was.
    held: dict[str, tuple[object, str]]


def _manifest_text(pkg: Package) -> str:
    return json.dumps({k: v for k, v in pkg.manifest.items() if k != "history"}, sort_keys=True)


def run(pkg: Package, steps: list[Step], check: bool = False) -> Package:
    """Run passes in order. Every pass is constructed (options validated) before any pass runs.

    Before any pass runs, every pass class is held to what the contract asks of its declarations
    (:func:`vlmc.pass_api.contract_violations`: a lossy pass implements ``evaluate`` and does not
    change its input). For each pass the manager then checks its declared preconditions, calls
    ``check_package`` and hands the plan it returns to ``run``, runs it, works out which graphs changed
    from content fingerprints (and holds a pass that states ``modified`` to it), holds a pass that
    declares ``changes_input = False`` to it, validates the manifest, checks every changed graph, calls
    ``evaluate`` for lossy passes, and records history, timing and peak memory.

    Raises:
        PassRefused: a precondition, ``check_package`` or ``run`` refused the package or a recipe value
            (a VlmcError): bad input, exit code 2.
        PassFailed: a pass class breaks the contract, or a pass raised, misreported ``modified``,
            edited a graph it declared it would not change, broke the manifest or produced an invalid
            graph; the message names the pass, its 1-based position in the recipe, and the passes that
            ran before it.
        CheckFailed: ``check`` is on and a numerics-preserving pass changed a graph's outputs.
    """
    instances = [s.instantiate() for s in steps]
    for step, p in zip(steps, instances):
        broken = contract_violations(type(p))
        if broken:
            cls = type(p)
            raise PassFailed(
                f"pass #{step.index} {step.name!r} ({cls.__module__}.{cls.__qualname__}) breaks the pass "
                f"contract (vlmc/pass_api.py): {'; '.join(broken)}"
            )
    pkg.report.setdefault("passes", [])
    ran: list[str] = []
    # Fingerprints of the package's state after a pass, which is the state before the next one (nothing
    # edits the package in between but the next pass's check_package, which must not): taken once.
    memo: dict[str, str] = {}
    with ui.progress("running passes", total=len(steps)) as bar, tempfile.TemporaryDirectory() as tmp:
        for step, p in zip(steps, instances):
            interrupts.check()  # between two passes
            bar.describe(f"pass {step.index}/{len(steps)}: {step.name}")
            label = f"pass #{step.index} {step.name!r}"
            after_txt = f" (ran before it: {', '.join(ran)})" if ran else " (it was the first pass)"
            with memory.Peak() as mem:  # sampled while the pass runs; its peak goes to report.json
                t0 = time.perf_counter()
                plan = _guarded(label, after_txt, _checked, p, pkg)
                before = _guarded(
                    label,
                    after_txt,
                    _snapshot,
                    pkg,
                    Path(tmp) / str(step.index),
                    keep_graphs=check and p.preserves_numerics,
                    keep_package=p.lossy,
                    keep_held=not p.changes_input,
                    memo=memo,
                )
                result = _guarded(label, after_txt, p.run, pkg, plan)
                if result is None or not hasattr(result, "modified"):
                    raise PassFailed(f"{label} did not return a PassResult{after_txt}")
                for name, (model, fingerprint) in before.held.items():
                    if interop.fingerprint(model) != fingerprint:
                        raise PassFailed(
                            f"{label} declares changes_input = False but edited graph {name!r} in place; "
                            "build on a clone (Model.clone()) and hand it to set_graph, or declare "
                            f"changes_input = True{after_txt}"
                        )
                out = result.package
                memo = {}  # the pass may have edited any graph
                try:
                    manifest.validate(out.manifest, where=f"the manifest after {step.name}")
                except VlmcError as exc:
                    raise PassFailed(f"{label} broke the manifest: {exc}{after_txt}") from exc
                with out.unedited(memo):  # one hash per graph for the state and the paths below
                    changed = _changed(before, out)
                    actual = bool(changed)
                    if result.modified is not None and bool(result.modified) != actual:
                        what = f"changed {', '.join(changed)}" if changed else "changed nothing"
                        raise PassFailed(
                            f"{label} reported modified={bool(result.modified)} but it {what}; "
                            f"a pass must report modified exactly (or leave it to the manager){after_txt}"
                        )
                    for name in changed:
                        if name not in out.manifest["graphs"]:
                            continue
                        try:
                            path = out.path_of(name)
                            if path is not None:
                                interop.check_path(path, name=f"{name} after {step.name}")
                            else:
                                interop.check(out.model(name), name=f"{name} after {step.name}")
                        except VlmcError as exc:
                            raise PassFailed(f"{label} produced an invalid graph: {exc}{after_txt}") from exc
                report = dict(result.report or {})
                if p.lossy and actual:
                    try:
                        fidelity = p.evaluate(before.package, out, result)
                    except VlmcError as exc:
                        raise PassFailed(f"{label}: measuring its fidelity failed: {exc}{after_txt}") from exc
                    if fidelity is not None:
                        report["fidelity"] = fidelity
                if check and p.preserves_numerics and actual:
                    report["numerics_check"] = _numerics(before, out, changed, label)
                seconds = time.perf_counter() - t0
                mem.stop()  # the pass is over: its peak is final
                out.manifest["history"].append(
                    {
                        "pass": step.name,
                        "index": step.index,
                        "options": step.options,
                        "modified": actual,
                        "report": report,
                    }
                )
                out.report["passes"].append(
                    {
                        "pass": step.name,
                        "index": step.index,
                        "seconds": round(seconds, 4),
                        "peak_rss_bytes": mem.bytes,
                        "modified": actual,
                        "changed": changed,
                    }
                )
                pkg = out
                ran.append(step.name)
            bar.advance()
    return pkg


def _checked(p, pkg: Package):
    """The pass's declared preconditions, then its check_package: the plan its run receives."""
    check_requirements(p, pkg)
    return p.check_package(pkg)


def _guarded(label: str, after_txt: str, call, *args, **kwargs):
    """``call(*args, **kwargs)``, with what it raises named by the pass.

    A VlmcError is a refusal (PassRefused, exit 2), a failed check a PassFailed, anything else a pass
    bug (one line; the traceback with -v).
    """
    try:
        return call(*args, **kwargs)
    except PassFailed:
        raise
    except CheckFailed as exc:
        raise PassFailed(f"{label} failed: {exc}{after_txt}") from exc
    except VlmcError as exc:  # the pass refused the package or a recipe value: bad input
        raise PassRefused(f"{label} failed: {exc}{after_txt}") from exc
    except Exception as exc:
        logger.debug("pass failure", exc_info=True)
        raise PassFailed(f"{label} failed with {type(exc).__name__}: {exc}{after_txt}") from exc


def _snapshot(
    pkg: Package, tmp: Path, keep_graphs: bool, keep_package: bool, keep_held: bool, memo: dict[str, str]
) -> _Before:
    with pkg.unedited(memo):  # path_of, state and the held fingerprints share one hash per graph
        return _snapshot_of(pkg, tmp, keep_graphs, keep_package, keep_held)


def _snapshot_of(pkg: Package, tmp: Path, keep_graphs: bool, keep_package: bool, keep_held: bool) -> _Before:
    kept: dict[str, object] = {}
    if keep_graphs:
        # Files are never changed once written, so an unchanged graph's file is its before-state; a
        # graph already changed in memory is written out (the pass may edit it in place).
        for name in pkg.graph_names:
            path = pkg.path_of(name)
            if path is None:
                path = tmp / name / pkg.info(name)["file"]
                path.parent.mkdir(parents=True)
                interop.save(pkg.model(name), path)
            kept[name] = path
    return _Before(
        state=pkg.state(),
        manifest=_manifest_text(pkg),
        graphs=kept,
        package=pkg.snapshot() if keep_package else None,
        # A graph not loaded yet is read fresh from its file by whoever asks, so only held objects count.
        held={
            name: (pkg.model(name), pkg.fingerprint(name))
            for name in pkg.graph_names
            if keep_held and pkg.is_loaded(name)
        },
    )


def _changed(before: _Before, pkg: Package) -> list[str]:
    """Names of graphs added, removed or changed, plus 'manifest' if other facts changed."""
    now = pkg.state()
    changed = [
        name for name in sorted(set(before.state) | set(now)) if before.state.get(name) != now.get(name)
    ]
    if _manifest_text(pkg) != before.manifest and not changed:
        changed.append("manifest")
    return changed


def _numerics(before: _Before, pkg: Package, changed: list[str], label: str) -> dict:
    """Run changed graphs before and after on onnxruntime with the same inputs; compare outputs."""
    results = {}
    for name in changed:
        old = before.graphs.get(name)
        if old is None or name not in pkg.manifest["graphs"]:
            continue

        sess_old = ortsession.from_path(old)
        sess_new = ortsession.for_graph(pkg, name)
        old_inputs = sorted(i.name for i in sess_old.get_inputs())
        new_inputs = sorted(i.name for i in sess_new.get_inputs())
        if old_inputs != new_inputs:
            raise CheckFailed(f"{label} claims to preserve numerics but changed the inputs of {name}")
        feeds = samples.inputs_for(pkg, name)
        try:
            outs_old = dict(zip([o.name for o in sess_old.get_outputs()], sess_old.run(None, feeds)))
            outs_new = dict(zip([o.name for o in sess_new.get_outputs()], sess_new.run(None, feeds)))
        except Exception as exc:  # onnxruntime's own error types; the inputs may not suit the graph
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckFailed(
                f"{label}: cannot compare {name} on onnxruntime with its sample inputs ({first}); "
                "re-export the package so it carries sample inputs for this graph"
            ) from exc
        worst = 0.0
        for oname, ref in outs_old.items():
            if oname not in outs_new:
                raise CheckFailed(f"{label} removed output {oname!r} of {name}")
            got = outs_new[oname]
            if ref.shape != got.shape:
                raise CheckFailed(
                    f"{label} changed the shape of {name}:{oname} from {ref.shape} to {got.shape}"
                )
            if ref.dtype.kind == "f":
                diff = (
                    float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64))))
                    if ref.size
                    else 0.0
                )
                if not np.allclose(got, ref, rtol=NUMERICS_RTOL, atol=NUMERICS_ATOL):
                    raise CheckFailed(
                        f"{label} changed the numerics of {name}:{oname} (max |diff| {diff:.3g})"
                    )
                worst = max(worst, diff)
            elif not np.array_equal(ref, got):
                raise CheckFailed(f"{label} changed the integer output {name}:{oname}")
        results[name] = {"max_abs_diff": worst}
    return results
