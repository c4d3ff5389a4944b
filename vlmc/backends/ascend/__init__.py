"""Ascend backend: precheck, lower and plan a package into ATC builds (commands, configs, build.sh)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
from pathlib import Path

import onnx

from vlmc import graphs as G
from vlmc import outdir, pass_api, samples
from vlmc.backends import BUILD_MARKER
from vlmc.backends.ascend import atc, gears, lower, precheck
from vlmc.backends.ascend import soc as S
from vlmc.errors import CheckFailed, VlmcError
from vlmc.package import Package

logger = logging.getLogger(__name__)

NAME = "ascend"
DEFAULT_SEQUENCE_BUCKETS = [128, 256, 512, 1024, 2048]
PRECISIONS = ("auto", "fp16", "mixed_float16", "mixed_bfloat16", "origin")
QUANTIZED_PRECISIONS = ("int8", "int8_weight_only", "int4_weight_only")

TARGET_OPTIONS = (
    pass_api.Option("soc", str, S.FAMILY_910B, "Ascend SoC: an exact --soc_version or the family Ascend910B"),
    pass_api.Option(
        "soc_variant",
        str,
        None,
        "910B variant when soc is the family and npu-smi is absent (e.g. Ascend910B4)",
    ),
    pass_api.Option(
        "sequence_buckets", list, list(DEFAULT_SEQUENCE_BUCKETS), "prefill sequence-length gears", items=int
    ),
    pass_api.Option(
        "past_buckets", list, None, "decode past-length gears (default: sequence_buckets)", items=int
    ),
    pass_api.Option("batch_sizes", list, [1], "batch-size gears", items=int),
    pass_api.Option("images", list, [1], "images-per-request gears for vision graphs", items=int),
    pass_api.Option("dims", dict, None, "sizes for other symbolic dims: name -> int or list of ints"),
    pass_api.Option(
        "precision",
        str,
        "auto",
        "ATC --precision_mode_v2; auto derives it from the package precision",
        choices=PRECISIONS,
    ),
    pass_api.Option(
        "keep_fp32_ops",
        list,
        None,
        "Ascend IR op types kept in fp32 via --modify_mixlist (mixed_* precisions only)",
        items=str,
    ),
    pass_api.Option(
        "int4_weights",
        str,
        "int8",
        "INT4 weight storage in the lowered graph: int8 (one value per int8; builds on any CANN) or int4 "
        "(ONNX INT4, two per byte; needs an ATC that parses ONNX INT4, hicann/ge 14b93e226; unverified)",
        choices=("int8", "int4"),
    ),
    pass_api.Option("run", bool, False, "run atc when it is on PATH and collect the .om files"),
    pass_api.Option("log", str, None, "ATC --log level", choices=atc.ENUMS["log"]),
    pass_api.Option("host_env_os", str, None, "ATC --host_env_os", choices=atc.ENUMS["host_env_os"]),
    pass_api.Option("host_env_cpu", str, None, "ATC --host_env_cpu", choices=atc.ENUMS["host_env_cpu"]),
)


def check_target(opts: dict, where: str) -> None:
    """Cross-option checks for an ascend target (raises VlmcError)."""
    S.check(opts["soc"], opts.get("soc_variant"), where)
    for key in ("sequence_buckets", "past_buckets", "batch_sizes", "images"):
        values = opts.get(key)
        if values is None:
            continue
        if not values:
            raise VlmcError(f"{where}: {key} must list at least one value")
        if any(v <= 0 for v in values):
            raise VlmcError(f"{where}: {key} values must be positive, got {values}")
    for dim, v in (opts.get("dims") or {}).items():
        vals = v if isinstance(v, list) else [v]
        if not vals or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in vals):
            raise VlmcError(f"{where}: dims.{dim} must be a positive int or a list of them, got {v!r}")
    if opts.get("keep_fp32_ops") and opts.get("precision") not in ("mixed_float16", "mixed_bfloat16"):
        raise VlmcError(
            f"{where}: keep_fp32_ops needs precision mixed_float16 or mixed_bfloat16 (ATC allows "
            "--modify_mixlist only with mixed precisions)"
        )


def options(target: dict | None, where: str = "target") -> dict:
    """Validate a target mapping (its 'backend' key is ignored) and fill defaults."""
    rest = {k: v for k, v in (target or {}).items() if k != "backend"}
    out = pass_api.validate(TARGET_OPTIONS, rest, f"{where} ({NAME})")
    check_target(out, where)
    return out


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
    out_dir = Path(out_dir).resolve()
    outdir.check(out_dir, force)
    resolution = S.resolve(opts["soc"], opts.get("soc_variant"))
    plan = prepare(package, opts, resolution.soc_version)
    summary = _summary(package, opts, resolution, plan)
    _write(out_dir, plan, summary, force)
    if opts["run"]:
        summary["run"] = run_builds(out_dir, plan["commands"])
        (out_dir / "compile.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        failed = [n for n, r in summary["run"]["builds"].items() if r["status"] != "ok"]
        if failed:
            r = summary["run"]["builds"][failed[0]]
            first = r["errors"][0] if r["errors"] else "see the log"
            raise CheckFailed(f"ATC failed for {failed[0]}: {first} (log: {r['log']})")
    return summary


def prepare(package: Package, opts: dict, soc_version: str) -> dict:
    """Everything compile writes, in memory: lowered graphs, builds and ATC commands.

    Args:
        package: the package.
        opts: validated target options (see :func:`options`).
        soc_version: the exact --soc_version (see ``soc.resolve``).

    Returns:
        ``{"graphs": {name: ModelProto}, "shared": {file: base file}, "reports": {...}, "builds": [...],
        "commands": {build: AtcCommand}, "warnings": [...]}``
    """
    findings: list[precheck.Finding] = []
    bases: dict[str, Path] = {}  # build file -> directory its external weights are read from
    models: dict[str, onnx.ModelProto] = {}
    private: set[str] = set()  # graphs read from disk here: lowered in place, no copy needed
    known = set((opts.get("dims") or {}).keys())
    for name in package.graph_names:
        path = package.path_of(name)
        if path is not None:
            missing = precheck.check_external_data(path, name)
            if missing:
                findings += missing
                continue
        # A graph on disk is read privately (not cached in the package), so lowering may rewrite it
        # in place: the package's copy and a CopyFrom of it would be two more copies of the weights.
        # The lowering rules read weight values only in quantized graphs; a float graph is read
        # without its weights, which are streamed from the package's file when the build is written.
        info = package.info(name)
        needs_weights = bool(info.get("quantization")) or info.get("precision") not in ("fp32", "fp16")
        model = G.load(path, load_weights=needs_weights) if path is not None else package.graph(name)
        if path is not None:
            private.add(name)
            if not needs_weights:
                bases[f"{name}.onnx"] = path.parent
        findings += precheck.check_ops(model, name, lowered=False)
        sample = samples.load(package, name) or {}
        findings += precheck.check_inputs(model, name, known, set(sample))
        models[name] = model
    _raise_errors(findings)
    warnings = [str(f) for f in findings if f.severity == "warning"]

    lowered: dict[str, onnx.ModelProto] = {}
    reports: dict[str, lower.LowerReport] = {}
    for name in list(models):
        model = models.pop(name)
        if name not in private:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            model = copy
        lowered[name], reports[name] = lower.lower(
            model, name, package.info(name), int4_weights=opts.get("int4_weights") or "int8"
        )
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
    )
    files: dict[str, onnx.ModelProto] = {}
    shared: dict[str, str] = {}
    builds: list[gears.Build] = []
    for name, model in lowered.items():
        info = package.info(name)
        role = info["role"]
        sample = samples.load(package, name) or {}
        ctx = gears.DimContext(
            **{**ctx_base.__dict__, "sample_shapes": {k: list(v.shape) for k, v in sample.items()}}
        )
        input_names = [i.name for i in model.graph.input]
        file = f"{name}.onnx"
        files[file] = model
        if role == "decoder" and any(n.startswith("past_key_values.") for n in input_names):
            # The prefill graph shares every weight with the decode graph (_save_sharing points them
            # at its data file), so it is built from a weightless copy: no second copy of the weights.
            prefill, moved = G.weightless_copy(model)
            for t, src in moved:
                if not isinstance(src, onnx.TensorProto):  # a node-attribute tensor: not in the base's data
                    t.ClearField("data_location")
                    t.raw_data = src
            prefill, empties = lower.strip_past(prefill, name)
            if empties:
                warnings.append(
                    f"{name}: the prefill graph feeds an empty past to {empties} non-Concat consumer(s)"
                )
            pfile = f"{name}_prefill.onnx"
            files[pfile] = prefill
            shared[pfile] = file
            builds.append(_plan(f"{name}_prefill", name, pfile, "prefill", role, prefill, opts, ctx))
            builds.append(_plan(f"{name}_decode", name, file, "decode", role, model, opts, ctx))
        elif role == "decoder" and any(n.startswith("key_cache.") for n in input_names):
            builds.append(_plan(f"{name}_prefill", name, file, "prefill", role, model, opts, ctx))
            builds.append(_plan(f"{name}_decode", name, file, "decode", role, model, opts, ctx))
        else:
            builds.append(_plan(name, name, file, "full", role, model, opts, ctx))

    for file, model in files.items():
        findings += precheck.check_ops(model, file, lowered=True)
        findings += precheck.check_size(model, file)
    _raise_errors(findings)

    commands = {}
    for b in builds:
        commands[b.name] = _command(b, package.info(b.graph), reports[b.graph], opts, soc_version)
    return {
        "files": files,
        "bases": bases,
        "shared": shared,
        "reports": reports,
        "builds": builds,
        "commands": commands,
        "warnings": warnings,
    }


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
    model: onnx.ModelProto,
    opts: dict,
    ctx: gears.DimContext,
) -> gears.Build:
    b = gears.plan(build, graph, variant, role, G.signature(model)["inputs"], opts, ctx)
    b.file = file
    return b


def _precision(info: dict, report: lower.LowerReport, opts: dict) -> str:
    """--precision_mode_v2 for a graph: the target's choice, or one derived from the package precision."""
    quantized = report.quantized or info.get("precision") in QUANTIZED_PRECISIONS
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
    quantized = report.quantized or info.get("precision") in QUANTIZED_PRECISIONS
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


