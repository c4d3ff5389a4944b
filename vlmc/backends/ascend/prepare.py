"""Plan a package's Ascend builds in memory: precheck, lowering, gear plans and ATC commands."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx_ir as ir

from vlmc import ascend_limits, graphs, interop, samples, tensor_names
from vlmc.backends.ascend import atc, gears, lower, pools, precheck, stack_kv
from vlmc.errors import CheckFailed, VlmcError
from vlmc.package import Package
from vlmc.package import signature as graph_signature
from vlmc.runtime import preprocess

logger = logging.getLogger(__name__)


def prepare(package: Package, opts: dict, soc_version: str, scratch: Path | None = None) -> dict:
    """Everything compile writes, planned: lowered graphs (IR), builds and ATC commands.

    Weights are never all in memory: each graph is an onnx-ir model whose weights stay in their
    files (memory-mapped when a rule reads one), and the deploy-form weights the lowering makes go
    to a data file under ``scratch`` one tensor at a time, from where the writer streams them.

    Args:
        package: the package (not modified).
        opts: validated target options (see :func:`options`).
        soc_version: the exact --soc_version (see ``soc.resolve``).
        scratch: a directory the caller owns (and removes after writing) for the lowered weights;
            None keeps them in memory (small graphs).

    Returns:
        ``{"files": {file: ir.Model}, "shared": {file: base file}, "reports": {...}, "builds": [...],
        "commands": {build: AtcCommand}, "warnings": [...]}``
    """
    findings: list[precheck.Finding] = []
    models: dict[str, ir.Model] = {}
    known = set((opts.get("dims") or {}).keys())
    # the dims resolution gears size (a kind without rules has none; options for another kind are refused below)
    known |= {r.symbol for r in preprocess.GEARS.get(_preprocess_facts(package.manifest).get("kind"), ())}
    for name in package.graph_names:
        path = package.path_of(name)
        if path is not None:
            missing = precheck.check_external_data(path, name)
            if missing:
                findings += missing
                continue
            # A graph on disk is opened privately (weights memory-mapped, nothing read), so the
            # lowering may rewrite it in place without touching the package's copy.
            model = graphs.load_ir(path)
        else:
            # In memory only: a structural copy, sharing the (never mutated) weight tensors.
            model = package.model(name).clone()
        findings += precheck.check_ops(model, name, lowered=False)
        # Only the samples' names and shapes are used: read from the headers (a paged decoder's are large).
        sample = samples.shapes(package, name) or {}
        findings += precheck.check_inputs(model, name, known, set(sample))
        models[name] = model
    _raise_errors(findings)
    warnings = [str(f) for f in findings if f.severity == "warning"]
    resolution = resolution_gears(package.manifest, opts, models)

    lowered: dict[str, ir.Model] = {}
    reports: dict[str, lower.LowerReport] = {}
    for name in list(models):
        model = models.pop(name)
        store = interop.TensorStore(Path(scratch) / f"{name}.lowered.data") if scratch is not None else None
        try:
            lowered[name], reports[name] = lower.lower(
                model, name, package.info(name), int4_weights=opts.get("int4_weights") or "int8", store=store
            )
        finally:
            if store is not None:
                store.close()
        # Paged pools live on the device in float16 (see pools.py); a no-op for graphs without pools.
        pools.fp16_pool_io(lowered[name])
    # Lowering notes (INT4 held as INT8 on the NPU, asymmetric activations unverified) go to the
    # warnings once, so compile.json and report.md both say them.
    for note in dict.fromkeys(n for r in reports.values() for n in r.notes):
        warnings.append(note)

    kv = package.manifest.get("kv", {})
    max_positions = package.manifest.get("text", {}).get("max_positions")
    for msg in gears.dropped_buckets(opts, max_positions):
        logger.warning("%s", msg)  # once per compile, not once per build
        warnings.append(msg)
    ctx_base = gears.DimContext(
        fixed=dict(opts.get("dims") or {}),
        block_size=kv.get("block_size") if kv.get("layout") == "paged" else None,
        max_positions=max_positions,
        patches=_patches_per_image(package.manifest),
        resolution={r["symbol"]: (r["combine"], r["gears"]) for r in (resolution or {}).get("rules", [])},
    )
    deepstack_rows = _deepstack_rows(package, ctx_base.fixed, ctx_base.resolution, opts)

    def _ds(ctx: gears.DimContext, variant: str) -> gears.DimContext:
        if not deepstack_rows:
            return ctx
        dim, rows = deepstack_rows
        return gears.DimContext(
            **{**ctx.__dict__, "fixed": {**ctx.fixed, dim: 1 if variant == "decode" else rows}}
        )

    files: dict[str, ir.Model] = {}
    shared: dict[str, str] = {}
    builds: list[gears.Build] = []
    for name, model in lowered.items():
        info = package.info(name)
        role = info["role"]
        sample = samples.shapes(package, name) or {}
        ctx = gears.DimContext(
            **{**ctx_base.__dict__, "sample_shapes": {k: list(v) for k, v in sample.items()}}
        )
        input_names = [i.name for i in model.graph.inputs]
        file = f"{name}.onnx"
        files[file] = model
        if role in ("decoder", "vlm") and any(tensor_names.is_past(n) for n in input_names):
            # The prefill graph shares every weight with the decode graph (_save_sharing points them
            # at its data file): a structural clone holds the same tensors, so nothing is copied or read.
            prefill, empties = lower.strip_past(model.clone(), name)
            if empties:
                warnings.append(
                    f"{name}: the prefill graph feeds an empty past to {empties} non-Concat consumer(s)"
                )
            stack_kv.stack_inputs(model, name)  # after the prefill clone: the decode build's past, stacked
            stack_kv.stack_outputs(model, name)  # its presents rolled, the next step's stacked past
            stack_kv.stack_outputs(prefill, name)
            pfile = f"{name}_prefill.onnx"
            files[pfile] = prefill
            shared[pfile] = file
            builds.append(
                _plan(f"{name}_prefill", name, pfile, "prefill", role, prefill, opts, _ds(ctx, "prefill"))
            )
            # A merged graph (role vlm) only ever prefills: the runtime decodes with embed + decoder
            # (vlmc/runtime/pipeline.py), so its past is always empty and it has no decode build.
            if role == "decoder":
                builds.append(
                    _plan(f"{name}_decode", name, file, "decode", role, model, opts, _ds(ctx, "decode"))
                )
        elif role == "decoder" and any(tensor_names.is_cache(n) for n in input_names):
            stack_kv.stack_inputs(model, name)  # the pools, stacked (one input per kind)
            stack_kv.stack_outputs(model, name)  # and the new rows, stored with one copy for all layers
            builds.append(
                _plan(f"{name}_prefill", name, file, "prefill", role, model, opts, _ds(ctx, "prefill"))
            )
            builds.append(
                _plan(f"{name}_decode", name, file, "decode", role, model, opts, _ds(ctx, "decode"))
            )
        else:
            builds.append(_plan(name, name, file, "full", role, model, opts, _ds(ctx, "prefill")))

    findings += [
        f for b in builds for f in precheck.check_dims_vector(b.name, b.input_shape, bool(b.profiles))
    ]
    for file, model in files.items():
        findings += precheck.check_ops(model, file, lowered=True)
        findings += precheck.check_size(model, file)
    _raise_errors(findings)

    commands = {}
    for b in builds:
        commands[b.name] = _command(b, package.info(b.graph), reports[b.graph], opts, soc_version)
    return {
        "files": files,
        "shared": shared,
        "reports": reports,
        "builds": builds,
        "commands": commands,
        "warnings": warnings,
        "resolution": resolution,
    }


def _preprocess_facts(manifest: dict) -> dict:
    return (manifest.get("vision") or {}).get("preprocess") or {}


def resolution_gears(manifest: dict, opts: dict, models: dict[str, ir.Model]) -> dict | None:
    """The resolution gears of a dynamic-resolution package, for the planner, compile.json and the runtime.

    Each of the preprocessing kind's gear rules (vlmc.runtime.preprocess.GEARS) whose dim some graph
    takes gets its per-image values: the target's option (``patch_gears``, ``tile_gears``,
    ``image_token_gears``) or the defaults derived from the preprocessor's own limits. A dim the target's
    ``dims`` sizes keeps those exact sizes and no gear rule (the runtime then fits nothing).

    Returns:
        None for a package whose images have one size, else ``{"kind", "rules": [...], "row_padded":
        [symbols the runner pads by rows], "unpadded": [symbols it must not pad], "runtime": {symbol:
        per-image values}}`` (the last goes to the runtime manifest's ``vision.preprocess.gears``).

    Raises:
        VlmcError: an option names gears the package's preprocessing has not, or values it cannot take.
    """
    facts = _preprocess_facts(manifest)
    kind = facts.get("kind")
    rules = preprocess.GEARS.get(kind, ())
    offered = {r.option for r in rules}
    for option in preprocess.GEAR_OPTIONS:
        if opts.get(option) is not None and option not in offered:
            have = ", ".join(sorted(offered)) or "none: its images have one size"
            raise VlmcError(
                f"target: {option} does not apply to this package: its preprocessing ({kind}) has other "
                f"resolution gears ({have})"
            )
    dims_in_graphs = {
        d
        for m in models.values()
        for i in graph_signature(m)["inputs"]
        for d in i["shape"]
        if isinstance(d, str)
    }
    fixed = opts.get("dims") or {}
    out = []
    for rule in rules:
        if rule.symbol not in dims_in_graphs or rule.symbol in fixed:
            continue
        given = opts.get(rule.option)
        vision = manifest.get("vision") or {}
        values = sorted(set(given)) if given is not None else rule.defaults(facts, vision)
        why = rule.check(facts, values, vision) if values else "no value fits the preprocessor's limits"
        if why:
            raise VlmcError(f"target: {rule.option} {values}: {why}")
        out.append(
            {
                "symbol": rule.symbol,
                "option": rule.option,
                "counts": rule.what,
                "gears": values,
                "source": "target" if given is not None else "preprocessor limits",
                "combine": rule.combine,
                "fit": rule.fit,
                "tokens": rule.effect,
            }
        )
    if not out:
        return None
    return {
        "kind": kind,
        "rules": out,
        "row_padded": [r["symbol"] for r in out if r["fit"] == "rows"],
        "unpadded": list(preprocess.UNPADDED.get(kind, ())),
        "runtime": {r["symbol"]: r["gears"] for r in out},
    }


def _deepstack_rows(
    package, fixed: dict, resolution: dict[str, tuple[str, list[int]]], opts: dict
) -> tuple[str, int | list[int]] | None:
    """The deepstack rows dim (manifest text.deepstack, Qwen3-VL) and its prefill value(s).

    A decode step has no image token, so the runtime feeds one zero row (the graph gathers row 0, a zero
    row of its own, at every non-image position); prefill carries the image tokens of the vision build:
    its patches (the target's ``dims`` or the vision sample) over merge², or, for a pruned package
    (``vision.pruning``), the ``tokens_per_image`` it keeps of each image times each images gear, whatever
    the patches. A ``dims`` entry for the rows dim itself wins for prefill.
    """
    ds = package.manifest.get("text", {}).get("deepstack")
    if not ds:
        return None
    dim = ds.get("rows_dim", "visual_tokens")
    if dim in fixed:
        return dim, fixed[dim]
    vision = package.manifest.get("vision") or {}
    kept = vision.get("tokens_per_image")
    if vision.get("pruning") and isinstance(kept, int):
        images = fixed.get("images", opts.get("images") or [1])
        return dim, sorted({n * kept for n in (images if isinstance(images, list) else [images])})
    merge = int(package.manifest["vision"].get("spatial_merge_size", 1) or 1) ** 2
    patches = fixed.get("patches")
    if patches is None and "patches" in resolution:
        # the image tokens of every (images, patches) gear of the vision build
        per_image = resolution["patches"][1]
        patches = sorted({n * v for n in opts.get("images") or [1] for v in per_image})
    if patches is None:
        chain = package.manifest.get("pipeline", {}).get("image") or []
        pixels = (samples.shapes(package, chain[0]) or {}).get("pixel_values") if chain else None
        patches = None if pixels is None else int(pixels[0])
    if patches is None:
        return dim, 1
    return dim, [p // merge for p in patches] if isinstance(patches, list) else int(patches) // merge


def _patches_per_image(manifest: dict) -> int | None:
    vision = manifest.get("vision", {})
    pre = vision.get("preprocess") or {}
    size, patch = vision.get("image_size"), pre.get("patch_size")
    if isinstance(size, list) and len(size) == 2 and isinstance(patch, int) and patch > 0:
        return (size[0] // patch) * (size[1] // patch)
    return None


def _raise_errors(findings: list[precheck.Finding]) -> None:
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise CheckFailed(
            f"Ascend precheck failed ({len(errors)} problem(s)): " + "; ".join(str(e) for e in errors)
        )


def _plan(
    build: str,
    graph: str,
    file: str,
    variant: str,
    role: str,
    model: ir.Model,
    opts: dict,
    ctx: gears.DimContext,
) -> gears.Build:
    b = gears.plan(build, graph, variant, role, graph_signature(model)["inputs"], opts, ctx)
    b.file = file
    return b


def _precision(info: dict, report: lower.LowerReport, opts: dict) -> str:
    """--precision_mode_v2 for a graph: the target's choice, or one derived from the package precision."""
    quantized = report.quantized or info.get("precision") in ascend_limits.QUANTIZED_PRECISIONS
    chosen = opts["precision"]
    if chosen == "auto":
        chosen = "mixed_float16" if info.get("precision") == "mixed" else "fp16"
    if quantized and chosen == "origin":
        raise VlmcError(
            f"graph precision {info.get('precision')} is quantized; ATC refuses precision origin for "
            "quantized models; use fp16 or mixed_float16"
        )
    return chosen


def _command(
    b: gears.Build, info: dict, report: lower.LowerReport, opts: dict, soc_version: str
) -> atc.AtcCommand:
    quantized = report.quantized or info.get("precision") in ascend_limits.QUANTIZED_PRECISIONS
    precision = _precision(info, report, opts)
    args: dict[str, str] = {
        "model": f"../../graphs/{b.file}",
        "framework": atc.FRAMEWORK_ONNX,
        "output": f"../../om/{b.name}",
        "soc_version": soc_version,
        "input_format": b.input_format,
        "input_shape": b.input_shape_text(),
    }
    if b.profiles:
        args["dynamic_dims"] = b.dynamic_dims_text()
    args["precision_mode_v2"] = precision
    files: dict[str, str] = {}
    if report.kept_fp32:
        if precision == "origin":
            logger.warning("%s: keep_dtype is dropped: it has no effect with precision origin", b.name)
        else:
            files["keep_dtype.cfg"] = "".join(f"{n}\n" for n in report.kept_fp32)
            args["keep_dtype"] = "keep_dtype.cfg"
    if opts.get("keep_fp32_ops") and precision.startswith("mixed_"):
        mixlist = {"black-list": {"to-add": list(opts["keep_fp32_ops"])}}
        files["modify_mixlist.json"] = json.dumps(mixlist, indent=2) + "\n"
        args["modify_mixlist"] = "modify_mixlist.json"
    for key in ("log", "host_env_os", "host_env_cpu"):
        if opts.get(key):
            args[key] = opts[key]
    return atc.build(args, quantized=quantized, sequence=b.input_format == "ND" and b.sequence, files=files)
