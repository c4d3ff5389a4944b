"""Write a planned Ascend build directory: graphs, per-build ATC commands, build.sh, atc.mk and compile.json."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
from pathlib import Path

import onnx_ir as ir

from vlmc import interop, outdir, paths, tensor_names
from vlmc.backends import BUILD_MARKER
from vlmc.backends.ascend import atc, gears, pools, rank_builds, soc
from vlmc.backends.ascend.options import NAME
from vlmc.package import Package
from vlmc.package import signature as graph_signature
from vlmc.runtime import preprocess

logger = logging.getLogger(__name__)


def summary(package: Package, opts: dict, resolution: soc.Resolution, plan: dict) -> dict:
    """compile.json: the SoC, each graph's lowering report, every build with what a host runner needs."""
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
                **runner_facts(b, graph_signature(plan["files"][b.file])),
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
        "runner": dict(RUNNER),
        "paged_kv": paged_kv_host_write(package.manifest.get("kv", {}), plan["builds"]),
        "tensor_parallel": rank_builds.host_schedule(package.manifest, plan["builds"]),
        # resolution gears of a dynamic-resolution package, and how an image reaches one (docs/ascend.md)
        "resolution": plan.get("resolution"),
        "warnings": plan["warnings"] + ([resolution.warning] if resolution.warning else []),
        "run": None,
    }


# Where the host runner reads the facts below (docs/ascend.md, "Running on a 910B").
RUNTIME_DIR = (
    "runtime"  # the package's manifest and tokenizer files, without graphs: `vlmc run BUILD_DIR` reads it
)
DYNAMIC_INPUT = "ascend_mbatch_shape_data"
RUNNER = {
    "runtime_package": RUNTIME_DIR,
    "dynamic_input": DYNAMIC_INPUT,
    "dims_vector": (
        "for a build with gears, aclmdlSetInputDynamicDims takes every input's full shape (gear values in "
        "place of the -1s) concatenated in input order: builds[*].dims_vector.order; the index of the "
        f"{DYNAMIC_INPUT} input comes from aclmdlGetInputIndexByName"
    ),
    "inputs": "builds[*].inputs: the build's inputs in order with dtype, shape (-1 = gear) and symbolic dims",
    "gears": "builds[*].gears: one value per -1 of input_shape, in order (gear_symbols names each)",
    "sources": [
        "https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/aclcppdevg_03_0312.html",
        "https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/aclpythondevg_01_0168.html",
        "hicann/ge docs/zh/user_guides/atc_tools/CLI_options/--dynamic_dims.md",
    ],
}


def runner_facts(b: gears.Build, signature: dict) -> dict:
    """What a host program needs to feed one build: its IO in order, its gears and the dims-vector order."""
    dims = {i["name"]: i["shape"] for i in signature["inputs"]}
    shapes = dict(b.input_shape)
    inputs = [
        {"name": i["name"], "dtype": i["dtype"], "shape": list(shapes[i["name"]]), "dims": dims[i["name"]]}
        for i in signature["inputs"]
    ]
    outputs = [{"name": o["name"], "dtype": o["dtype"], "dims": o["shape"]} for o in signature["outputs"]]
    return {
        "inputs": inputs,
        "outputs": outputs,
        "gears": [list(p) for p in b.profiles],
        "gear_symbols": list(b.symbols),
        "dims_vector": dims_vector_order(b.input_shape) if b.profiles else None,
    }


def dims_vector_order(input_shape: list[tuple[str, list[int]]]) -> list[str]:
    """``name[axis]`` for every dim of every input, in the order aclmdlSetInputDynamicDims takes them."""
    return [f"{name}[{axis}]" for name, shape in input_shape for axis in range(len(shape))]


def _pool_shapes(b: gears.Build) -> list[list[int]]:
    """Each key pool's [num_blocks, block_size, kv_heads, head_dim] (a stacked key_cache: one layer's)."""
    per_layer = [dims for name, dims in b.input_shape if name.startswith(tensor_names.CACHE_PREFIX["key"])]
    axis = tensor_names.layer_axis("key_cache")
    return per_layer + [
        list(dims[:axis]) + list(dims[axis + 1 :]) for name, dims in b.input_shape if name == "key_cache"
    ]


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
        "builds": {b.name: shapes[0] for b in builds if (shapes := _pool_shapes(b))},
        "block_size": kv.get("block_size"),
        "dtype": pools.POOL_DTYPE,
        "reserved_blocks": (
            "block 0 is never given to a sequence (unused block_tables entries point at it), so a pool holds "
            "max_blocks x max batch + 1 blocks"
        ),
        "pools": (
            f"allocate key_cache and value_cache once on the device, [{layers}, num_blocks, block_size, kv_heads, "
            "head_dim] ND (the builds take all layers stacked, layer i at offset i x one layer's bytes; a build "
            "left per layer takes key_cache.{i} / value_cache.{i}), and bind the same buffers as the build's "
            "inputs every step; the .om never writes them"
        ),
        "write": {
            "when": "after every decoder_prefill / decoder_decode execution, before the next step",
            "op": (
                "ATB ReshapeAndCacheOperation (one per layer; keyCache/valueCache are updated in place), or "
                "acl.rt.memcpy host-to-device of each run of consecutive slots (what vlmc's AclDevice does)"
            ),
            "key": "new_key.{i} [batch, seq, kv_heads, head_dim] viewed as [batch*seq, kv_heads, head_dim]",
            "value": "new_value.{i}, viewed the same way",
            "slotMapping": "the step's slot_mapping flattened to [batch*seq] int32",
            "padding": (
                "slot_mapping < 0 marks padding; CANN 8.2.RC1 documents negative slots as not copied "
                "(ascendtb_01_0242); on older CANN drop those rows on the host first"
            ),
            "dtype": (
                "float16: the builds take float16 key_cache/value_cache and return float16 new_key/new_value "
                "(the lowered graph's own IO, so no --input_fp16_nodes/--output_type is needed); allocate "
                "the pools in float16, which is what ReshapeAndCache and aclnnScatterPaKvCache take"
            ),
            "alternative": "aclnnScatterPaKvCache(key, keyCacheRef, slotMapping, value, valueCacheRef)",
        },
        "sources": list(_PAGED_SOURCES),
    }