def _summary(package: Package, opts: dict, resolution: S.Resolution, plan: dict) -> dict:
    builds = []
    for b in plan["builds"]:
        cmd = plan["commands"][b.name]
        builds.append(
            {
                "name": b.name,
                "graph": b.graph,
                "variant": b.variant,
                "file": f"graphs/{b.file}",
                "input_shape": b.input_shape_text(),
                "dynamic_dims": b.dynamic_dims_text() or None,
                "profiles": len(b.profiles),
                "bindings": b.bindings,
                "command": cmd.shell(),
                "argv": cmd.argv(),
                "workdir": f"builds/{b.name}",
                "quantized": cmd.quantized,
                "precision_mode_v2": cmd.options.get("precision_mode_v2"),
                "config_files": sorted(cmd.files),
                "om": f"om/{b.name}.om",
                "log": f"logs/{b.name}.log",
            }
        )
        info = package.info(b.graph)
        if "rank" in info:  # a rank-local build of a tensor-parallel package
            builds[-1].update(rank=info["rank"], segment=info["segment"])
    return {
        "backend": NAME,
        "soc_version": resolution.soc_version,
        "soc_source": resolution.source,
        "model": package.manifest.get("model", {}),
        "target": dict(opts),
        "graphs": {
            name: {"lowering": r.to_dict(), "precision": package.info(name).get("precision")}
            for name, r in plan["reports"].items()
        },
        "builds": builds,
        "paged_kv": paged_kv_host_write(package.manifest.get("kv", {}), plan["builds"]),
        "tensor_parallel": tensor_parallel_host_plan(package.manifest, plan["builds"]),
        "warnings": plan["warnings"] + ([resolution.warning] if resolution.warning else []),
        "run": None,
    }


