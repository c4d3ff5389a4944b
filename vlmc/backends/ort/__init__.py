"""onnxruntime backend: the package lowered to onnxruntime's kernels, runnable here with `vlmc run BUILD`.

The portable package stays standard ONNX (the Ascend lowering's input, readable by any runtime); this
target rewrites what onnxruntime has a faster kernel for: the quantize pass's weight-only INT4/INT8
MatMuls become ``com.microsoft.MatMulNBits`` (:mod:`vlmc.backends.ort.matmul_nbits`), and RMSNorm,
rotary and attention become onnxruntime's contrib fused ops (:mod:`vlmc.backends.ort.fusions`).
Each fusion is run beside the graph before it on the package's sample inputs (and kept only within
the bound); every lowered graph is then run beside the package's graph and the largest output
difference is recorded in compile.json; the build's generation can be compared with the package's
with ``vlmc run BUILD --against PACKAGE``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from vlmc import interop, ortsession, outdir, pass_api, samples
from vlmc.backends import build_output
from vlmc.errors import CheckFailed, VlmcError
from vlmc.package import Package
from vlmc.runtime import opener

from . import fusions, last_logits, matmul_nbits

logger = logging.getLogger(__name__)

NAME = "ort"
TARGET_OPTIONS = (
    pass_api.Option(
        "matmul_nbits",
        bool,
        True,
        "lower weight-only INT4/INT8 MatMuls to com.microsoft.MatMulNBits (false: the package as it is)",
    ),
    pass_api.Option(
        "accuracy_level",
        int,
        4,
        "MatMulNBits accuracy_level: the lowest precision onnxruntime may compute the activations in "
        "(0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8: per-block int8 activations, the fastest on CPU)",
        choices=(0, 1, 2, 3, 4),
    ),
    pass_api.Option(
        "fuse_norms",
        bool,
        True,
        "RMSNorm -> SimplifiedLayerNormalization, with the residual Add before it -> "
        "com.microsoft.SkipSimplifiedLayerNormalization",
    ),
    pass_api.Option(
        "fuse_rotary",
        bool,
        True,
        "rotary (x*cos + rotate_half(x)*sin, 1-D positions) -> com.microsoft.RotaryEmbedding with cos/sin caches",
    ),
    pass_api.Option(
        "fuse_attention",
        bool,
        True,
        "attention over the contiguous KV -> com.microsoft.MultiHeadAttention (needs fuse_rotary where the "
        "model has rotary; skipped for paged packages and for fewer KV heads than query heads)",
    ),
    pass_api.Option(
        "last_logits",
        bool,
        True,
        "the LM head computes the last position only (logits [batch, 1, vocab]): the generation loop "
        "reads only that position (false: every position, as the package)",
    ),
)
# How far a lowered graph's outputs may be from the package's on its sample inputs: the RMS of the
# difference over the RMS of the package's output (max|diff| is reported too; one outlier element
# should not fail a build). With float activations (accuracy_level < 4) only the summation order
# changes; int8 activations (level 4) round each block of A to 1/127 of its largest value.
TOLERANCE = {"float": 1e-4, "int8": 5e-2}


def compile(package: Package, out_dir: Path, target: dict | None = None, force: bool = False) -> dict:
    """Write ``out_dir/package`` (the lowered package, runnable with `vlmc run out_dir`) plus compile.json.

    Every graph is opened in an onnxruntime CPU session first, so a package that would fail at run
    time fails here; every lowered graph is checked against the package's on the same inputs.

    Args:
        package: the package (not modified; its on-disk location is kept).
        out_dir: the build directory to create.
        target: ``{"backend": "ort", ...}`` with :data:`TARGET_OPTIONS`.
        force: replace an existing vlmc build at ``out_dir``.
    """
    out_dir = Path(out_dir)  # not resolved: a symlink output is refused, never followed
    outdir.check(out_dir, force, source=package.root)
    opts = pass_api.validate(
        TARGET_OPTIONS, {k: v for k, v in (target or {}).items() if k != "backend"}, "target (ort)"
    )
    build = package.snapshot()
    graphs_summary = {}
    for name in package.graph_names:
        info = package.info(name)
        entry = {"role": info["role"], "precision": info.get("precision")}
        facts = info.get("quantization") or {}
        lowered = None
        ort_facts: dict = {}
        if opts["matmul_nbits"] and facts.get("mode") in matmul_nbits.MODES:
            model = package.model(name).clone()  # weights shared, never written: the package is untouched
            store = interop.TensorStore(build.scratch_path(name).parent / "matmul_nbits.bin")
            lowering = matmul_nbits.lower(model, facts, opts["accuracy_level"], store)
            if lowering["nodes_lowered"]:
                ort_facts.update(lowering)
                lowered = model
            entry["lowering"] = lowering
            logger.info("ort: %s: %d MatMuls -> MatMulNBits", name, lowering["nodes_lowered"])
        fused = _fuse(package, name, lowered, opts)
        if fused is not None:
            lowered, entry["fusions"] = fused
            ort_facts["fusions"] = {k: v["fused"] for k, v in entry["fusions"].items() if "fused" in v}
        if opts["last_logits"] and last_logits.OUTPUT in _output_names(package, name, lowered):
            candidate = lowered if lowered is not None else package.model(name).clone()
            entry["last_logits"] = last_logits.lower(candidate)
            if entry["last_logits"]["sliced"]:
                lowered = candidate
                ort_facts["last_logits"] = True
        if lowered is not None:
            build.set_graph(name, lowered, ort=ort_facts)  # the manifest: what was lowered and fused
        if lowered is None:
            entry["providers"] = _open(name, ortsession.for_graph, package, name).get_providers()
        graphs_summary[name] = entry
    summary = {"backend": NAME, "package": "package", "options": opts, "graphs": graphs_summary}
    with build_output(out_dir, NAME, summary, force=force) as tmp:
        build.save(tmp / "package", adopt=False)
        # Checked as written, in the session `vlmc run` opens (from the file, weights prepacked): a session
        # on the in-memory graph computes from the weight buffers in place, without prepacking, and
        # MatMulNBits then takes another kernel path than at run time.
        lowered = [name for name in graphs_summary if "ort" in build.info(name)]
        written = Package.load(tmp / "package") if lowered else None  # nothing to check: not opened again
        for name in lowered:
            entry = graphs_summary[name]
            check, entry["providers"] = _compare(
                package,
                written,
                name,
                _activations(written, name, opts),
                bool(entry.get("last_logits", {}).get("sliced")),
            )
            if "lowering" in entry:
                entry["lowering"]["check"] = check
            entry["check"] = check
    return summary


def _output_names(package: Package, name: str, lowered) -> list[str]:
    model = lowered if lowered is not None else package.model(name)
    return [o.name for o in model.graph.outputs]


def _activations(pkg: Package, name: str, opts: dict) -> str:
    """``int8`` where the graph holds MatMulNBits at accuracy_level 4 (per-block int8 activations), else ``float``."""
    lowered = (pkg.info(name).get("ort") or {}).get("nodes_lowered")
    return "int8" if lowered and opts["accuracy_level"] == 4 else "float"


def _fuse(package: Package, name: str, model, opts: dict):
    """Apply the enabled fusions to graph ``name`` (``model``: it already lowered, else a clone is made).

    Each fusion is checked against the graph before it on the package's sample inputs, in memory; one
    that moves an output past the bound is dropped (its facts say so) and the graph before it kept.
    Returns ``(model, facts)``, or None when nothing was fused.
    """
    wanted = [
        k for k, opt in zip(fusions.KINDS, ("fuse_norms", "fuse_rotary", "fuse_attention")) if opts[opt]
    ]
    if not wanted:
        return None
    current = model if model is not None else package.model(name).clone()
    feeds = samples.inputs_for(package, name)
    kind = "int8" if model is not None and opts["accuracy_level"] == 4 else "float"
    ref = _outputs(name, current, feeds)
    facts: dict = {}
    any_fused = False
    for fusion in wanted:
        if fusion == "attention" and (package.manifest.get("kv") or {}).get("layout") == "paged":
            facts[fusion] = {
                "op": f"{fusions.DOMAIN}.MultiHeadAttention",
                "skipped": "paged KV layout: the graph reads the pools through the block table, and "
                "MultiHeadAttention takes contiguous past_key/past_value",
            }
            continue
        candidate = current.clone()
        if fusion == "rms_norm":
            got = fusions.fuse_rms_norms(candidate)
        elif fusion == "rotary":
            got = fusions.fuse_rotary(candidate, int(package.manifest["text"]["max_positions"]))
        else:
            got = fusions.fuse_attention(candidate)
        if got["fused"]:
            out = _outputs(name, candidate, feeds)
            got["check"] = _diffs(ref, out, TOLERANCE[kind])
            if got["check"]["within_bound"]:
                current, ref, any_fused = candidate, out, True
            else:
                got["dropped"] = "moved an output past the bound; the graph before this fusion is kept"
                got["fused"] = 0
        facts[fusion] = got
        logger.info("ort: %s: %s fused %d", name, fusion, got.get("fused", 0))
    if not any_fused and model is None:
        return None
    return current, facts


def _outputs(name: str, model, feeds: dict) -> dict:
    sess = _open(name, ortsession.from_model, model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def _diffs(ref: dict, got: dict, bound: float) -> dict:
    """Per float output: max |diff| and the RMS of the difference over the RMS of ``ref``."""
    out: dict = {"bound_rms_relative": bound, "within_bound": True, "outputs": {}}
    for oname, r in ref.items():
        g = got[oname]
        if r.dtype.kind != "f":
            if not np.array_equal(r, g):
                out["within_bound"] = False
            continue
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        diff = float(np.max(np.abs(r64 - g64))) if r.size else 0.0
        rms_ref = float(np.sqrt(np.mean(r64**2))) if r.size else 0.0
        rms_diff = float(np.sqrt(np.mean((r64 - g64) ** 2))) if r.size else 0.0
        rel = rms_diff / rms_ref if rms_ref > 0 else rms_diff
        if not np.isfinite(g64).all() or rel > bound:
            out["within_bound"] = False
        out["outputs"][oname] = {"max_abs_diff": diff, "rms_relative": rel}
    return out


def _open(name: str, make, *args):
    """``make(*args)`` (an onnxruntime session for graph ``name``), onnxruntime's errors as one CheckFailed line."""
    try:
        return make(*args)
    except VlmcError:
        raise
    except Exception as exc:  # onnxruntime raises its own exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckFailed(f"ort: graph {name!r} does not load in onnxruntime: {first}") from exc


