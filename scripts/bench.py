"""`make bench`: what vlmc costs (build vs bare torch.onnx.export) and what its passes buy, on this machine.

Writes docs/benchmarks.md (tables, machine description, commands) and PNG plots next to it. All
numbers are medians of side-by-side interleaved runs in one invocation. `--quick` runs a tiny size
with 2 runs (the smoke test in `make test` uses it; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"

# (vision, text) overrides on the tiny LLaVA config; "2b" is ~2B parameters at real widths:
# CLIP ViT-L/14-336 (24 layers, 1024 wide) and a 2048-wide, 22-layer Llama with a 32000 vocab.
SIZES = {
    "tiny": ({}, {}),
    "small": ({"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 8,
               "image_size": 224, "patch_size": 14},
              {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
               "num_key_value_heads": 16, "vocab_size": 32000}),
    "2b": ({"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
            "image_size": 336, "patch_size": 14},
           {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "vocab_size": 32000}),
}


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import onnxruntime
    import torch
    import transformers

    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem, 1), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "onnxruntime": onnxruntime.__version__}


def make_model_dir(size: str, root: Path) -> tuple[Path, int]:
    import torch
    from transformers import LlavaForConditionalGeneration

    from vlmc.exporters import zoo

    vis, txt = SIZES[size]
    cfg = zoo.tiny_llava_config(**txt)
    for k, v in vis.items():
        setattr(cfg.vision_config, k, v)
    if txt.get("vocab_size"):
        cfg.image_token_index = txt["vocab_size"] - 1
    cfg.text_config.initializer_range = 0.02
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    params = sum(p.numel() for p in model.parameters())
    path = root / f"llava-{size}"
    model.save_pretrained(path)
    del model
    return path, params


def measure(cmd: list[str]) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPTS / "_measure.py"), *cmd], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)
    if res["returncode"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res['stderr_tail']}")
    return res


def pipeline_cost(sizes: list[str], runs: int, root: Path) -> list[dict]:
    vlmc = str(Path(sys.executable).parent / "vlmc")
    rows = []
    for size in sizes:
        model_dir, params = make_model_dir(size, root)
        recipe = root / f"{size}.yaml"
        recipe.write_text(f"model: {model_dir}\npasses: [fold_constants, simplify]\n"
                          "target: {backend: ascend, soc: Ascend910B1}\n")
        bare, built = [], []
        for _ in range(runs):  # interleaved so both sides see the same machine state
            bare.append(measure([sys.executable, str(SCRIPTS / "bare_export.py"), str(model_dir)]))
            built.append(measure([vlmc, "-q", "build", "--recipe", str(recipe), "-o", str(root / f"out-{size}"), "--force"]))
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        row = {"size": size, "params": params, "fp32_weight_bytes": params * 4, "runs": runs,
               "bare_seconds": med(bare, "seconds"), "build_seconds": med(built, "seconds"),
               "bare_peak_rss": med(bare, "peak_rss_bytes"), "build_peak_rss": med(built, "peak_rss_bytes")}
        row["time_ratio"] = row["build_seconds"] / row["bare_seconds"]
        row["rss_over_weights"] = row["build_peak_rss"] / row["fp32_weight_bytes"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def pass_benchmarks(quick: bool) -> tuple[list[dict], list[str]]:
    """Rows from the per-pass benchmark modules that exist (scripts/bench_*.py with run(rows, quick))."""
    rows: list[dict] = []
    ran = []
    for path in sorted(SCRIPTS.glob("bench_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if hasattr(mod, "run"):
            t0 = time.perf_counter()
            mod.run(rows, quick)
            ran.append(f"{path.name} ({time.perf_counter() - t0:.0f} s)")
    return rows, ran


def plot(rows: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    params = [r["params"] / 1e6 for r in rows]
    for key, label, fname in (("seconds", "wall time (s)", "pipeline_time.png"),
                              ("peak_rss", "peak RSS (GiB)", "pipeline_rss.png")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        scale = 1 if key == "seconds" else 2**30
        ax.plot(params, [r[f"bare_{key}"] / scale for r in rows], "o-", label="bare torch.onnx.export")
        ax.plot(params, [r[f"build_{key}"] / scale for r in rows], "s-", label="vlmc build")
        if key == "peak_rss":
            ax.plot(params, [r["fp32_weight_bytes"] / scale for r in rows], ":", label="FP32 weight bytes")
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def render(m: dict, cost: list[dict], pass_rows: list[dict], ran: list[str], plots: list[str], args) -> str:
    lines = ["# Benchmarks", "",
             f"Generated by `{' '.join(['python', 'scripts/bench.py', *sys.argv[1:]])}` (`make bench`) on "
             f"{time.strftime('%Y-%m-%d')}. Medians of side-by-side interleaved runs in one invocation; "
             "onnxruntime CPU stands in for the NPU.", "",
             "## Machine", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in m.items()]
    lines += ["", "## Pipeline cost: `vlmc build` vs bare `torch.onnx.export`", "",
              "`vlmc build` = export (three stages, checked, external data) + fold_constants + simplify + "
              "Ascend compile (lowering, precheck, ATC commands). The baseline exports the same three stages "
              "with `torch.onnx.export` and nothing else (scripts/bare_export.py). LLaVA-architecture models "
              "with random weights, built in code.", "",
              "| size | params | runs | bare s | build s | time ratio | bare peak RSS | build peak RSS | build RSS / FP32 weights |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in cost:
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f} M | {r['runs']} | {r['bare_seconds']:.2f} | {r['build_seconds']:.2f} | "
                     f"**{r['time_ratio']:.2f}×** | {_gib(r['bare_peak_rss'])} | {_gib(r['build_peak_rss'])} | "
                     f"**{r['rss_over_weights']:.2f}×** |")
    lines += [""] + [f"![{p}]({'bench/' + p})" for p in plots]
    lines += ["", "## What the passes buy", ""]
    if pass_rows:
        lines += ["| benchmark | setting | metric | value | ratio | notes |", "|---|---|---|---|---|---|"]
        for r in pass_rows:
            lines.append(f"| {r.get('benchmark', '')} | {r.get('setting', '')} | {r.get('metric', '')} | {r.get('value', '')} | "
                         f"{r.get('ratio', '')} | {r.get('notes', '')} |")
        lines += ["", "Modules run: " + ", ".join(ran)]
    else:
        lines.append("No per-pass benchmark modules were found.")
    lines += ["", "## Reproduce", "", "```", "make bench                      # all sizes, 5 runs",
              "python scripts/bench.py --sizes tiny small --runs 5 --out docs/benchmarks.md",
              "python scripts/bench.py --quick --out /tmp/bench.md   # smoke run (make test does this)", "```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small", "2b"], choices=list(SIZES))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny size, 2 runs, quick pass benchmarks")
    ap.add_argument("--skip-passes", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.runs = ["tiny"], 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        cost = pipeline_cost(args.sizes, args.runs, Path(tmp))
    pass_rows, ran = ([], []) if args.skip_passes else pass_benchmarks(args.quick)
    plot_dir = args.out.parent / "bench"
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots = plot(cost, plot_dir)
    args.out.write_text(render(machine(), cost, pass_rows, ran, plots, args))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
