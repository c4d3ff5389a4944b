"""The compatibility matrix: every built-in family x recipe x executor, run the way a user runs it.

Each family is exported once (``vlmc export``) and every recipe's passes run on that package
(``vlmc optimize``). A cell is one executor on the result, the demo image and prompt, 6 new tokens:

- ``ort``: ``vlmc run PACKAGE`` on onnxruntime;
- ``reference``: ``vlmc compile PACKAGE --soc Ascend910B4`` then
  ``vlmc run BUILD --executor reference --against PACKAGE``: the lowered graphs on CPU, token by
  token against the package.

A cell is ``ok`` (the package's tokens: on the build, all of them agree; for a lossy build, one with
Ascend INT8/INT4 ops that the 910B computes in fp16, the fidelity rule of :func:`judge`), ``refused`` (a
pass or the compile refused the combination in one line, exit 2: the reason is recorded) or ``FAIL``
(anything else: an internal error, a run error after a successful build, or tokens that disagree).

Each (family, recipe) runs in its own process with a time limit, two at a time. ``make matrix`` runs
all of them and writes docs/compatibility.md (the table and every refusal and failure) and
docs/compatibility.json (what tests/integration/test_compatibility_matrix.py checks a few cells against).

    python scripts/matrix.py                         # everything, 2 processes
    python scripts/matrix.py --families tiny-llava --recipes fp16 --out /tmp/m.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Describe the image."
TOKENS = 6
SOC = "Ascend910B4"
EXECUTORS = ("ort", "reference")
RUN_ARGS = ("--image", "demo", "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--json")
CELL_TIMEOUT_S = 900
# The fidelity rule of a lossy build (one with Ascend quantized ops, see lossy_graphs) on the reference
# executor with the 910B's fp16 arithmetic, against the package: key of runner.agreement -> (what, least).
FIDELITY = {
    "prefill_top1": ("first token agreement", 1.0),
    "prefill_logits_cosine": ("first-token logits cosine", 0.99),
    "prefill_top5": ("first-token top-5 overlap", 0.6),
}

_INT8 = {"weights": "int8", "activations": "int8", "calibration": {"count": 4}}
_QUIET = {"eval_samples": 0, "eval_tokens": 0}
_PRUNE = {"calibration_images": 0, "picture": False}  # keep and method: per package (_passes)

# name -> (what it is, passes). "prune" steps take the family's scoring method (see _passes).
RECIPES: dict[str, tuple[str, list[dict]]] = {
    "fp16": (
        "FP16 vision and decoder",
        [{"quantize": {"vision": {"weights": "fp16"}, "decoder": {"weights": "fp16"}, **_QUIET}}],
    ),
    "prune": (
        "prune_visual_tokens to half the visual tokens per image",
        [{"prune_visual_tokens": _PRUNE}],
    ),
    "int8-vision": (
        "INT8 static vision (calibrated), FP32 decoder",
        [{"quantize": {"vision": _INT8, **_QUIET}}],
    ),
    "qwen-vl-deploy": (
        "prune + INT8 vision + FP16 decoder + merge + paged 128 (the Qwen-VL deployment)",
        [
            {"prune_visual_tokens": _PRUNE},
            {"quantize": {"vision": _INT8, "decoder": {"weights": "fp16"}, **_QUIET}},
            {"merge": {}},
            {"paged_kv": {"block_size": 128}},
        ],
    ),
    "fold-tp2-paged": (
        "fold_constants + simplify + tensor_parallel 2 + paged 16",
        [
            {"fold_constants": {}},
            {"simplify": {}},
            {"tensor_parallel": {"size": 2}},
            {"paged_kv": {"block_size": 16}},
        ],
    ),
    "fold-awq4-paged": (
        "fold_constants + AWQ INT4 decoder (group 32) + paged 16",
        [
            {"fold_constants": {}},
            {
                "quantize": {
                    "decoder": {
                        "weights": "int4",
                        "method": "awq",
                        "group_size": 32,
                        "calibration": {"count": 2},
                    },
                    **_QUIET,
                }
            },
            {"paged_kv": {"block_size": 16}},
        ],
    ),
    "int8-vision-merge": (
        "INT8 vision + merge, contiguous KV",
        [{"quantize": {"vision": _INT8, **_QUIET}}, {"merge": {}}],
    ),
}


def builtins() -> list[str]:
    """The built-in tiny models (``vlmc export --list``), one per family variant."""
    from vlmc import exporters
    from vlmc.exporters import zoo

    exporters.families()  # family modules register their built-ins on import
    return sorted(zoo.BUILTINS)


# ---- one cell, in its own process -------------------------------------------------------------------
def _cli(*args: str) -> tuple[int, str, str]:
    from click.testing import CliRunner

    from vlmc.cli import main

    res = CliRunner().invoke(main, list(args))
    err = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        err += f"\ninternal error: {type(res.exception).__name__}: {res.exception}"
    return res.exit_code, res.stdout, err


def _reason(code: int, out: str, err: str) -> str:
    """The one line that says why: vlmc's error line, else the last line printed."""
    lines = [ln.strip() for ln in (err + "\n" + out).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("vlmc: error:", "internal error:")):
            return ln.removeprefix("vlmc: error:").strip()
    return lines[-1] if lines else f"exit {code}"