def _pool_shapes(b: gears.Build) -> list[list[int]]:
    return [dims for name, dims in b.input_shape if name.startswith("key_cache.")]


# Public CANN documentation the host-side write below follows (docs/ascend.md, "Paged decoder builds").
_PAGED_SOURCES = [
    "https://www.hiascend.com/document/detail/zh/canncommercial/80RC2/apiref/ascendtbapi/ascendtb_01_0073.html",
    "https://www.hiascend.com/document/detail/zh/canncommercial/82RC1/API/ascendtbapi/ascendtb_01_0242.html",
    "https://www.hiascend.com/document/detail/zh/CANNCommunityEdition/83RC1alpha002/API/aolapi/context/aclnnScatterPaKvCache.md",
]


def paged_kv_host_write(kv: dict, builds: list[gears.Build]) -> dict | None:
    """What the host runtime must do around a paged decoder build (interface v2), for compile.json.

    The builds only read the pools and return this step's rows; storing the rows is a runtime op
    on the device, as ATB/MindIE do it, not part of the .om. None when the package is not paged.
    """
    if kv.get("layout") != "paged":
        return None
    layers = int(kv["layers"])
    return {
        "interface": "v2",
        # Each paged build's static pool shape: the device pools must have exactly this shape.
        "builds": {b.name: pools[0] for b in builds if (pools := _pool_shapes(b))},
        "block_size": kv.get("block_size"),
        "pools": (
            f"allocate key_cache.{{i}} and value_cache.{{i}} for i < {layers} once on the device, "
            "[num_blocks, block_size, kv_heads, head_dim] ND, and bind the same buffers as the build's "
            "inputs every step; the .om never writes them"
        ),
        "write": {
            "when": "after every decoder_prefill / decoder_decode execution, before the next step",
            "op": "ATB ReshapeAndCacheOperation (one per layer; keyCache/valueCache are updated in place)",
            "key": "new_key.{i} [batch, seq, kv_heads, head_dim] viewed as [batch*seq, kv_heads, head_dim]",
            "value": "new_value.{i}, viewed the same way",
            "slotMapping": "the step's slot_mapping flattened to [batch*seq] int32",
            "padding": (
                "slot_mapping < 0 marks padding; CANN 8.2.RC1 documents negative slots as not copied "
                "(ascendtb_01_0242); on older CANN drop those rows on the host first"
            ),
            "dtype": (
                "ReshapeAndCache takes float16/bfloat16/int8 rows and caches: keep the pools in float16 "
                "and give the builds float16 cache inputs and row outputs (ATC --input_fp16_nodes / "
                "--output_type), or cast the rows before the write"
            ),
            "alternative": "aclnnScatterPaKvCache(key, keyCacheRef, slotMapping, value, valueCacheRef)",
        },
        "sources": list(_PAGED_SOURCES),
    }


