"""Serving many requests on one package: aggregate decode throughput and time to first token at 1, 4
and 8 concurrent requests against one at a time, a chat's second turn with and without reuse, and
requests that arrive while others decode, prefilled whole or in chunks (the running sequences' stall).

    python scripts/bench_serve.py                      # the 512 M real-width LLaVA-1.5, paged, onnxruntime CPU
    python scripts/bench_serve.py --package PKG_DIR    # any paged package
    python scripts/bench_serve.py --quick              # the tiny built-in (a smoke run)
    python scripts/bench_serve.py --build              # also its Ascend build, on the reference executor

The reference build (`--build`) is the package compiled for Ascend910B4 with batch gears 1, 4 and 8,
run by the reference executor (the build's graphs on onnxruntime CPU, float16 pools as on the card):
it measures the scheduler over a build's fixed pool and gears, not NPU speed.

Arrivals: the same requests, the next one submitted every 2 scheduler steps, so each prompt is prefilled
while earlier ones decode; the gap between two tokens of a running request shows how long a prefill stalls
it: whole prompts in one step (``prefill_chunk`` None, the scheduler before chunking) against chunks of 256.

Every request's tokens are checked against the same request run alone; a mismatch fails the run.
Rounds alternate between the concurrency levels so a noisy machine moves them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Describe the image.",
    "What is in this picture?",
    "List the colours you see.",
    "Is there a person here?",
    "Write one sentence about it.",
    "What could this be used for?",
    "Where might this be?",
    "Give it a title.",
]


def _package(args, tmp: Path) -> Path:
    if args.package:
        return args.package
    vlmc = str(Path(sys.executable).parent / "vlmc")
    recipe = tmp / "paged.yaml"
    if args.quick:
        recipe.write_text("model: tiny-llava\npasses:\n  - paged_kv: {block_size: 16}\n")
    else:
        sys.path.insert(0, str(REPO / "scripts"))
        import bench

        model_dir, _ = bench.make_model_dir("llava-1.5", tmp)
        recipe.write_text(f"model: {model_dir}\npasses:\n  - paged_kv: {{block_size: 16}}\n")
    subprocess.run([vlmc, "-q", "build", "--recipe", str(recipe), "-o", str(tmp / "out")], check=True)
    return tmp / "out" / "package"


def _build(package: Path, tmp: Path) -> Path:
    """The package compiled for Ascend with the batch gears the workload uses (1, 4 and 8)."""
    vlmc = str(Path(sys.executable).parent / "vlmc")
    recipe, out = tmp / "build.yaml", tmp / "build"
    recipe.write_text("target: {backend: ascend, soc: Ascend910B4, batch_sizes: [1, 4, 8]}\n")
    subprocess.run([vlmc, "-q", "compile", str(package), "-r", str(recipe), "-o", str(out)], check=True)
    return out


def _open(path: Path, executor: str | None, threads: int):
    from vlmc import runtime

    return runtime.open(path, executor=executor, threads=threads)


def _requests(n: int, new_tokens: int):
    from vlmc.runtime.scheduler import Request

    return [Request(PROMPTS[i % len(PROMPTS)], [f"demo:{i}"], new_tokens) for i in range(n)]


def _workload(pipe, concurrency: int, n: int, new_tokens: int) -> dict:
    from vlmc.runtime.scheduler import Scheduler

    sched = Scheduler(pipe, max_batch=concurrency, num_blocks=4096, prefix_cache=False, image_cache=0)
    reqs = _requests(n, new_tokens)
    t0 = time.perf_counter()
    sched.run(reqs)
    wall = time.perf_counter() - t0
    st = sched.stats
    sched.close()
    return {
        "tokens": [r.tokens for r in reqs],
        "wall_seconds": wall,
        "decode_tok_s": st["decode_tokens"] / st["decode_seconds"] if st["decode_seconds"] else 0.0,
        "total_tok_s": sum(len(r.tokens) for r in reqs) / wall,
        "ttft_median": statistics.median(r.time_to_first_token for r in reqs),
    }


def _second_turn(pipe, reuse: bool, new_tokens: int) -> tuple[float, float]:
    from vlmc.runtime.conversation import Conversation
    from vlmc.runtime.scheduler import Scheduler

    sched = Scheduler(pipe, max_batch=1, num_blocks=4096, prefix_cache=reuse, image_cache=16 if reuse else 0)
    conv = Conversation(pipe, new_tokens, scheduler=sched)
    first = conv.ask("Describe the image.", ["demo:1"]).time_to_first_token
    second = conv.ask("And what colour is it?").time_to_first_token
    sched.close()
    return first, second


CHUNKS = {"whole prompts": None, "chunks of 256": 256}


def _arrivals(pipe, chunk: int | None, n: int, new_tokens: int, every: int = 2) -> dict:
    """Request k is submitted after 2k scheduler steps: each prompt is prefilled while others decode."""
    from vlmc.runtime.scheduler import Scheduler

    sched = Scheduler(
        pipe, max_batch=8, num_blocks=4096, prefix_cache=False, image_cache=0, prefill_chunk=chunk
    )
    reqs = _requests(n, new_tokens)
    stamps: dict[int, list[float]] = {r.id: [] for r in reqs}
    for k, r in enumerate(reqs):
        r.id = k + 1
        r.on_token = lambda r, _t: stamps.setdefault(r.id, []).append(time.perf_counter())
    t0, submitted, steps = time.perf_counter(), 0, 0
    while submitted < n or sched.busy:
        if submitted < n and steps >= every * submitted:
            sched.submit(reqs[submitted])
            submitted += 1
        sched.step()
        steps += 1
    wall = time.perf_counter() - t0
    sched.close()
    gaps = sorted(b - a for r in reqs for a, b in zip(stamps[r.id], stamps[r.id][1:]))
    return {
        "tokens": [r.tokens for r in reqs],
        "wall_seconds": wall,
        "max_gap": gaps[-1],
        "p90_gap": gaps[int(0.9 * (len(gaps) - 1))],
        "median_gap": statistics.median(gaps),
        "ttft_median": statistics.median(r.time_to_first_token for r in reqs),
    }


def measure_arrivals(pipe, rounds: int, requests: int, new_tokens: int, alone: list) -> dict:
    """Medians per prefill mode, alternating; every request's tokens must equal it alone."""
    runs: dict[str, list[dict]] = {name: [] for name in CHUNKS}
    for _ in range(rounds):
        for name, chunk in CHUNKS.items():
            runs[name].append(_arrivals(pipe, chunk, requests, new_tokens))
    for name in CHUNKS:
        if any(r["tokens"] != alone for r in runs[name]):
            raise SystemExit(
                f"bench_serve: arrivals with {name}: a request's tokens differ from it run alone"
            )
    keys = ("max_gap", "p90_gap", "median_gap", "ttft_median", "wall_seconds")
    return {name: {k: statistics.median(r[k] for r in runs[name]) for k in keys} for name in CHUNKS}


