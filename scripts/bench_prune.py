"""Benchmark: LLM prefill latency on onnxruntime CPU with 576 vs 144 visual tokens (prune_visual_tokens).

The model has LLaVA-1.5 widths with random weights and fewer layers: CLIP ViT-L/14-336 vision
(hidden 1024, 16 heads, 336 px, patch 14 -> 576 tokens) and a 4096-wide Llama decoder (32 heads,
intermediate 11008). It is exported with vlmc, pruned to 144 tokens with the pass, and the decoder
graph is timed on the prefill inputs the reference runtime builds for each package (same prompt,
same image), alternating the two packages so both see the same machine state.

``run(rows, quick)`` is what ``make bench`` calls; ``--quick`` uses a tiny model (smoke test).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

PROMPT = "Describe the image in detail."
FULL = {
    "vision": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=2,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    ),
    "text": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        initializer_range=0.02,
    ),
    "keep": 144,
    "runs": 5,
}
QUICK = {
    "vision": dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=112,
        patch_size=14,
        projection_dim=48,
    ),
    "text": dict(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        initializer_range=0.02,
    ),
    "keep": 16,
    "runs": 5,
}


def _model(spec: dict):
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from vlmc.exporters import zoo

    # Byte-tokenizer vocabulary of the built-ins: the LLM's width, not its vocabulary, is what is measured.
    text = LlamaConfig(
        vocab_size=zoo.TINY_VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        **spec["text"],
    )
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**spec["vision"]),
        text_config=text,
        image_token_index=zoo.TINY_IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(cfg).eval()


def _prefill_feeds(pipe, pkg) -> dict:
    """Decoder inputs for a one-image prompt, exactly as the runtime prefills (empty KV cache)."""
    inp = pipe.prepare([PROMPT], [["demo"]])
    embeds = pipe.prefill_embeds(inp)
    kv = pkg.manifest["kv"]
    feeds = {
        "inputs_embeds": embeds,
        "attention_mask": inp.attention_mask,
        "position_ids": np.cumsum(inp.attention_mask, -1) - 1,
    }
    for i in range(int(kv["layers"])):
        for k in ("key", "value"):
            feeds[f"past_key_values.{i}.{k}"] = np.zeros((1, kv["kv_heads"], 0, kv["head_dim"]), np.float32)
    return feeds


def run(rows: list, quick: bool = False) -> list:
    """Export, prune, time prefill at full vs pruned visual tokens; append result rows (dicts) and return them.

    Rows follow scripts/bench.py ({"benchmark", "setting", "metric", "value", "ratio", "notes"}) plus
    visual_tokens, prefill_tokens, median_ms and runs_ms; the last row is the speed-up.
    """
    from vlmc import exporters, manager
    from vlmc.exporters import Source
    from vlmc.package import Package
    from vlmc.recipe import Step
    from vlmc.runtime import Pipeline

    spec = QUICK if quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(spec)
        exporters._eager(model)
        src = Source(name="bench-llava-1.5-widths", model=model, config=model.config, family="llava")
        full_dir = exporters.export(src).save(Path(tmp) / "full")
        del model, src
        pruned = manager.run(
            Package.load(full_dir),
            [
                Step(
                    name="prune_visual_tokens",
                    index=1,
                    options={
                        "keep": spec["keep"],
                        "method": "cls_attention",
                        "calibration_images": 0,
                        "picture": False,
                    },
                )
            ],
        )
        pruned_dir = pruned.save(Path(tmp) / "pruned")
        pkgs = {"unpruned": Package.load(full_dir), "pruned": Package.load(pruned_dir)}
        pipes = {k: Pipeline(p) for k, p in pkgs.items()}
        feeds = {k: _prefill_feeds(pipes[k], pkgs[k]) for k in pkgs}
        sessions = {k: pipes[k].session("decoder") for k in pkgs}
        times: dict[str, list[float]] = {k: [] for k in pkgs}
        for k in pkgs:  # warm-up
            sessions[k].run(["logits"], feeds[k])
        for _ in range(spec["runs"]):
            for k in pkgs:  # alternate so both see the same machine state
                t0 = time.perf_counter()
                sessions[k].run(["logits"], feeds[k])
                times[k].append((time.perf_counter() - t0) * 1000)
        out = []
        med = {k: statistics.median(times[k]) for k in pkgs}
        for k in pkgs:  # rows in scripts/bench.py's format
            v = pkgs[k].manifest["vision"]
            out.append(
                {
                    "benchmark": "prune_visual_tokens: LLM prefill (ORT CPU)",
                    "setting": f"{k}: {v['tokens_per_image']} visual tokens, "
                    f"{int(feeds[k]['inputs_embeds'].shape[1])} prefill tokens",
                    "metric": "median ms",
                    "value": round(med[k], 1),
                    "ratio": round(med[k] / med["unpruned"], 3),
                    "notes": f"{spec['runs']} alternating runs: {[round(t) for t in times[k]]}",
                    "visual_tokens": v["tokens_per_image"],
                    "prefill_tokens": int(feeds[k]["inputs_embeds"].shape[1]),
                    "median_ms": round(med[k], 4),
                    "runs_ms": [round(t, 4) for t in times[k]],
                }
            )
        speedup = round(med["unpruned"] / med["pruned"], 3)
        out.append(
            {
                "benchmark": "prune_visual_tokens: LLM prefill (ORT CPU)",
                "setting": "speed-up",
                "metric": "unpruned / pruned median",
                "value": speedup,
                "ratio": speedup,
                "notes": "vision: CLIP-L/14-336 widths, 2 layers; decoder 4096 wide, 2 layers"
                if not quick
                else "quick (tiny) mode",
            }
        )
    rows.extend(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    args = ap.parse_args()
    for row in run([], quick=args.quick):
        print(row)


if __name__ == "__main__":
    main()
