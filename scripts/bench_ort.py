"""The ort target on the 512 M real-width LLaVA: INT4 build vs the INT4 package vs FP32, same threads.

Makes the model (scripts/bench.py's ``llava-1.5`` size: real widths, 1 decoder + 2 vision layers,
random weights), exports it, quantizes the decoder to INT4 (RTN, group 128) with the signed scale
rule and with absmax, and compiles the FP32 package and the signed INT4 package with ``--target ort``
(MatMulNBits for INT4; RMSNorm, rotary and attention fused in both). Reports bytes on disk, the
first-token logit cosine of each variant against the FP32 package (demo image), the compile checks,
and the decode-step rate of each decoder (FP32 package, FP32 ort build, INT4 package, INT4 ort
build, and the INT4 ort build with the fusions off: MatMulNBits alone) in alternating rounds,
medians. The INT4 package's embedding table is also quantized to INT8 and to INT4 (quantize's
``embeddings`` option) for the bytes-on-disk and cosine rows.

    .venv/bin/python scripts/bench_ort.py --root /tmp/bench-ort --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

logger = logging.getLogger(__name__)

PROMPT = "Describe the image."


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _rule_of(pkg: Path) -> str | None:
    """The INT4 scale rule a saved package's decoder was quantized with (None: none there)."""
    try:
        m = json.loads((pkg / "vlmc.json").read_text())
    except OSError:
        return None
    return ((m["graphs"]["decoder"].get("quantization") or {}).get("weights") or {}).get("scale_rule")


def prepare(root: Path, group: int, force: bool, cosines: bool = True) -> dict:
    """The FP32 package, the INT4 package and its ort build under ``root`` (kept for later runs)."""
    import bench

    from vlmc import backends, exporters, manager, recipe
    from vlmc.package import Package

    root.mkdir(parents=True, exist_ok=True)
    fp32, int4, build = root / "fp32", root / "int4", root / "int4-ort"
    timings = {}
    if force or not (fp32 / "vlmc.json").is_file():
        model_dir, params = bench.make_model_dir("llava-1.5", root)
        t = time.perf_counter()
        exporters.export(exporters.load_source(str(model_dir))).save(fp32, force=True)
        timings["export_s"] = time.perf_counter() - t
        timings["params"] = params
    stale = False
    for rule, dest in (("signed", int4), ("absmax", root / "int4-absmax")):
        if not force and _rule_of(dest) == rule:
            continue
        scheme = {"weights": "int4", "group_size": group, "int4_scale": rule}
        steps = recipe.from_dict(
            {"passes": [{"quantize": {"decoder": scheme, "eval_samples": 0, "eval_tokens": 0}}]}
        ).steps
        t = time.perf_counter()
        manager.run(Package.load(fp32), steps).save(dest, force=True)
        timings[f"quantize_{rule}_s"] = time.perf_counter() - t
        stale = stale or rule == "signed"  # the build was compiled from the INT4 package replaced here
    if force or stale or not (build / "compile.json").is_file():
        t = time.perf_counter()
        backends.get("ort").compile(Package.load(int4), build, {"backend": "ort"}, force=True)
        timings["compile_s"] = time.perf_counter() - t
    for bits, dest in (("int8", root / "int4-emb8"), ("int4", root / "int4-emb4")):
        # The INT4 package with its embedding table quantized too (quantize's `embeddings` option).
        if not force and not stale and (dest / "vlmc.json").is_file():
            continue
        emb = {"weights": bits, "embeddings": True, "group_size": group}
        steps = recipe.from_dict(
            {"passes": [{"quantize": {"embed_tokens": emb, "eval_samples": 0, "eval_tokens": 0}}]}
        ).steps
        t = time.perf_counter()
        manager.run(Package.load(int4), steps).save(dest, force=True)
        timings[f"quantize_embed_{bits}_s"] = time.perf_counter() - t
    unfused = root / "int4-ort-unfused"  # MatMulNBits alone: what the fusions add on top, side by side
    if force or stale or not (unfused / "compile.json").is_file():
        off = {"fuse_norms": False, "fuse_rotary": False, "fuse_attention": False}
        backends.get("ort").compile(Package.load(int4), unfused, {"backend": "ort", **off}, force=True)
    fp32_build = root / "fp32-ort"
    if force or "export_s" in timings or not (fp32_build / "compile.json").is_file():
        t = time.perf_counter()
        backends.get("ort").compile(Package.load(fp32), fp32_build, {"backend": "ort"}, force=True)
        timings["compile_fp32_s"] = time.perf_counter() - t
    summary = json.loads((build / "compile.json").read_text())
    timings["check"] = summary["graphs"]["decoder"]["check"]["outputs"]["logits"]
    timings["fusions"] = {
        k: {"fused": v.get("fused"), "rms_relative": (v.get("check") or {}).get("outputs", {}).get("logits")}
        for k, v in summary["graphs"]["decoder"].get("fusions", {}).items()
    }
    fp32_summary = json.loads((fp32_build / "compile.json").read_text())
    timings["check_fp32"] = fp32_summary["graphs"]["decoder"]["check"]["outputs"]["logits"]
    timings["bytes"] = {
        "fp32": _du(fp32),
        "fp32-ort": _du(fp32_build / "package"),
        "int4": _du(int4),
        "int4-ort": _du(build / "package"),
        "int4-emb8": _du(root / "int4-emb8"),
        "int4-emb4": _du(root / "int4-emb4"),
    }
    if cosines:
        timings["cosine_vs_fp32"] = _cosines(root)
    return timings