def write(out_dir: Path, plan: dict, summary: dict, force: bool, package: Package | None = None) -> None:
    with outdir.atomic(out_dir, force) as tmp:
        (tmp / "graphs").mkdir(parents=True)
        for file, model in plan["files"].items():
            if file not in plan["shared"]:
                # weights stream one tensor at a time from where they are (the package's data file,
                # the lowering's store) to the build's data file
                interop.save(model, tmp / "graphs" / file)
        for file, base in plan["shared"].items():
            _save_sharing(plan["files"][file], tmp / "graphs" / file, tmp / "graphs" / base)
        for b in plan["builds"]:
            cmd = plan["commands"][b.name]
            bdir = tmp / "builds" / b.name
            bdir.mkdir(parents=True)
            for fname, text in cmd.files.items():
                (bdir / fname).write_text(text)
            (bdir / "atc.cmd").write_text(cmd.shell() + "\n")
        if package is not None:
            write_runtime_package(package, plan, tmp / RUNTIME_DIR)
        (tmp / "build.sh").write_text(_build_sh(plan))
        os.chmod(tmp / "build.sh", 0o755)
        (tmp / "atc.mk").write_text(_makefile(plan))
        (tmp / "compile.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        if summary.get("tensor_parallel"):
            table = rank_builds.rank_table(summary["tensor_parallel"]["size"])
            (tmp / rank_builds.RANK_TABLE).write_text(json.dumps(table, indent=2) + "\n")
        (tmp / BUILD_MARKER).write_text(
            json.dumps({"backend": NAME, "compile": "compile.json"}, indent=2) + "\n"
        )


def write_runtime_package(package: Package, plan: dict, dest: Path) -> None:
    """The package's manifest and tokenizer files, without graphs: what `vlmc run BUILD_DIR` needs beside the builds.

    A paged package whose pool size was left symbolic gets the builds' static pool size as
    ``kv.num_blocks``: the runner's block allocator must hand out exactly the blocks the .om's pools have.
    A build with resolution gears gets them as ``vision.preprocess.gears``, so the runtime fits each image.
    """
    dest.mkdir(parents=True)
    manifest = json.loads(json.dumps(package.manifest))
    pool = next((dims for b in plan["builds"] if (dims := _pool_shapes(b))), None)
    if pool and not isinstance(manifest["kv"].get("num_blocks"), int):
        manifest["kv"]["num_blocks"] = int(pool[0][0])
    resolution = plan.get("resolution")
    if resolution:
        # what the runtime's preprocessing fits each image to (vlmc.runtime.preprocess.fit_to_gears)
        manifest["vision"]["preprocess"][preprocess.GEARS_KEY] = dict(resolution["runtime"])
    (dest / "vlmc.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for rel, blob in sorted(package.files.items()):
        if _runtime_file(rel):  # the same files as from a saved package's directory below
            _copy_inside(dest, rel, blob)
    root = package.root
    if root is None:
        return
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_dir() or p.is_symlink() or rel in package.files or not _runtime_file(rel):
            continue
        _copy_inside(dest, rel, paths.regular_file(root, rel, "a package file", str(root)).read_bytes())


def _runtime_file(rel: str) -> bool:
    """A package file the runtime reads (tokenizer, chat template, source config), not graphs, samples or reports."""
    if rel.endswith((".onnx", ".onnx.data", ".data")) or rel.startswith("samples/"):
        return False
    return rel not in ("vlmc.json", "report.md", "report.json", "verify.json")


def _copy_inside(dest: Path, rel: str, blob: bytes | Path) -> None:
    target = paths.inside(dest, rel, "a package file", str(dest))
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(blob, Path):
        outdir.copy_file(blob, target)
    else:
        target.write_bytes(blob)


def _save_sharing(model: ir.Model, path: Path, base: Path) -> None:
    """Write ``model`` so that its weights also in ``base`` (same name and size) point at base's data.

    Weights the base does not hold go to ``<path>.data`` (64-byte aligned), one tensor at a time;
    nothing of the base is read.
    """
    stored = {
        v.name: v.const_value
        for v in ir.load(str(base)).graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor)
    }
    data = path.name + ".data"
    stubs: dict[ir.Value, ir.TensorProtocol] = {}
    with contextlib.ExitStack() as stack:
        own = None  # the prefill graph's own data file, opened for the first tensor base does not hold
        for v in model.graph.initializers.values():
            t, there = v.const_value, stored.get(v.name)
            if t is None:
                continue
            if there is not None and there.length == t.nbytes:
                location, offset, length = there.location, there.offset, there.length
            elif t.nbytes >= interop.EXTERNAL_DATA_THRESHOLD:
                if own is None:
                    own = stack.enter_context(open(path.parent / data, "wb"))
                own.write(b"\0" * (-own.tell() % 64))
                location, offset = data, own.tell()
                raw = t.tobytes()
                own.write(raw)
                length = len(raw)
                del raw
            else:
                continue
            stubs[v] = ir.ExternalTensor(
                location, offset, length, t.dtype, shape=t.shape, name=t.name, base_dir=path.parent
            )
    interop.write(model, path, stubs)


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
