"""Decode-step cost of tensor parallelism on CPU (gloo): segments and all-reduces against the unsharded step.

The model is tiny-llava's structure with LLaVA-1.5-7B's language widths (hidden 4096, 32 heads = 32
KV heads, head_dim 128, MLP 11008, vocab 32064) but 2 layers, random weights, exported with vlmc's
exporter; the ``tensor_parallel`` pass splits it over 2 ranks. One sequence with ``context`` cached
tokens takes one decode step:

- unsharded: the decoder graph on onnxruntime, all threads;
- TP=2: two processes (vlmc.runtime.ranks's forkserver ranks, one onnxruntime thread each
  by default), each running its 2*layers+1 segments with the gloo all-reduce between them through
  :class:`vlmc.runtime.ranks.RankDecoder`, the runtime's own plan executor.

Rounds alternate between the two, and medians are reported, with rank 0's split of its step into
segment time and all-reduce time (an all-reduce includes the wait for the slower rank). This machine
has 2 cores shared with other jobs: the figures measure what the split costs on CPU, not what two NPUs
gain. Run directly for a table; ``--quick`` runs tiny widths as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FULL = {
    "text": dict(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32064,
        num_hidden_layers=2,
        initializer_range=0.02,
        max_position_embeddings=4096,
    ),
    "context": 512,
    "rounds": 21,
}
QUICK = {
    "text": dict(num_hidden_layers=2),
    "context": 32,
    "rounds": 5,
}


def _export(cfg: dict, tmp: Path) -> Path:
    import torch
    from transformers import LlavaForConditionalGeneration

    from vlmc import exporters
    from vlmc.exporters import zoo

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(zoo.tiny_llava_config(**cfg["text"])).eval()
    exporters._eager(model)
    src = exporters.Source(name="bench-tp", model=model, config=model.config, family="llava", builtin=True)
    out = tmp / "pkg"
    pkg = exporters.export(src, scratch=tmp / "scratch")
    del model, src
    pkg.save(out)
    return out


def _shard(path: Path, size: int, tmp: Path) -> Path:
    from vlmc import manager, recipe
    from vlmc.package import Package

    pkg = manager.run(
        Package.load(path), recipe.from_dict({"passes": [{"tensor_parallel": {"size": size}}]}).steps
    )
    out = tmp / f"tp{size}"
    pkg.save(out)
    return out


def _feeds(m: dict, context: int, kv_heads: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    kv, hidden = m["kv"], m["text"]["hidden_size"]
    feeds = {
        "inputs_embeds": rng.standard_normal((1, 1, hidden)).astype(np.float32) * 0.02,
        "attention_mask": np.ones((1, context + 1), np.int64),
        "position_ids": np.array([[context]], np.int64),
    }
    for i in range(int(kv["layers"])):
        for k in ("key", "value"):
            feeds[f"past_key_values.{i}.{k}"] = rng.standard_normal(
                (1, kv_heads, context, int(kv["head_dim"]))
            ).astype(np.float32)
    return feeds


class _Timed:
    """What RankDecoder.run needs of a pipeline (run_graph), with each segment's time recorded."""

    def __init__(self, pkg, threads: int) -> None:
        from vlmc import ortsession

        self.sessions = {
            n: ortsession.for_graph(pkg, n, threads) for n in pkg.graph_names if "rank" in pkg.info(n)
        }
        self.seconds = 0.0

    def run_graph(self, name: str, env: dict) -> dict:
        s = self.sessions[name]
        t = time.perf_counter()
        out = s.run(None, {i.name: env[i.name] for i in s.get_inputs()})
        self.seconds += time.perf_counter() - t
        return dict(zip([o.name for o in s.get_outputs()], out))


def _rank(path: str, rank: int, size: int, rendezvous, threads: int, context: int, rounds: int, conn) -> None:
    """One rank: join gloo, then per round wait at a barrier and time one decode step."""
    from vlmc.package import Package
    from vlmc.runtime.collective import Gloo
    from vlmc.runtime.ranks import RankDecoder

    gloo = Gloo()
    gloo.join(rank, size, rendezvous, None)
    pkg = Package.load(path)
    reduce = gloo.all_reduce
    reduce_s = [0.0]

    def timed_reduce(x):
        t = time.perf_counter()
        out = reduce(x)
        reduce_s[0] += time.perf_counter() - t
        return out

    dec = RankDecoder(pkg.manifest, rank, timed_reduce)
    pipe = _Timed(pkg, threads)
    feeds = _feeds(pkg.manifest, context, int(dec.tp["kv_heads_per_rank"]), seed=rank)
    rows = []
    for _ in range(rounds + 1):  # the first round warms up
        conn.recv()  # the parent's go: the unsharded step is not running now
        gloo.barrier()
        pipe.seconds, reduce_s[0] = 0.0, 0.0
        t = time.perf_counter()
        out = dec.run(pipe, feeds)
        rows.append((time.perf_counter() - t, pipe.seconds, reduce_s[0]))
        conn.send(out["logits"].shape)
    conn.send({"rows": rows[1:], "collectives": dec.collectives})
    gloo.close()


