"""Decode-step time of the paged_kv decoder against pool size, beside the contiguous one, at LLaVA-1.5 widths (onnxruntime CPU).

The decoder is a Llama with LLaVA-1.5-7B's widths (hidden 4096, 32 heads = 32 KV heads, head_dim 128,
MLP 11008, vocab 32064) but 2 layers, random weights, exported with vlmc's own decoder exporter;
paged_kv's rewrite (block 16) is applied to a copy. One sequence with ~600 cached tokens takes one
decode step: contiguous (past_key_values in, present out) and paged (pools in, this step's rows out,
then written into the pools in place by the runtime's ``write_rows``) at each pool size. Every
round runs all variants once, in a rotating order, and the medians over the rounds are reported, so
load from other jobs hits every variant alike.

Memory stays under 8 GB: the weights are held once and shared by both sessions (onnxruntime
``add_initializer``, pre-packing off in both so no session keeps a private packed copy), and the
pool sizes are leading-dimension views of one 4096-block pool set (4 x 1 GiB at these widths),
which onnxruntime reads in place. ``make bench`` calls :func:`run`; run this file directly for a
table on stdout.
"""

from __future__ import annotations

import argparse
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
    "block_size": 16,
    "pools": (64, 256, 1024, 4096),
    "rounds": 31,
    "tie_layers": True,
}
QUICK = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 320,
    "num_hidden_layers": 1,
    "context": 40,
    "block_size": 16,
    "pools": (8, 32),
    "rounds": 3,
}
_TEXT_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "num_hidden_layers",
)


def _export(cfg: dict, tmp: Path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vlmc import manifest
    from vlmc.exporters import base
    from vlmc.package import Package

    config = LlamaConfig(
        **{k: cfg[k] for k in _TEXT_KEYS}, max_position_embeddings=4096, initializer_range=0.02
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    if cfg.get("tie_layers"):
        # Every layer uses layer 0's parameters: the export holds one layer's weights, so it peaks under
        # 8 GB; a step still runs and streams every layer's matrices (far larger than any cache).
        first = model.model.layers[0]
        for later in model.model.layers[1:]:
            for mod0, mod in zip(first.modules(), later.modules()):
                for name, p in list(mod0.named_parameters(recurse=False)):
                    setattr(mod, name, p)
    pkg = Package(manifest.new("bench", "LlamaForCausalLM", "bench", "none"))
    pkg.use_scratch(tmp / "export")  # the exported file (weights streamed to it) stays for the sessions
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
    _stage("exported")
    return pkg.path_of("decoder"), head_dim


def _sessions(contiguous, head_dim: int, cfg: dict, tmp: Path):
    """Contiguous and paged sessions over one in-memory copy of the weights."""
    import onnx_ir as ir
    import onnxruntime as ort

    from vlmc import graphs, interop, ortsession
    from vlmc.passes.paged_kv import rewrite

    # ``contiguous`` is the exported decoder's file; the paged graph goes beside it, sharing its data
    # file: the rewrite reads no weight, and the IR writes its external tensors as references.
    folder = contiguous.parent
    paged = graphs.load_ir(contiguous)
    rewrite(paged, cfg["block_size"], None, cfg["num_key_value_heads"], head_dim)
    interop.write(paged, folder / "paged.onnx")
    # The weights once, as numpy read straight from the data file; each session takes them as shared
    # initializers instead of reading the file again (an OrtValue over a numpy array does not copy it).
    weights = {}
    for name, value in graphs.load_ir(contiguous).graph.initializers.items():
        t = value.const_value
        if not isinstance(t, ir.ExternalTensor):
            continue
        dtype = np.dtype(t.dtype.numpy())
        arr = np.fromfile(t.path, dtype, t.nbytes // dtype.itemsize, offset=t.offset or 0)
        weights[name] = arr.reshape(tuple(t.shape.numpy()))
    values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in weights.items()}
    out = []
    for name in ("contiguous", "paged"):
        so = ortsession.options(cfg.get("threads"))
        # Pre-packing would give each session a private packed copy of every MatMul weight; it is
        # off in both, so the two sides are compared on the same kernels.
        so.add_session_config_entry("session.disable_prepacking", "1")
        # Two sessions alternate: idle worker threads of one must not spin while the other runs.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        for n, v in values.items():
            so.add_initializer(n, v)
        path = contiguous if name == "contiguous" else folder / "paged.onnx"
        out.append(ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]))
    return out[0], out[1], (weights, values)