def _cosines(root: Path) -> dict:
    """First-token logit cosine against FP32 of each INT4 variant (demo image, same prompt)."""
    from vlmc.package import Package
    from vlmc.runtime import Pipeline

    logits = {}
    for name, path in (
        ("fp32", root / "fp32"),
        ("int4-signed", root / "int4"),
        ("int4-absmax", root / "int4-absmax"),
        ("int4-ort", root / "int4-ort" / "package"),
        ("fp32-ort", root / "fp32-ort" / "package"),
        ("int4-emb8", root / "int4-emb8"),
        ("int4-emb4", root / "int4-emb4"),
    ):
        pipe = Pipeline(Package.load(path), threads=2)
        try:
            logits[name] = _one(pipe, 1)[1].prefill_logits[0].astype(np.float64)
        finally:
            pipe.close()
    ref = logits.pop("fp32")
    return {k: float(v @ ref / (np.linalg.norm(v) * np.linalg.norm(ref))) for k, v in logits.items()}


def _one(pipe, tokens: int) -> tuple[float, object]:
    t = time.perf_counter()
    res = pipe.generate([PROMPT], [["demo"]], max_new_tokens=tokens)
    return time.perf_counter() - t, res


def _decode_feed(past: int) -> dict:
    """One decode step of the 512 M decoder (batch 1, one new position after ``past`` cached ones)."""
    rng = np.random.default_rng(0)
    feed = {
        "inputs_embeds": rng.standard_normal((1, 1, 4096)).astype(np.float32) * 0.02,
        "attention_mask": np.ones((1, past + 1), np.int64),
        "position_ids": np.array([[past]], np.int64),
    }
    for kind in ("key", "value"):
        feed[f"past_key_values.0.{kind}"] = rng.standard_normal((1, 32, past, 128)).astype(np.float32)
    return feed


def measure(root: Path, rounds: int, steps: int, threads: int, past: int) -> dict:
    """Decode-step latency of each decoder, in the session `vlmc run` opens, alternating, medians.

    Timing whole generations and subtracting the 1-token one gave nonsense on this loaded machine (an
    8-token run finished before the 1-token one), so one decode step (past = ``past`` positions, the
    demo prompt's length) is timed directly: ``steps`` calls per round after one warm call.
    """
    from vlmc import ortsession
    from vlmc.package import Package

    variants = {
        "fp32": root / "fp32",
        "fp32-ort": root / "fp32-ort" / "package",
        "int4": root / "int4",
        "int4-ort": root / "int4-ort" / "package",
        "int4-ort-unfused": root / "int4-ort-unfused" / "package",
    }
    sessions = {k: ortsession.for_graph(Package.load(v), "decoder", threads) for k, v in variants.items()}
    feed = _decode_feed(past)
    times: dict = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            sess = sessions[name]
            sess.run(["logits"], feed)  # warm
            n = 1 if name == "int4" else steps
            t = time.perf_counter()
            for _ in range(n):
                sess.run(["logits"], feed)
            times[name].append((time.perf_counter() - t) / n)
            print(f"round {r} {name}: {1 / times[name][-1]:.2f} tok/s", flush=True)
    med = {k: 1 / statistics.median(v) for k, v in times.items()}
    return {"decode_tok_s": med, "step_seconds": times, "threads": threads, "rounds": rounds, "past": past}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="where the model, packages and build are kept")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--steps", type=int, default=5, help="timed decode steps per round (1 for the INT4 package)"
    )
    ap.add_argument("--past", type=int, default=600, help="cached positions at the timed decode step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--force", action="store_true", help="rebuild the packages")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument(
        "--no-cosines",
        action="store_true",
        help="skip the first-token cosines (a run that only times decode)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = {"prepare": prepare(args.root, args.group_size, args.force, cosines=not args.no_cosines)}
    print(json.dumps(result["prepare"], indent=1), flush=True)
    if not args.prepare_only:
        result["measure"] = measure(args.root, args.rounds, args.steps, args.threads, args.past)
    (args.root / "bench_ort.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("measure", {}).get("decode_tok_s", {}), indent=1))


if __name__ == "__main__":
    main()
