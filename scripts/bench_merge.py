"""Benchmark: first-token latency of a merged package (one `vlm` graph) vs the split stages, on ORT CPU.

Both packages come from one export of a LLaVA-architecture model with random weights (a CLIP-B/16
width vision tower and a 1024-wide decoder; tiny-llava with ``--quick``). First-token latency is
the reference runtime's `generate_from(..., max_new_tokens=1)` on the same prepared inputs:
vision, embedding, placeholder scatter and prefill, in alternating runs.

``run(rows, quick)`` is what ``make bench`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

VISION = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=4,
    num_attention_heads=12,
    image_size=224,
    patch_size=16,
    projection_dim=768,
)
TEXT = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=16,
)
RUNS = 5


def _source(quick: bool):
    import torch
    from transformers import LlavaForConditionalGeneration

    from vlmc import exporters
    from vlmc.exporters import Source, zoo

    if quick:
        return exporters.load_source("tiny-llava")
    cfg = zoo.tiny_llava_config(**TEXT)
    for k, v in VISION.items():
        setattr(cfg.vision_config, k, v)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    exporters._eager(model)
    return Source(name="bench-merge", model=model, config=model.config, family="llava")


def run(rows: list, quick: bool = False) -> list:
    """Append rows in scripts/bench.py's format and return them."""
    from vlmc import exporters, manager, recipe
    from vlmc.package import Package
    from vlmc.runtime import Pipeline

    with tempfile.TemporaryDirectory() as tmp:
        split_dir = exporters.export(_source(quick)).save(Path(tmp) / "split")
        merged = manager.run(Package.load(split_dir), recipe.parse("passes: [merge]").steps)
        merged_dir = merged.save(Path(tmp) / "merged")
        pipes = {
            "split stages": Pipeline(Package.load(split_dir)),
            "merged vlm": Pipeline(Package.load(merged_dir)),
        }
        inputs = {k: p.prepare(["Describe the image."], [["demo"]]) for k, p in pipes.items()}
        firsts = {
            k: p.generate_from(inputs[k], 1).tokens for k, p in pipes.items()
        }  # warm-up, and equal tokens
        times: dict[str, list[float]] = {k: [] for k in pipes}
        for _ in range(RUNS):
            for k, p in pipes.items():
                t0 = time.perf_counter()
                p.generate_from(inputs[k], 1)
                times[k].append((time.perf_counter() - t0) * 1000)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = [
        {
            "benchmark": "merge: first-token latency (ORT CPU)",
            "setting": k,
            "metric": "median ms",
            "value": round(med[k], 1),
            "ratio": round(med[k] / med["split stages"], 3),
            "notes": f"{RUNS} alternating runs; same first token: {firsts[k] == firsts['split stages']}",
        }
        for k in pipes
    ]
    rows.extend(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny-llava (smoke test)")
    for row in run([], quick=ap.parse_args().quick):
        print(row)


if __name__ == "__main__":
    main()