def _compare(package: Package, build: Package, name: str, kind: str, last: bool) -> tuple[dict, list[str]]:
    """Run the package's graph and the build's lowered one on the same sample inputs.

    ``last``: the build's LM head computes the last position only; the package's logits are compared
    at that position (what the build computes and the generation loop reads).

    Returns the differences per output and the lowered session's providers; CheckFailed past the bound.
    """
    feeds = samples.inputs_for(package, name)
    ref_sess = _open(name, ortsession.for_graph, package, name)
    names = [o.name for o in ref_sess.get_outputs()]
    ref = dict(zip(names, ref_sess.run(None, feeds)))
    del ref_sess
    got_sess = _open(name, ortsession.for_graph, build, name)
    providers = got_sess.get_providers()
    got = dict(zip(names, got_sess.run(names, feeds)))
    del got_sess
    bound = TOLERANCE[kind]
    out: dict = {"inputs": "package samples", "activations": kind, "bound_rms_relative": bound, "outputs": {}}
    if last:
        ref[last_logits.OUTPUT] = ref[last_logits.OUTPUT][:, -1:, :]
        out["logits_positions"] = "last"
    for oname, r in ref.items():
        g = got[oname]
        if r.shape != g.shape:
            raise CheckFailed(f"ort: lowering {name} changed the shape of {oname!r}: {r.shape} -> {g.shape}")
        if r.dtype.kind != "f":
            if not np.array_equal(r, g):
                raise CheckFailed(f"ort: lowering {name} changed its integer output {oname!r}")
            continue
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        diff = float(np.max(np.abs(r64 - g64))) if r.size else 0.0
        rms_ref = float(np.sqrt(np.mean(r64**2))) if r.size else 0.0
        rms_diff = float(np.sqrt(np.mean((r64 - g64) ** 2))) if r.size else 0.0
        rel = rms_diff / rms_ref if rms_ref > 0 else rms_diff
        if not np.isfinite(g64).all() or rel > bound:
            raise CheckFailed(
                f"ort: lowering {name} moved {oname!r} by {rel:.3g} of its RMS (max |diff| "
                f"{diff:.3g}, bound {bound}); compile with accuracy_level: 1 or report this package"
            )
        out["outputs"][oname] = {"max_abs_diff": diff, "rms_relative": rel}
    return out, providers


def package_dir(path: Path) -> Path | None:
    """The runnable package inside an ort compile output, or None (vlmc.runtime.opener reads it)."""
    return opener.ort_build_package(path)