def _json_line(out: str) -> dict:
    return json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{")))


def _passes(recipe: str, source: Path) -> list[dict]:
    """The recipe's steps for this package: pruning keeps half the visual tokens per image (a count:
    dynamic-resolution families take no ratio; theirs is the demo image's), with the best scoring method
    the manifest's ``vision.attention`` facts support: CLS attention where they name a CLS query
    (``query_index``), the attention each patch receives where they name none, and the uniform
    baseline where the exporter recorded no attention (Qwen-VL: its tokens are the resampler's
    queries, each at a fixed place of the image grid)."""
    from vlmc.package import Package
    from vlmc.runtime import Pipeline

    steps = list(RECIPES[recipe][1])
    if not any("prune_visual_tokens" in s for s in steps):
        return steps
    pkg = Package.load(source)
    vision = pkg.manifest["vision"]
    visual = vision.get("tokens_per_image")  # per image the vision graph sees (an InternVL tile)
    if not isinstance(visual, int):  # the grid decides: the demo image's own count
        ids = Pipeline(pkg).prepare([PROMPT], [["demo"]]).input_ids
        visual = int((ids == int(vision["image_token_id"])).sum())
    att = vision.get("attention") or {}
    if not att:
        method = "uniform"
    elif att.get("query_index") is not None:
        method = "cls_attention"
    else:
        method = "attention_received"
    prune = {**_PRUNE, "keep": max(1, visual // 2), "method": method}
    return [{"prune_visual_tokens": prune} if "prune_visual_tokens" in s else s for s in steps]


def run_cell(source: Path, recipe: str, work: Path) -> dict:
    """Optimize the exported ``source`` with ``recipe`` and run both executors; the cell's record."""
    work.mkdir(parents=True, exist_ok=True)
    rec = work / "recipe.json"
    rec.write_text(json.dumps({"passes": _passes(recipe, source)}))
    pkg, build = work / "package", work / "build"
    cell: dict = {}
    t0 = time.perf_counter()
    code, out, err = _cli("optimize", str(source), "-r", str(rec), "-o", str(pkg), "--force")
    if code != 0:
        status = "refused" if code == 2 else "FAIL"
        why = f"optimize: {_reason(code, out, err)}"
        return {e: {"status": status, "reason": why} for e in EXECUTORS}
    code, out, err = _cli("run", str(pkg), *RUN_ARGS)
    tokens = None
    if code == 0:
        tokens = _json_line(out)["tokens"][0]
        cell["ort"] = {"status": "ok", "tokens": tokens}
    else:
        cell["ort"] = {"status": "FAIL", "reason": f"run: {_reason(code, out, err)}"}
    code, out, err = _cli("compile", str(pkg), "--soc", SOC, "-o", str(build), "--force")
    if code != 0:
        status = "refused" if code == 2 else "FAIL"
        cell["reference"] = {"status": status, "reason": f"compile: {_reason(code, out, err)}"}
    else:
        cell["reference"] = reference_cell(pkg, build, tokens)
    cell["seconds"] = round(time.perf_counter() - t0, 1)
    # CPU time of this process and its rank processes: the machine's load does not change it
    own, ranks = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cell["cpu_seconds"] = round(own.ru_utime + own.ru_stime + ranks.ru_utime + ranks.ru_stime, 1)
    return cell


def reference_cell(pkg: Path, build: Path, package_tokens: list[int] | None = None) -> dict:
    """The ``reference`` cell of a compiled ``pkg``: ``vlmc run BUILD --executor reference --against PKG``,
    judged token-exact against the package in the build's storage formats (:func:`deploy_format`), or by
    :data:`FIDELITY` where the build is lossy (:func:`lossy_graphs`)."""
    lossy = lossy_graphs(build)
    with tempfile.TemporaryDirectory(prefix="vlmc-deploy-format-") as tmp:
        # A build that is not lossy computes the package's function on what it stores, so it is judged
        # token-exact against the package holding the same (deploy_format: a paged build's KV pools in
        # float16); a lossy one against the package itself by FIDELITY, its exact leg in exact_agreement.
        against, formats = (pkg, []) if lossy else deploy_format(pkg, build, Path(tmp) / "package")
        code, out, err = _cli(
            "run", str(build), "--executor", "reference", "--against", str(against), *RUN_ARGS
        )
    if code != 0:
        return {"status": "FAIL", "reason": f"run: {_reason(code, out, err)}"}
    got = _json_line(out)
    agree, row = got["agreement"], got["tokens"][0]
    exact = exact_agreement(pkg, build) if lossy else None
    failed = judge(agree, exact)
    cell: dict = {
        "status": "FAIL" if failed else "ok",
        "tokens": row,
        "agree": f"{agree['tokens_agree']}/{agree['tokens']}",
    }
    if formats:
        cell["formats"] = formats
    if lossy:
        cell["lossy"] = lossy
        cell["fidelity"] = {
            **{key: agree[key] for key in FIDELITY},
            "exact_agree": f"{exact['tokens_agree']}/{exact['tokens']}",
            "exact_max_logit_diff": exact.get("max_logit_diff"),
            "exact_formats": exact.get("formats", []),
        }
    # --against runs the package on the pixels the build ran on: a build with resolution gears resizes the
    # image to a compiled resolution (docs/ascend.md "Resolution gears"), and its tokens are then the
    # package's on that image, not on the original one.
    fitted = exact["package_tokens"] if lossy else row  # the package's (or its stored form's) tokens there
    if not failed and package_tokens is not None and fitted != package_tokens and _resizes(build):
        cell["resized"] = True
    if failed:
        cell["reason"] = failed
    return cell


def _resizes(build: Path) -> bool:
    """Whether the build's resolution gears resize the demo image (its runtime manifest's facts)."""
    from vlmc.runtime import preprocess
    from vlmc.runtime.executors import build as runner

    _, rpkg = runner.read_build(build)
    return bool(preprocess.fit_to_gears(["demo"], rpkg.manifest["vision"]["preprocess"])[1])


def lossy_graphs(build: Path) -> list[str]:
    """The graphs of a build whose lowering put Ascend quantized ops in (compile.json ``graphs[*].lowering``):
    AscendQuant/AscendDequant (INT8 static), NPUWeightQuantBatchMatmulV2 (weight-only) or AscendAntiQuant.
    The 910B computes those in fp16 where the package's QDQ graph computes in fp32 (docs/atc-facts.md,
    "Quantized models"), so the build is not bit-exact against the package."""
    graphs = json.loads((build / "compile.json").read_text()).get("graphs") or {}
    out = []
    for name, entry in sorted(graphs.items()):
        low = (entry or {}).get("lowering") or {}
        if low.get("quantized_layers") or low.get("weight_only_layers") or low.get("antiquant_constants"):
            out.append(name)
    return out


def deploy_format(pkg: Path, build: Path, out: Path) -> tuple[Path, list[str]]:
    """The package with the build's storage formats where they are not the package's, and what differs.

    Two tensors of a build are stored in float16 whatever arithmetic its kernels run in, and no kernel's
    float32 mode undoes that:

    - a weight-only layer's ``antiquant_scale`` (compile.json ``lowering.weight_only_layers``):
      NPUWeightQuantBatchMatmulV2 takes it in the type of x, float16 on the NPU (hicann/ops-nn
      ``weight_quant_batch_matmul_v2_proto.h``), where the package multiplies by the float32 scale the
      quantize pass recorded (the manifest's ``quantization.weights.nodes[*].scale``);
    - a paged build's KV pools (compile.json ``paged_kv.dtype``): ReshapeAndCache / ScatterPaKvCache take
      float16 rows and caches only (vlmc/backends/ascend/pools.py), where the package's pools are float32.

    So the package is given the same: those scales rounded to float16, and the pools' float16 IO the
    backend gives the lowered graph (its own ``fp16_pool_io``). Written to ``out`` when anything differs;
    else ``pkg`` itself.
    """
    import numpy as np
    import onnx_ir as ir

    from vlmc.backends.ascend.pools import POOL_DTYPE, fp16_pool_io
    from vlmc.package import Package

    record = json.loads((build / "compile.json").read_text())
    package = Package.load(pkg)
    changed: list[str] = []
    for name, entry in sorted((record.get("graphs") or {}).items()):
        layers = ((entry or {}).get("lowering") or {}).get("weight_only_layers") or []
        facts = ((package.info(name).get("quantization") or {}).get("weights") or {}).get("nodes") or {}
        scales = [facts[n]["scale"] for n in layers if n in facts]
        if not scales:
            continue
        model = package.model(name)
        for scale in scales:
            v = model.graph.initializers[scale]
            v.const_value = ir.Tensor(
                v.const_value.numpy().astype(np.float16).astype(np.float32), name=v.name
            )
        package.set_graph(name, model)
        changed.append(f"{name}: {len(scales)} antiquant_scale in float16")
    if (record.get("paged_kv") or {}).get("dtype") == POOL_DTYPE:
        for name in package.graph_names:
            model = package.model(name)
            if fp16_pool_io(model):
                package.set_graph(name, model)
                changed.append(f"{name}: KV pools in float16")
    if not changed:
        return pkg, changed
    package.save(out, force=True)
    return out, changed


def exact_agreement(pkg: Path, build: Path) -> dict:
    """:func:`runner.agreement` of the build on the reference executor with its Ascend kernels in float32
    arithmetic (``ReferenceDevice(fp16=False)``) against the package in the build's storage formats
    (:func:`deploy_format`), on the pixels the build runs on.

    The lowering changes the graph's form, not the function it computes: in float32 the lowered graph must
    give the tokens of the package holding what the build holds, so a lowering bug (a wrong scale, bias or
    weight layout) shows here whatever the fp16 arithmetic does. ``package_tokens`` are the package's own
    on those pixels.
    """
    from vlmc.package import Package
    from vlmc.runtime import Pipeline, preprocess
    from vlmc.runtime.executors import build as runner
    from vlmc.runtime.executors.reference import ReferenceDevice

    summary, rpkg = runner.read_build(build)
    if summary.get("tensor_parallel"):
        return {"tokens_agree": 0, "tokens": TOKENS, "error": "a tensor-parallel build (runs one process)"}
    images, _ = preprocess.fit_to_gears(["demo"], rpkg.manifest["vision"]["preprocess"])
    pad = int(rpkg.manifest["text"].get("pad_token_id") or 0)
    with tempfile.TemporaryDirectory(prefix="vlmc-deploy-format-") as tmp:
        stored, formats = deploy_format(pkg, build, Path(tmp) / "package")
        executor = runner.BuildExecutor(build, summary, ReferenceDevice(fp16=False), pad_token_id=pad)
        on_build, on_stored = Pipeline(rpkg, executor=executor), Pipeline(Package.load(stored))
        on_package = Pipeline(Package.load(pkg)) if stored != pkg else on_stored
        try:
            got = on_build.generate([PROMPT], [images], TOKENS)
            ref = on_stored.generate([PROMPT], [images], TOKENS)
            own = on_package.generate([PROMPT], [images], TOKENS) if on_package is not on_stored else ref
        finally:
            for p in {id(x): x for x in (on_build, on_stored, on_package)}.values():
                p.close()
    return {**runner.agreement(ref, got), "package_tokens": own.tokens[0], "formats": formats}


def shortfalls(agree: dict) -> list[str]:
    """The :data:`FIDELITY` bounds an agreement (fp16 run against the package) falls short of."""
    return [
        f"{what} {agree[key]:.4g} < {least:g}"
        for key, (what, least) in FIDELITY.items()
        if not agree[key] >= least  # a NaN fails too
    ]


def judge(agree: dict, exact: dict | None) -> str | None:
    """Why a reference cell fails, or None when it is ok.

    ``agree`` is the build's agreement with the package (the 910B's fp16 arithmetic emulated); ``exact``
    the same with the Ascend kernels in float32, for a lossy build (None: not lossy). A build that is not
    lossy must give every package token. A lossy one must give every token in exact arithmetic, and with
    fp16 meet :data:`FIDELITY` on the first token's logits: fp16 rounding of INT8 activations moves
    logits by a few hundredths on these random-weight models, whose next-token logits are often nearer
    than that (a tie the rounding may break either way), while a build that computes something else
    fails one of the two.
    """
    tokens = f"{agree['tokens_agree']} of {agree['tokens']} tokens agree with the package on the same pixels"
    if exact is None:
        return None if agree["tokens_agree"] == agree["tokens"] else tokens
    if exact.get("error"):
        return f"lossy build: the exact-arithmetic check cannot run {exact['error']}"
    if exact["tokens_agree"] != exact["tokens"]:
        return (
            f"with the Ascend kernels in exact arithmetic {exact['tokens_agree']} of {exact['tokens']} tokens "
            "agree with the package: the lowered graph computes something else"
        )
    short = shortfalls(agree)
    if short:
        return f"fp16 (as on the 910B): {', '.join(short)} ({tokens})"
    return None


def _export(name: str, out: Path) -> tuple[int, str, str]:
    return _cli("export", name, "-o", str(out), "--force")


def _child(argv: list[str]) -> None:
    """``--cell SOURCE RECIPE WORK`` / ``--export NAME OUT``: one unit of work, its record on stdout."""
    logging.basicConfig(level=logging.WARNING)
    if argv[0] == "--export":
        code, out, err = _export(argv[1], Path(argv[2]))
        print(json.dumps({"code": code, "reason": _reason(code, out, err) if code else ""}))
    else:
        print(json.dumps(run_cell(Path(argv[1]), argv[2], Path(argv[3]))))


def _spawn(args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    try:
        return _json_line(proc.stdout)
    except (StopIteration, json.JSONDecodeError):
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0]}


# ---- the whole matrix --------------------------------------------------------------------------------
def run_matrix(families: list[str], recipes: list[str], work: Path, jobs: int = 2) -> dict:
    """Export every family once, then every (family, recipe) cell, ``jobs`` processes at a time."""
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"cells": {}, "exports": {}}
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        exports = {
            f: pool.submit(_spawn, ["--export", f, str(work / f / "export")], CELL_TIMEOUT_S)
            for f in families
        }
        for f, fut in exports.items():
            r = fut.result()
            results["exports"][f] = r.get("reason") or r.get("error") or ""
            logger.warning("export %s: %s", f, results["exports"][f] or "ok")
        cells = {}
        for f in families:
            for r in recipes:
                if results["exports"][f]:
                    why = f"export: {results['exports'][f]}"
                    results["cells"].setdefault(f, {})[r] = {
                        e: {"status": "FAIL", "reason": why} for e in EXECUTORS
                    }
                    continue
                args = ["--cell", str(work / f / "export"), r, str(work / f / r)]
                cells[(f, r)] = pool.submit(_spawn, args, CELL_TIMEOUT_S)
        for (f, r), fut in cells.items():
            rec = fut.result()
            if "error" in rec:
                rec = {e: {"status": "FAIL", "reason": rec["error"]} for e in EXECUTORS}
            results["cells"].setdefault(f, {})[r] = rec
            logger.warning(
                "%s x %s: %s (%s s)",
                f,
                r,
                ", ".join(f"{e} {rec[e]['status']}" for e in EXECUTORS),
                rec.get("seconds"),
            )
    results["seconds"] = round(time.perf_counter() - t0, 1)
    results["jobs"] = jobs
    return results


def summary(results: dict) -> dict[str, int]:
    counts = {"ok": 0, "refused": 0, "FAIL": 0}
    for row in results["cells"].values():
        for cell in row.values():
            for e in EXECUTORS:
                counts[cell[e]["status"]] += 1
    return counts


def markdown(results: dict, families: list[str], recipes: list[str]) -> str:
    """docs/compatibility.md: the table, then every refusal and failure with its reason."""
    counts = summary(results)
    cpu = sum(c.get("cpu_seconds", 0) for row in results["cells"].values() for c in row.values())
    notes: list[str] = []
    index: dict[str, int] = {}

    def mark(cell: dict) -> str:
        if cell["status"] == "ok":
            toks = cell.get("agree") or f"{len(cell['tokens'])} tok"
            lossy = " lossy" if cell.get("lossy") else ""
            return f"ok {toks}{lossy}" + (" (resized)" if cell.get("resized") else "")
        reason = cell["reason"]
        if reason not in index:
            notes.append(reason)
            index[reason] = len(notes)
        return f"{'refused' if cell['status'] == 'refused' else '**FAIL**'} [{index[reason]}]"

    lines = [
        "# Compatibility matrix",
        "",
        "Generated by `make matrix` (`scripts/matrix.py`); do not edit by hand. Every built-in family",
        f"(`vlmc export --list`) x recipe x executor, on the demo image, prompt {PROMPT!r}, {TOKENS} new",
        "tokens. `ort`: `vlmc run PACKAGE` on onnxruntime. `ref`: `vlmc compile PACKAGE --soc "
        f"{SOC}`, then `vlmc run BUILD --executor reference --against PACKAGE` (the lowered graphs on CPU;",
        "`ok a/b`: a of the b package tokens agree, the package run on the pixels the build ran on; fewer",
        "than 6 when the model emits EOS; `(resized)`: the build's resolution gears resized the demo image",
        'to a compiled resolution (docs/ascend.md, "Resolution gears"), so both ran on that image and the',
        "tokens differ from the package's on the original one). `lossy`: the build's INT8/INT4 Ascend ops",
        "compute in fp16 on the 910B where the package computes in fp32, and the cell is judged by the",
        "fidelity rule below instead of token by token. A paged build's KV pools are float16 whatever",
        "the package's are (compile.json `paged_kv.dtype`: ReshapeAndCache takes float16, bfloat16 or int8",
        "caches, [ATB ReshapeAndCacheOperation, CANN 8.0.RC2](https://www.hiascend.com/document/detail/zh/"
        'canncommercial/80RC2/apiref/ascendtbapi/ascendtb_01_0073.html); docs/ascend.md, "Paged decoder',
        'builds"), so a paged build that is not lossy is judged token by token against the package with',
        "float16 pools (a near-tie in the logits may go the other way against float32 ones; a build that",
        "computes something else still fails). `refused`: a pass",
        "or the compile refused the combination in one line (the reason below); `FAIL`: anything else.",
        "",
        f"**Summary: {counts['ok']} working, {counts['refused']} refused, {counts['FAIL']} failing** "
        f"(of {sum(counts.values())} cells; {results['seconds'] / 60:.1f} min on {results.get('jobs', 2)} processes"
        + (f", {cpu / 60:.1f} CPU-min in the cells" if cpu else "")
        + ").",
        "",
        "Recipes:",
        "",
    ]
    lines += [f"- `{r}`: {RECIPES[r][0]}" for r in recipes]
    lines += ["", "| family | " + " | ".join(f"{r} ort | {r} ref" for r in recipes) + " |"]
    lines.append("|---|" + "---|" * (2 * len(recipes)))
    for f in families:
        row = results["cells"][f]
        lines.append(f"| {f} | " + " | ".join(mark(row[r][e]) for r in recipes for e in EXECUTORS) + " |")
    lines += ["", "## Lossy builds", ""]
    lines += [
        "A build is lossy when its lowering put Ascend quantized ops in (compile.json `graphs[*].lowering`:",
        "AscendQuant/AscendDequant for INT8 static, NPUWeightQuantBatchMatmulV2 for weight-only INT4/INT8,",
        "AscendAntiQuant). The 910B computes AscendQuant in fp16 (x and 1/s cast to fp16, then rint) and",
        'AscendDequant\'s output in fp16 (docs/atc-facts.md, "Quantized models"); the reference executor',
        "emulates that, and one fp16 rounding step in one activation moves a later INT8 value by a whole",
        "quantization step. On these random-weight models the next-token logits are often nearer than the",
        "few hundredths that moves them (a tie either side may win), and a pruning TopK may swap two tokens",
        "whose scores differ below fp16's resolution, so token-exact agreement with the fp32 package is",
        "not what a correct build gives. A lossy cell is `ok` when both hold:",
        "",
        "1. **exact arithmetic:** the build on the reference executor with its Ascend kernels in float32",
        "   gives every token of the package in the build's storage formats (the lowering changed the",
        "   graph's form, not its function: a wrong scale, bias or weight layout fails here). Two tensors",
        "   are float16 in the build whatever its kernels compute in, so the package is given the same",
        "   for this leg: a weight-only layer's antiquant_scale (NPUWeightQuantBatchMatmulV2 takes it in",
        "   the type of x, float16 on the NPU) and a paged build's KV pools (ReshapeAndCache takes float16",
        '   only); docs/ascend.md, "Reference executor", has the measurement that showed it;',
        "2. **fidelity with the 910B's fp16:** on the first token's logits against the package's, the",
        f"   best token agrees, the cosine is at least {FIDELITY['prefill_logits_cosine'][1]:g} and at least "
        f"{FIDELITY['prefill_top5'][1]:.0%} of the",
        "   package's 5 best tokens are among the build's 5 best.",
        "",
        "The reference executor runs the standard ONNX ops in the package's own precision; ATC's default",
        "`--precision_mode_v2=fp16` computes an fp32 package's float ops in fp16 on the card as well, so a",
        "card's numbers may differ from the package's more than these (docs/ascend.md, \"What is not",
        'verified").',
        "",
        "`tests/integration/test_compatibility_matrix.py` checks that a build with a wrong activation scale",
        "fails both, a weight-only build with two layers' weights swapped the first, and a paged build",
        "with two weights swapped the token-by-token check against the package with float16 pools.",
        "",
        "The lossy cells of this run. `exact max Δ`: the float32 leg's largest logit difference from that",
        "package while the tokens agree. An INT8 static build's integer kernels are not the package's float",
        "QDQ arithmetic to the last bit (AscendQuant multiplies by 1/s where QuantizeLinear divides by s, and",
        "an int32 sum is exact where a float one rounds): a value at a rounding boundary may land on the",
        "neighbouring INT8 step, and each such step moves the next layer's inputs across more boundaries",
        '(docs/ascend.md, "Reference executor", follows one through the Qwen-VL vision encoder).',
        "",
        "| family | recipe | tokens (fp16) | first token | first-token cosine | top-5 | exact arithmetic "
        "| exact max Δ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in families:
        for r in recipes:
            cell = results["cells"][f][r]["reference"]
            fid = cell.get("fidelity")
            if fid:
                lines.append(
                    f"| {f} | {r} | {cell['agree']} | {'agrees' if fid['prefill_top1'] == 1 else 'differs'} "
                    f"| {fid['prefill_logits_cosine']:.6f} | {fid['prefill_top5']:.1f} | {fid['exact_agree']} "
                    f"| {_num(fid.get('exact_max_logit_diff'))} |"
                )
    lines += ["", "## Refusals and failures", ""]
    lines += [f"{i}. {n.replace('|', '/')}" for i, n in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.2g}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", help="built-ins (default: all)")
    ap.add_argument("--recipes", nargs="*", choices=sorted(RECIPES), help="recipes (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work", type=Path, help="where packages and builds go (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "compatibility.md")
    ap.add_argument("--render", type=Path, help="only write --out again from a run's .json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.render:
        results = json.loads(args.render.read_text())
        families, recipes = (
            sorted(results["cells"]),
            [r for r in RECIPES if r in next(iter(results["cells"].values()))],
        )
    else:
        families = args.families or builtins()
        recipes = args.recipes or list(RECIPES)
        with tempfile.TemporaryDirectory(prefix="vlmc-matrix-") as tmp:
            results = run_matrix(families, recipes, args.work or Path(tmp), args.jobs)
    args.out.write_text(markdown(results, families, recipes))
    if not args.render:
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    counts = summary(results)
    print(f"{counts['ok']} working, {counts['refused']} refused, {counts['FAIL']} failing -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