def arrivals_table(arr: dict) -> list[str]:
    base = arr["whole prompts"]
    rows = [
        "| prefill of arriving requests | longest gap between two tokens | vs whole prompts | 90th percentile gap "
        "| median gap | median time to first token | workload s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in arr.items():
        rows.append(
            f"| {name} | {m['max_gap']:.3f} s | **{m['max_gap'] / base['max_gap']:.2f}×** | "
            f"{m['p90_gap']:.3f} s | {m['median_gap']:.3f} s | {m['ttft_median']:.3f} s | {m['wall_seconds']:.1f} |"
        )
    return rows


def measure(pipe, rounds: int, requests: int, new_tokens: int, turns: bool = True) -> tuple[dict, dict]:
    """Medians per concurrency level, and (``turns``) the chat turns' times to first token (reuse, no
    reuse)."""
    levels = [1, 4, 8]
    runs: dict[int, list[dict]] = {c: [] for c in levels}
    for _ in range(rounds):
        for c in levels:  # alternating, so drift on a shared machine moves every level alike
            runs[c].append(_workload(pipe, c, requests, new_tokens))
    alone = runs[1][0]["tokens"]
    for c in levels:
        if any(r["tokens"] != alone for r in runs[c]):
            raise SystemExit(f"bench_serve: at concurrency {c} a request's tokens differ from it run alone")
    chat: dict[str, list] = {"reuse": [], "no reuse": []}
    for _ in range(rounds if turns else 0):
        for name in chat:
            chat[name].append(_second_turn(pipe, name == "reuse", new_tokens))
    keys = ("decode_tok_s", "total_tok_s", "ttft_median", "wall_seconds")
    med = {c: {k: statistics.median(r[k] for r in runs[c]) for k in keys} for c in levels}
    med[1]["tokens"] = alone
    return med, chat


def level_table(med: dict) -> list[str]:
    rows = [
        "| concurrent requests | decode tok/s (aggregate) | vs one at a time | tok/s incl. prefill | "
        "median time to first token | workload s |",
        "|---|---|---|---|---|---|",
    ]
    for c, m in med.items():
        rows.append(
            f"| {c} | {m['decode_tok_s']:.1f} | **{m['decode_tok_s'] / med[1]['decode_tok_s']:.2f}×** | "
            f"{m['total_tok_s']:.1f} | {m['ttft_median']:.3f} s | {m['wall_seconds']:.1f} |"
        )
    return rows


def turn_table(turns: dict) -> list[str]:
    first, second, plain = _turn_medians(turns)
    return [
        "| chat turn | time to first token | vs first turn |",
        "|---|---|---|",
        f"| first turn (image + prompt) | {first:.3f} s | 1.00× |",
        f"| second turn, prefix and image reused | {second:.3f} s | **{second / first:.2f}×** |",
        f"| second turn, nothing reused | {plain:.3f} s | {plain / first:.2f}× |",
    ]


def _turn_medians(turns: dict) -> tuple[float, float, float]:
    return (
        statistics.median(t[0] for t in turns["reuse"]),
        statistics.median(t[1] for t in turns["reuse"]),
        statistics.median(t[1] for t in turns["no reuse"]),
    )


def run(rows: list[dict], quick: bool) -> None:
    """`make bench` rows (scripts/bench.py runs every bench_*.py's run): the tiny built-in when quick."""
    args = argparse.Namespace(package=None, quick=quick)
    model = "tiny-llava" if quick else "llava-1.5 512 M"
    with tempfile.TemporaryDirectory() as tmp:
        package = _package(args, Path(tmp))
        pipe = _open(package, None, 2)
        med, turns = measure(pipe, 1 if quick else 3, 8, 16)
        arrivals = measure_arrivals(pipe, 1 if quick else 3, 8, 16, med[1].pop("tokens"))
        pipe.close()
        pipe = _open(_build(package, Path(tmp)), "reference", 2)
        built, _ = measure(pipe, 1, 8, 16, turns=False)
        built[1].pop("tokens")
        pipe.close()
    _level_rows(rows, f"{model}, paged", med)
    _level_rows(rows, f"{model}, its Ascend build on the reference executor", built)
    base = arrivals["whole prompts"]
    for name, m in arrivals.items():
        rows.append(
            {
                "benchmark": "serve",
                "setting": f"{model}, paged, a request arriving every 2 steps, {name}",
                "metric": "longest gap between two tokens",
                "value": f"{m['max_gap']:.3f} s",
                "ratio": f"{m['max_gap'] / base['max_gap']:.2f}× whole prompts",
                "notes": f"90th percentile gap {m['p90_gap']:.3f} s; median TTFT {m['ttft_median']:.3f} s; "
                f"workload {m['wall_seconds']:.1f} s; every request's tokens = it alone",
            }
        )
    first, second, plain = _turn_medians(turns)
    rows.append(
        {
            "benchmark": "serve",
            "setting": f"{model}, chat second turn",
            "metric": "time to first token",
            "value": f"{second:.3f} s",
            "ratio": f"{second / first:.2f}× the first turn",
            "notes": f"without reuse {plain:.3f} s ({plain / first:.2f}×)",
        }
    )


def _level_rows(rows: list[dict], setting: str, med: dict) -> None:
    for c, m in med.items():
        rows.append(
            {
                "benchmark": "serve",
                "setting": f"{setting}, {c} concurrent",
                "metric": "aggregate decode tok/s",
                "value": f"{m['decode_tok_s']:.1f}",
                "ratio": f"{m['decode_tok_s'] / med[1]['decode_tok_s']:.2f}× one at a time",
                "notes": f"median TTFT {m['ttft_median']:.3f} s; every request's tokens = it alone",
            }
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", type=Path, help="a paged package (default: build the 512 M LLaVA-1.5)")
    ap.add_argument("--quick", action="store_true", help="the tiny built-in, 1 round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--build", action="store_true", help="also compile the package for Ascend and serve that")
    ap.add_argument("--build-rounds", type=int, default=1)
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        package = _package(args, Path(tmp))
        pipe = _open(package, None, args.threads)
        med, turns = measure(pipe, args.rounds, args.requests, args.new_tokens)
        arrivals = measure_arrivals(pipe, args.rounds, args.requests, args.new_tokens, med[1].pop("tokens"))
        pipe.close()
        print(
            "\n".join(
                [
                    "package (onnxruntime CPU):",
                    *level_table(med),
                    "",
                    *turn_table(turns),
                    "",
                    "requests arriving every 2 steps:",
                    *arrivals_table(arrivals),
                ]
            )
        )
        results = {"levels": {str(c): m for c, m in med.items()}, "turns": turns, "arrivals": arrivals}
        if args.build:
            pipe = _open(_build(package, Path(tmp)), "reference", args.threads)
            built, _ = measure(pipe, args.build_rounds, args.requests, args.new_tokens, turns=False)
            built[1].pop("tokens")
            pipe.close()
            print("\n".join(["", "Ascend build on the reference executor:", *level_table(built)]))
            results["build_levels"] = {str(c): m for c, m in built.items()}
    load = os.getloadavg()
    print(
        f"\n{args.requests} requests x {args.new_tokens} new tokens, {args.rounds} rounds, {args.threads} threads; "
        f"load average at the end {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
