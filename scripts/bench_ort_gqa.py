"""The ort target on a grouped-query decoder: one decode step (or prefill) per decoder variant, paired.

Makes a 2-layer Qwen2-VL-style decoder at moderate width (hidden 1536, 12 query heads over 2 KV heads,
head 128, MLP 8960, M-RoPE; random weights, the tiny vocabulary), exports it, compiles it with
``--target ort`` twice (all fusions; ``fuse_attention: false``), and times one decode step over
``--past`` cached positions (or a prefill: ``--past 0 --sequence 512``) on the package and both builds
in alternating rounds (the order flips each round): wall and process CPU medians, per-round ratios.
With grouped-query attention kept (docs/ort.md) the two builds are the same graph; at commit 983c37b
the first one held MultiHeadAttention over the repeated KV, the docs' "MHA" column.

    .venv/bin/python scripts/bench_ort_gqa.py --root /tmp/bench-gqa --rounds 12 --steps 10 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def prepare(root: Path) -> dict[str, Path]:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from vlmc import backends, exporters
    from vlmc.exporters import qwen2_vl
    from vlmc.package import Package

    pkg = root / "package"
    if not (pkg / "vlmc.json").is_file():
        torch.manual_seed(0)
        cfg = qwen2_vl.tiny_qwen2_vl_config(
            hidden_size=1536,
            intermediate_size=8960,
            num_attention_heads=12,
            num_key_value_heads=2,
            initializer_range=0.02,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        )
        model = Qwen2VLForConditionalGeneration(cfg).eval()
        exporters._eager(model)
        src = exporters.Source(name="qwen2-vl-1536", model=model, config=model.config, family="qwen2_vl")
        exporters.export(src).save(pkg)
    builds = {"package": pkg}
    for name, opts in (("fused", {}), ("no-attention", {"fuse_attention": False})):
        out = root / name
        if not (out / "compile.json").is_file():
            backends.get("ort").compile(Package.load(pkg), out, {"backend": "ort", **opts})
        builds[name] = out / "package"
    return builds


def _feed(pkg, past: int, seq: int = 1) -> dict:
    rng = np.random.default_rng(0)
    info = pkg.info("decoder")
    feed = {}
    for spec in info["inputs"]:
        name = spec["name"]
        if name == "inputs_embeds":
            feed[name] = rng.standard_normal((1, seq, spec["shape"][-1])).astype(np.float32) * 0.02
        elif name == "attention_mask":
            feed[name] = np.ones((1, past + seq), np.int64)
        elif name == "position_ids":
            lead = [d for d in spec["shape"][:-2] if isinstance(d, int)]  # M-RoPE's 3 axes
            feed[name] = np.broadcast_to(np.arange(past, past + seq), (*lead, 1, seq)).astype(np.int64)
        elif name.startswith("past_key_values."):
            shape = [1, spec["shape"][1], past, spec["shape"][3]]
            feed[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            raise SystemExit(f"no feed rule for decoder input {name}")
    return feed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per decoder per round")
    ap.add_argument("--past", type=int, default=512)
    ap.add_argument(
        "--sequence", type=int, default=1, help="new positions per step (1: decode; more: prefill)"
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from vlmc import ortsession
    from vlmc.package import Package

    builds = prepare(args.root)
    pkgs = {k: Package.load(v) for k, v in builds.items()}
    sessions = {k: ortsession.for_graph(p, "decoder", args.threads) for k, p in pkgs.items()}
    feed = _feed(pkgs["package"], args.past, args.sequence)
    ref = sessions["package"].run(["logits"], feed)[0]
    for k, s in sessions.items():
        print(f"{k}: max |logit diff| vs package {np.abs(s.run(['logits'], feed)[0] - ref).max():.3g}")
    times: dict = {k: [] for k in sessions}
    cpu: dict = {k: [] for k in sessions}  # process CPU time (every onnxruntime thread): less load-bound
    for r in range(args.rounds):
        order = list(sessions) if r % 2 == 0 else list(reversed(sessions))
        for name in order:
            sess = sessions[name]
            sess.run(["logits"], feed)  # warm
            t, c = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                sess.run(["logits"], feed)
            times[name].append((time.perf_counter() - t) / args.steps)
            cpu[name].append((time.process_time() - c) / args.steps)
    result = {"args": vars(args)}
    for label, t in (("wall", times), ("cpu", cpu)):
        result[f"{label}_step_ms_median"] = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        result[f"{label}_ratio_to_fused_median"] = {
            k: statistics.median(a / b for a, b in zip(t[k], t["fused"])) for k in t if k != "fused"
        }
    print(json.dumps(result, default=str, indent=1))


if __name__ == "__main__":
    main()
