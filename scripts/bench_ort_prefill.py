"""Time to first token and decode rate of two ort builds of the 512 M LLaVA, alternating: LM head sliced or not.

Makes (or reuses under ``--root``) scripts/bench.py's ``llava-1.5`` model, its FP32 package and the INT4
(RTN, group 128) package, compiles each with ``--target ort`` with ``last_logits`` on and off, and
times ``generate`` (demo image, one prompt) in alternating rounds at the same threads: the first token
(vision + prefill + LM head) and the decode rate of the next tokens. Medians and per-round ratios.

    .venv/bin/python scripts/bench_ort_prefill.py --root /tmp/bench-ort --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

PROMPT = "Describe the image."


def _prepare(root: Path, precisions: list[str]) -> dict[str, Path]:
    import bench

    from vlmc import backends, exporters, manager, recipe
    from vlmc.package import Package

    root.mkdir(parents=True, exist_ok=True)
    fp32 = root / "fp32"
    if not (fp32 / "vlmc.json").is_file():
        model_dir, _ = bench.make_model_dir("llava-1.5", root)
        exporters.export(exporters.load_source(str(model_dir))).save(fp32, force=True)
    pkgs = {"fp32": fp32}
    if "int4" in precisions:
        int4 = root / "int4"
        if not (int4 / "vlmc.json").is_file():
            scheme = {"weights": "int4", "group_size": 128}
            steps = recipe.from_dict(
                {"passes": [{"quantize": {"decoder": scheme, "eval_samples": 0, "eval_tokens": 0}}]}
            ).steps
            manager.run(Package.load(fp32), steps).save(int4, force=True)
        pkgs["int4"] = int4
    builds = {}
    for prec in precisions:
        for last in (False, True):
            out = root / f"{prec}-ort-last{int(last)}"
            if not (out / "compile.json").is_file():
                target = {"backend": "ort", "last_logits": last}
                backends.get("ort").compile(Package.load(pkgs[prec]), out, target, force=True)
            builds[f"{prec}/last_logits={str(last).lower()}"] = out / "package"
    return builds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8, help="decoded tokens after the first")
    ap.add_argument("--precisions", default="int4,fp32")
    args = ap.parse_args()
    builds = _prepare(args.root, args.precisions.split(","))

    from vlmc.package import Package
    from vlmc.runtime import Pipeline

    pipes = {k: Pipeline(Package.load(p), threads=args.threads) for k, p in builds.items()}
    for pipe in pipes.values():  # sessions opened and warmed before timing
        pipe.generate([PROMPT], [["demo"]], max_new_tokens=1)
    ttft: dict[str, list[float]] = {k: [] for k in pipes}
    rate: dict[str, list[float]] = {k: [] for k in pipes}
    tokens = {}
    for r in range(args.rounds):
        order = list(pipes) if r % 2 == 0 else list(reversed(pipes))
        for k in order:
            inp = pipes[k].prepare([PROMPT], [["demo"]])
            t0 = time.perf_counter()
            pipes[k].generate_from(inp, max_new_tokens=1)
            t1 = time.perf_counter()
            res = pipes[k].generate_from(inp, max_new_tokens=1 + args.tokens)
            t2 = time.perf_counter()
            ttft[k].append(t1 - t0)
            rate[k].append(args.tokens / max((t2 - t1) - (t1 - t0), 1e-9))
            tokens[k] = res.tokens
    out = {"load": os.getloadavg(), "threads": args.threads, "rounds": args.rounds, "results": {}}
    for k in pipes:
        out["results"][k] = {
            "ttft_s_median": statistics.median(ttft[k]),
            "decode_tok_s_median": statistics.median(rate[k]),
            "ttft_s": [round(x, 3) for x in ttft[k]],
        }
    for prec in args.precisions.split(","):
        a, b = f"{prec}/last_logits=false", f"{prec}/last_logits=true"
        out[f"{prec}_ttft_ratio_off_over_on_median"] = statistics.median(
            x / y for x, y in zip(ttft[a], ttft[b])
        )
        out[f"{prec}_tokens_equal"] = tokens[a] == tokens[b]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