def _rss(field: str = "VmHWM") -> int:
    """Peak (VmHWM) or current (VmRSS) resident bytes of this process."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))


def _stage(what: str) -> None:
    logger.info("%s: RSS %.2f GiB, peak %.2f GiB", what, _rss("VmRSS") / 2**30, _rss() / 2**30)


def measure(cfg: dict, tmp: Path) -> dict:
    """Median decode-step seconds: contiguous, and paged at every pool size, timed in interleaved rounds."""
    from vlmc.runtime.paged import NULL_BLOCK, write_rows

    layers, kvh, ctx, bs = (
        cfg["num_hidden_layers"],
        cfg["num_key_value_heads"],
        cfg["context"],
        cfg["block_size"],
    )
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    s_cont, s_paged, keep = _sessions(
        *_export(cfg, tmp), cfg, tmp
    )  # no reference to the exported proto stays here
    _stage("sessions")
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

    # One pool set at the largest size, every byte written (resident, as a server's pool is); the
    # smaller pools are its leading blocks, C-contiguous views that onnxruntime reads in place.
    biggest = max(cfg["pools"])
    filler = rng.standard_normal((bs, kvh, head_dim)).astype(np.float32)
    pools = {}
    for i in range(layers):
        for k in ("key", "value"):
            pools[f"{k}_cache.{i}"] = np.empty((biggest, bs, kvh, head_dim), np.float32)
            pools[f"{k}_cache.{i}"][:] = filler
    # Each pool size gets its own sequence: shuffled blocks anywhere in its pool, disjoint from the
    # other sizes' blocks, holding the same past as the contiguous side.
    n_blocks = -(-(ctx + 1) // bs)
    used = {NULL_BLOCK}
    feeds_paged = {}
    positions = np.arange(ctx + 1)
    for nb in cfg["pools"]:
        free = np.setdiff1d(np.arange(nb), sorted(used))
        if len(free) < n_blocks:
            raise SystemExit(f"a {nb}-block pool has no room for a {ctx + 1}-token sequence")
        table = rng.permutation(free)[:n_blocks].astype(np.int32)
        used.update(table.tolist())
        slots = (table[positions // bs] * bs + positions % bs).astype(np.int32)
        view = {n: p[:nb] for n, p in pools.items()}
        for i in range(layers):
            for k in ("key", "value"):
                rows = past[f"past_key_values.{i}.{k}"].transpose(0, 2, 1, 3)  # [1, ctx, H, D]
                write_rows(view[f"{k}_cache.{i}"], np.ascontiguousarray(rows), slots[None, :ctx])
        feeds_paged[nb] = {
            "inputs_embeds": embeds,
            "position_ids": pos,
            **view,
            "block_tables": table[None],
            "slot_mapping": slots[None, ctx:],
            "context_lens": np.array([ctx + 1], np.int32),
        }

    _stage("pools")
    names_paged = [o.name for o in s_paged.get_outputs()]

    def step_cont() -> np.ndarray:
        return s_cont.run(None, feeds_cont)[0]

    def step_paged(nb: int) -> np.ndarray:
        f = feeds_paged[nb]
        out = dict(zip(names_paged, s_paged.run(None, f)))
        for i in range(layers):  # the runtime's in-place write is part of the step
            for k in ("key", "value"):
                write_rows(f[f"{k}_cache.{i}"], out[f"new_{k}.{i}"], f["slot_mapping"])
        return out["logits"]

    ref = step_cont()
    diffs = {nb: float(np.abs(step_paged(nb) - ref).max()) for nb in cfg["pools"]}  # also the warm-up
    # The largest pool once more through io_binding (inputs bound as OrtValues over the same numpy
    # buffers): if session.run copied inputs, binding would be the cure; the timing says whether.
    binding = s_paged.io_binding()
    for name, value in feeds_paged[biggest].items():
        binding.bind_cpu_input(name, value)
    for name in names_paged:
        binding.bind_output(name)

    def step_bound() -> np.ndarray:
        f = feeds_paged[biggest]
        s_paged.run_with_iobinding(binding)
        out = dict(zip(names_paged, binding.copy_outputs_to_cpu()))
        for i in range(layers):
            for k in ("key", "value"):
                write_rows(f[f"{k}_cache.{i}"], out[f"new_{k}.{i}"], f["slot_mapping"])
        return out["logits"]

    diffs["io_binding"] = float(np.abs(step_bound() - ref).max())
    variants = [("contiguous", step_cont)] + [(nb, (lambda nb=nb: step_paged(nb))) for nb in cfg["pools"]]
    variants.append(("io_binding", step_bound))
    times: dict[object, list[float]] = {v: [] for v, _ in variants}
    for r in range(cfg["rounds"]):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v, fn in order:
            t0 = time.perf_counter()
            fn()
            times[v].append(time.perf_counter() - t0)
    del keep
    med = {v: statistics.median(t) for v, t in times.items()}
    c = med.pop("contiguous")
    paged = {nb: med[nb] for nb in cfg["pools"]}
    bound = med["io_binding"]
    # Per round, paged / contiguous of that round: the ratio least disturbed by other jobs' load.
    round_ratio = {
        nb: statistics.median([p / q for p, q in zip(times[nb], times["contiguous"])]) for nb in cfg["pools"]
    }
    return {
        "contiguous_s": c,
        "paged_s": paged,
        "ratio": {nb: p / c for nb, p in paged.items()},
        "round_ratio": round_ratio,
        "times": {str(v): [round(x, 5) for x in t] for v, t in times.items()},
        "flat": max(paged.values()) / min(paged.values()),
        "io_binding_s": bound,
        "flat_round_ratio": max(round_ratio.values()) / min(round_ratio.values()),
        "rounds": cfg["rounds"],
        "context": ctx,
        "gathered": n_blocks * bs,
        "pool_gib_per_tensor": {nb: nb * bs * kvh * head_dim * 4 / 2**30 for nb in cfg["pools"]},
        "logits_max_abs_diff": diffs,
        "peak_rss_gib": _rss() / 2**30,
        "pool_bytes": sum(p.nbytes for p in pools.values()),
    }


def run(rows: list, quick: bool) -> dict:
    """Append benchmark rows (the format scripts/bench.py renders): one per pool size, plus flatness."""
    cfg = QUICK if quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(cfg, Path(tmp))
    print(json.dumps(r, default=str), flush=True)
    widths = (
        f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, "
        f"{cfg['num_hidden_layers']} layers, vocab {cfg['vocab_size']}, block {cfg['block_size']}, "
        f"context {r['context']}, batch 1"
    )
    for nb in cfg["pools"]:
        rows.append(
            {
                "benchmark": "paged_kv decode step vs pool size (ORT CPU)",
                "setting": f"{widths}; pool {nb} blocks ({r['pool_gib_per_tensor'][nb]:.3g} GiB per K/V tensor)",
                "metric": "median step ms, paged / contiguous",
                "value": f"{1e3 * r['paged_s'][nb]:.4g} / {1e3 * r['contiguous_s']:.4g}",
                "ratio": f"{r['ratio'][nb]:.3f}×",
                "notes": f"{r['rounds']} interleaved rounds; per-round ratio median {r['round_ratio'][nb]:.3f}×; "
                f"attends over {r['gathered']} gathered slots; logits max |diff| {r['logits_max_abs_diff'][nb]:.1e}",
            }
        )
    rows.append(
        {
            "benchmark": "paged_kv decode step vs pool size (ORT CPU)",
            "setting": f"{widths}; pools {', '.join(map(str, cfg['pools']))} blocks",
            "metric": "slowest / fastest paged median over pool sizes",
            "value": f"{1e3 * max(r['paged_s'].values()):.4g} / {1e3 * min(r['paged_s'].values()):.4g} ms",
            "ratio": f"{r['flat']:.3f}×",
            "notes": f"same over the per-round ratios: {r['flat_round_ratio']:.3f}×; "
            f"peak RSS {r['peak_rss_gib']:.2f} GiB (pools {r['pool_bytes'] / 2**30:.2f} GiB)",
        }
    )
    rows.append(
        {
            "benchmark": "paged_kv decode step vs pool size (ORT CPU)",
            "setting": f"{widths}; pool {max(cfg['pools'])} blocks, inputs bound with io_binding",
            "metric": "median step ms, io_binding / session.run",
            "value": f"{1e3 * r['io_binding_s']:.4g} / {1e3 * r['paged_s'][max(cfg['pools'])]:.4g}",
            "ratio": f"{r['io_binding_s'] / r['paged_s'][max(cfg['pools'])]:.3f}×",
            "notes": "inputs bound once as OrtValues over the same numpy buffers",
        }
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny widths, 3 rounds (smoke test)")
    ap.add_argument(
        "--threads", type=int, default=None, help="onnxruntime intra-op threads (default: its own)"
    )
    args = ap.parse_args()
    if args.threads:
        (QUICK if args.quick else FULL)["threads"] = args.threads
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows: list[dict] = []
    run(rows, args.quick)
    for r in rows:
        print(f"{r['setting']}: {r['metric']} {r['value']} -> {r['ratio']}  ({r['notes']})")


if __name__ == "__main__":
    main()