def measure(cfg: dict, tmp: Path, threads: int) -> dict:
    import multiprocessing as mp

    from vlmc import ortsession
    from vlmc.package import Package
    from vlmc.runtime.collective import Rendezvous

    base = _export(cfg, tmp)
    tp = _shard(base, 2, tmp)
    pkg = Package.load(base)
    m = pkg.manifest
    sess = ortsession.for_graph(pkg, "decoder", threads * 2)
    feeds = _feeds(m, cfg["context"], int(m["kv"]["kv_heads"]))
    ins = [i.name for i in sess.get_inputs()]
    ctx = mp.get_context("forkserver")
    # 600 s per all-reduce: the parent times the unsharded step between rounds while the ranks wait.
    rendezvous = Rendezvous(store=str(tmp / "rendezvous"), secret=secrets.token_hex(16), timeout=600)
    conns, procs = [], []
    for r in range(2):
        a, b = ctx.Pipe()
        p = ctx.Process(
            target=_rank, args=(str(tp), r, 2, rendezvous, threads, cfg["context"], cfg["rounds"], b)
        )
        p.start()
        conns.append(a)
        procs.append(p)
    unsharded = []
    for k in range(cfg["rounds"] + 1):
        for c in conns:  # a TP step, both ranks at once
            c.send("go")
        for c in conns:
            c.recv()
        t = time.perf_counter()
        sess.run(None, {n: feeds[n] for n in ins})
        if k:
            unsharded.append(time.perf_counter() - t)
    results = [c.recv() for c in conns]
    for p in procs:
        p.join()
    rows = results[0]["rows"]
    med = statistics.median
    tp_step = med(r[0] for r in rows)
    weights = {
        "unsharded_decoder_bytes": _bytes(pkg, ["decoder"]),
        "rank_bytes": [
            _bytes(
                Package.load(tp),
                [n for n, g in Package.load(tp).manifest["graphs"].items() if g.get("rank") == r],
            )
            for r in range(2)
        ],
    }
    return {
        "context": cfg["context"],
        "rounds": cfg["rounds"],
        "threads_per_rank": threads,
        "unsharded_threads": threads * 2,
        "unsharded_ms": 1e3 * med(unsharded),
        "tp2_ms": 1e3 * tp_step,
        "tp2_segments_ms": 1e3 * med(r[1] for r in rows),
        "tp2_all_reduce_ms": 1e3 * med(r[2] for r in rows),
        "all_reduces_per_step": results[0]["collectives"] // (cfg["rounds"] + 1),
        "segments_per_step": 2 * int(m["kv"]["layers"]) + 1,
        **weights,
    }


def _bytes(pkg, names: list[str]) -> int:
    import onnx_ir as ir

    total = 0
    for n in names:
        model = ir.load(pkg.root / pkg.info(n)["file"])
        total += sum(int(v.const_value.nbytes) for v in model.graph.initializers.values())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny widths, 5 rounds (smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime threads per rank (unsharded: twice)")
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        r = measure(cfg, Path(tmp), args.threads)
    print(json.dumps(r, indent=2))
    print(
        f"decode step, context {r['context']}: unsharded {r['unsharded_ms']:.1f} ms ({r['unsharded_threads']} threads); "
        f"TP=2 {r['tp2_ms']:.1f} ms per rank ({r['threads_per_rank']} thread each) = segments "
        f"{r['tp2_segments_ms']:.1f} ms ({r['segments_per_step']} runs) + all-reduce {r['tp2_all_reduce_ms']:.1f} ms "
        f"({r['all_reduces_per_step']} calls, gloo); rank weights {r['rank_bytes'][0] / 2**20:.0f} MiB vs "
        f"unsharded decoder {r['unsharded_decoder_bytes'] / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
