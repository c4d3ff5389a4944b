"""Decode-step latency of the paged_kv decoder vs the contiguous one at LLaVA-1.5 decoder widths (onnxruntime CPU).

The decoder is a Llama with LLaVA-1.5-7B's widths (hidden 4096, 32 heads, MLP 11008, vocab 32064) but
fewer layers, random weights, exported with vlmc's own decoder exporter; paged_kv's rewrite is applied
to a copy. Both run one decode step for a sequence with ~600 cached tokens; the two sides are timed
alternately and the median of the runs is reported. ``make bench`` calls :func:`run`; run this file
directly for a table on stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

logger = logging.getLogger(__name__)

FULL = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32064,
    "num_hidden_layers": 2,
    "context": 600,
    "runs": 9,
}
QUICK = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 320,
    "num_hidden_layers": 1,
    "context": 40,
    "runs": 2,
}


def _export(cfg: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlmc import manifest as M
    from vlmc.exporters import base
    from vlmc.package import Package

    text = {k: v for k, v in cfg.items() if k not in ("context", "runs")}
    config = LlamaConfig(**text, max_position_embeddings=4096, initializer_range=0.02)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    pkg = Package(M.new("bench", "LlamaForCausalLM", "bench", "none"))
    heads = cfg["num_attention_heads"]
    head_dim = cfg["hidden_size"] // heads
    base.export_decoder(
        pkg,
        model.model,
        model.lm_head,
        cfg["num_hidden_layers"],
        cfg["num_key_value_heads"],
        head_dim,
        cfg["hidden_size"],
    )
    del model
    return pkg.graph("decoder"), head_dim


def _session(model, tmp: Path, name: str):
    from vlmc import graphs as G
    from vlmc import ortsession

    path = tmp / f"{name}.onnx"
    G.save(model, path)
    return ortsession.from_path(path)


# (block size, sequences the pool has room for): the pool is a graph input, so on onnxruntime ScatterND
# copies all of it every step; the third setting shows how that copy grows with the pool.
SETTINGS = ((16, 2), (128, 2), (16, 8))


def measure(cfg: dict, settings: tuple[tuple[int, int], ...], tmp: Path) -> list[dict]:
    """Median decode-step seconds for the contiguous decoder and its paged rewrites, timed alternately."""
    from vlmc.passes.paged_kv import rewrite

    contiguous, head_dim = _export(cfg)
    sessions = {}
    for bs in sorted({bs for bs, _ in settings}):
        paged = copy.deepcopy(contiguous)
        rewrite(paged, bs, None, cfg["num_key_value_heads"], head_dim)
        sessions[bs] = _session(paged, tmp, f"paged{bs}")
        del paged
    s_cont = _session(contiguous, tmp, "contiguous")
    del contiguous
    return [_time(cfg, bs, n, head_dim, s_cont, sessions[bs]) for bs, n in settings]


def _time(cfg: dict, block_size: int, pool_sequences: int, head_dim: int, s_cont, s_paged) -> dict:
    from vlmc.runtime.paged import BlockAllocator

    layers, kvh, ctx = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["context"]

    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((1, 1, cfg["hidden_size"])).astype(np.float32)
    pos = np.array([[ctx]], np.int64)
    past = {
        f"past_key_values.{i}.{k}": rng.standard_normal((1, kvh, ctx, head_dim)).astype(np.float32)
        for i in range(layers)
        for k in ("key", "value")
    }
    feeds_cont = {
        "inputs_embeds": embeds,
        "attention_mask": np.ones((1, ctx + 1), np.int64),
        "position_ids": pos,
        **past,
    }

    alloc = BlockAllocator(-(-(ctx + 1) // block_size) * pool_sequences + 1, block_size, seed=0)
    alloc.allocate("s", ctx)
    slot = alloc.allocate("s", 1)
    table = alloc.block_tables(["s"])
    pools = {}
    for i in range(layers):
        for k in ("key", "value"):
            pool = np.zeros((alloc.num_blocks, block_size, kvh, head_dim), np.float32)
            flat = pool.reshape(-1, kvh, head_dim)
            slots = (
                np.asarray(table[0], np.int64)[np.arange(ctx) // block_size] * block_size
                + np.arange(ctx) % block_size
            )
            flat[slots] = past[f"past_key_values.{i}.{k}"][0].transpose(1, 0, 2)
            pools[f"{k}_cache.{i}"] = pool
    feeds_paged = {
        "inputs_embeds": embeds,
        "position_ids": pos,
        **pools,
        "block_tables": table,
        "slot_mapping": slot.reshape(1, 1).astype(np.int32),
        "context_lens": np.array([ctx + 1], np.int32),
    }

    ref = s_cont.run(["logits"], feeds_cont)[0]
    got = s_paged.run(["logits"], feeds_paged)[0]
    max_diff = float(np.abs(ref - got).max())
    for sess, feeds in ((s_cont, feeds_cont), (s_paged, feeds_paged)):  # warm-up
        sess.run(None, feeds)
    t_cont, t_paged = [], []
    for _ in range(cfg["runs"]):
        for sess, feeds, out in ((s_cont, feeds_cont, t_cont), (s_paged, feeds_paged, t_paged)):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            out.append(time.perf_counter() - t0)
    c, p = statistics.median(t_cont), statistics.median(t_paged)
    return {
        "block_size": block_size,
        "contiguous_s": c,
        "paged_s": p,
        "ratio": p / c,
        "runs": cfg["runs"],
        "logits_max_abs_diff": max_diff,
        "gathered": table.shape[1] * block_size,
        "pool_blocks": alloc.num_blocks,
        "pool_sequences": pool_sequences,
    }


def run(rows: list, quick: bool) -> None:
    """Append benchmark rows (the format scripts/bench.py renders), one per entry of SETTINGS."""
    cfg = QUICK if quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(cfg, SETTINGS, Path(tmp))
        for r in results:
            bs = r["block_size"]
            setting = (
                f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, {cfg['num_hidden_layers']} layers, "
                f"vocab {cfg['vocab_size']}, context {cfg['context']}, block {bs}, batch 1, "
                f"pool {r['pool_blocks']} blocks (room for {r['pool_sequences']} such sequences)"
            )
            rows.append(
                {
                    "benchmark": "paged_kv decode step (ORT CPU)",
                    "setting": setting,
                    "metric": "median step s, paged / contiguous",
                    "value": f"{r['paged_s']:.4f} / {r['contiguous_s']:.4f}",
                    "ratio": f"{r['ratio']:.3f}×",
                    "notes": f"{r['runs']} alternating runs; attends over {r['gathered']} gathered slots; "
                    f"logits max |diff| {r['logits_max_abs_diff']:.1e}",
                }
            )
            print(json.dumps(r), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny widths, 2 runs (smoke test)")
    args = ap.parse_args()
    rows: list[dict] = []
    run(rows, args.quick)
    for r in rows:
        print(f"{r['setting']}: {r['value']} s -> {r['ratio']}")


if __name__ == "__main__":
    main()