# The collective the host calls between a rank's segment builds (no ONNX parser plugin registers an
# HCCL op, so no .om can hold it: shared/ascend/atc-reference.md, "Several cards").
_HCCL_SOURCES = [
    "hicann/hccl include/hccl.h: HcclAllReduce(sendBuf, recvBuf, count, dataType, op, comm, stream)",
    "hicann/hccl docs/api/context/HcclAllReduce.md",
    "hicann/ge docs/zh/user_guides/atc_tools/CLI_options/--cluster_config.md (AllGather only, not on Atlas A2)",
]
RANK_TABLE = "rank_table.json"


def rank_table(size: int) -> dict:
    """A rank table for one server with ``size`` devices, device i as rank i (the layout in
    shared/ascend/atc-reference.md). ATC does not read it; HCCL reads it at run time."""
    return {
        "status": "completed",
        "version": "1.0",
        "server_count": "1",
        "server_list": [
            {
                "server_id": "node_0",
                "device": [{"device_id": str(i), "rank_id": str(i)} for i in range(size)],
            }
        ],
    }


def tensor_parallel_host_plan(manifest: dict, builds: list[gears.Build]) -> dict | None:
    """The host plan of a tensor-parallel package in terms of builds, for compile.json; None otherwise.

    Each rank loads its own builds on its own device; a segment step runs the rank's build for the
    phase (``prefill`` or ``decode`` where the segment reads the KV cache, else the one ``full`` build),
    an all-reduce step calls HcclAllReduce (sum) from the named output into the next segment's input on every rank.
    """
    tp = manifest.get("tensor_parallel")
    if not tp:
        return None
    by_graph: dict[str, dict[str, str]] = {}
    for b in builds:
        by_graph.setdefault(b.graph, {})[b.variant] = b.name
    steps = []
    for step in tp["plan"]:
        if step["step"] == "segment":
            steps.append({**step, "builds": [by_graph[g] for g in step["graphs"]]})
        else:
            steps.append(
                {
                    **step,
                    "call": (
                        f"HcclAllReduce(sendBuf={step['input']}, recvBuf={step['output']}, count=batch*seq*hidden, "
                        "dataType=the segment output's (HCCL_DATA_TYPE_FP32 or _FP16), op=HCCL_REDUCE_SUM, comm, stream)"
                    ),
                }
            )
    size = int(tp["size"])
    return {
        "size": size,
        "ranks": {
            str(r): sorted(b.name for b in builds if manifest["graphs"][b.graph].get("rank") == r)
            for r in range(size)
        },
        "replicated_builds": sorted(b.name for b in builds if "rank" not in manifest["graphs"][b.graph]),
        "plan": steps,
        "kv_heads_per_rank": tp["kv_heads_per_rank"],
        "kv": tp["kv"],
        "rank_table": RANK_TABLE,
        "sources": list(_HCCL_SOURCES),
    }


def _write(out_dir: Path, plan: dict, summary: dict, force: bool) -> None:
    with outdir.atomic(out_dir, force) as tmp:
        (tmp / "graphs").mkdir(parents=True)
        for file, model in plan["files"].items():
            if file not in plan["shared"]:
                G.save(model, tmp / "graphs" / file, base_dir=plan["bases"].get(file))
        for file, base in plan["shared"].items():
            _save_sharing(plan["files"][file], tmp / "graphs" / file, tmp / "graphs" / base)
        for b in plan["builds"]:
            cmd = plan["commands"][b.name]
            bdir = tmp / "builds" / b.name
            bdir.mkdir(parents=True)
            for fname, text in cmd.files.items():
                (bdir / fname).write_text(text)
            (bdir / "atc.cmd").write_text(cmd.shell() + "\n")
        (tmp / "build.sh").write_text(_build_sh(plan))
        os.chmod(tmp / "build.sh", 0o755)
        (tmp / "atc.mk").write_text(_makefile(plan))
        (tmp / "compile.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        if summary.get("tensor_parallel"):
            table = rank_table(summary["tensor_parallel"]["size"])
            (tmp / RANK_TABLE).write_text(json.dumps(table, indent=2) + "\n")
        (tmp / BUILD_MARKER).write_text(
            json.dumps({"backend": NAME, "compile": "compile.json"}, indent=2) + "\n"
        )


def _save_sharing(model: onnx.ModelProto, path: Path, base: Path) -> None:
    """Write ``model`` so that tensors identical to ones in ``base`` point at base's external data."""
    saved = onnx.load(str(base), load_external_data=False)
    entries = {
        t.name: list(t.external_data)
        for t in saved.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    }
    moved = []
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            # a weightless stub (see prepare), or a weight still in the package's file: its bytes are
            # the base graph's tensor of the same name, already written there
            del t.external_data[:]
            if t.name not in entries:
                raise VlmcError(f"{path.name}: weight {t.name!r} is not in {base.name}")
            t.external_data.extend(entries[t.name])
            continue
        if t.name in entries and t.raw_data:
            info = {e.key: e.value for e in entries[t.name]}
            if int(info.get("length", -1)) != len(t.raw_data):
                continue
            moved.append((t, t.raw_data))
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            t.external_data.extend(entries[t.name])
    try:
        rest = [
            t for t in model.graph.initializer if t.raw_data and len(t.raw_data) >= G.EXTERNAL_DATA_THRESHOLD
        ]
        if rest:
            # Tensors the prefill graph does not share go to its own data file.
            _externalize(rest, path)
        path.write_bytes(model.SerializeToString(deterministic=True))
    finally:
        for t, raw in moved:
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            t.raw_data = raw


def _externalize(tensors: list[onnx.TensorProto], path: Path) -> None:
    """Move in-memory tensors' bytes to ``<path>.data`` (64-byte aligned), leaving other tensors as they are."""
    data = path.name + ".data"
    offset = 0
    with open(path.parent / data, "wb") as f:
        for t in tensors:
            pad = (-offset) % 64
            f.write(b"\0" * pad)
            offset += pad
            raw = t.raw_data
            f.write(raw)
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            G._point_at(t, data, offset, len(raw))
            offset += len(raw)


def _build_sh(plan: dict) -> str:
    lines = [
        "#!/usr/bin/env bash",
        "# Generated by vlmc compile: builds every graph with ATC; one log per build in logs/.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        'ATC="${ATC:-atc}"',
        "mkdir -p om logs",
        "build() {",
        '  local name="$1"; shift',
        '  echo "[vlmc] building $name"',
        '  if ! (cd "builds/$name" && "$ATC" "$@") > "logs/$name.log" 2>&1; then',
        '    echo "[vlmc] ATC failed for $name; see logs/$name.log" >&2',
        "    grep -E 'E[0-9A-Z][0-9]{4}|ERROR' \"logs/$name.log\" | head -20 >&2 || true",
        "    exit 1",
        "  fi",
        "}",
    ]
    for b in plan["builds"]:
        args = plan["commands"][b.name].argv()[1:]
        lines.append(f"build {shlex.quote(b.name)} " + " ".join(shlex.quote(a) for a in args))
    lines.append('echo "[vlmc] all builds done; models are in om/"')
    return "\n".join(lines) + "\n"


def _makefile(plan: dict) -> str:
    lines = [
        "# Generated by vlmc compile. Include it from a Makefile, or run: make -f atc.mk vlmc-om",
        "VLMC_ATC ?= atc",
        "VLMC_BUILD_DIR := $(dir $(lastword $(MAKEFILE_LIST)))",
        "",
        ".PHONY: vlmc-om",
        "vlmc-om: " + " ".join(f"$(VLMC_BUILD_DIR)om/{b.name}.om" for b in plan["builds"]),
        "",
    ]
    for b in plan["builds"]:
        args = " ".join(shlex.quote(a) for a in plan["commands"][b.name].argv()[1:]).replace("$", "$$")
        lines += [
            f"$(VLMC_BUILD_DIR)om/{b.name}.om: $(VLMC_BUILD_DIR)graphs/{b.file}",
            "\tmkdir -p $(VLMC_BUILD_DIR)om $(VLMC_BUILD_DIR)logs",
            f"\tcd $(VLMC_BUILD_DIR)builds/{b.name} && $(VLMC_ATC) {args} > ../../logs/{b.name}.log 2>&1",
            "",
        ]
    return "\n".join(lines)


def run_builds(out_dir: Path, commands: dict[str, atc.AtcCommand]) -> dict:
    """Run ATC for every build when it is on PATH; otherwise say so (the build files are already written)."""
    exe = shutil.which("atc")
    if exe is None:
        msg = f"atc is not on PATH; wrote everything to {out_dir}; run {out_dir / 'build.sh'} on a CANN host"
        logger.warning(msg)
        return {"status": "skipped", "message": msg, "builds": {}}
    results = {}
    for name, cmd in commands.items():
        logger.info("running ATC for %s", name)
        results[name] = atc.run(cmd, out_dir / "builds" / name, out_dir / "logs" / f"{name}.log", exe)
        if results[name]["status"] != "ok":
            break  # later builds would only repeat the failure's cause; the log names it
    status = "ok" if all(r["status"] == "ok" for r in results.values()) else "failed"
    return {"status": status, "builds": results}
