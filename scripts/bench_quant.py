"""Quantization benchmark: INT8 / FP16 / FP32 vision-encoder bytes and onnxruntime CPU latency at CLIP ViT-L/14-336 widths.

``run(rows, quick)`` appends result rows (dicts) for the lead's ``make bench``; run it directly to
print them::

    .venv/bin/python scripts/bench_quant.py [--quick]
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

# CLIP ViT-L/14-336 (LLaVA-1.5's tower); --quick shrinks it to seconds.
FULL = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "patch_size": 14,
    "image_size": 336,
    "num_hidden_layers": 4,
}
QUICK = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "patch_size": 14,
    "image_size": 112,
    "num_hidden_layers": 2,
}


def clip_l_llava(vision: dict, text_hidden: int = 256):
    """A random-weight LLaVA with the given CLIP vision widths and a small Llama decoder (fixed seed)."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    v = CLIPVisionConfig(projection_dim=768, **vision)
    t = LlamaConfig(
        vocab_size=320,
        hidden_size=text_hidden,
        intermediate_size=2 * text_hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg = LlavaConfig(
        vision_config=v, text_config=t, image_token_index=319, vision_feature_layer=-2, pad_token_id=0
    )
    for c in (cfg, v, t):
        c._attn_implementation = "eager"
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = LlavaForConditionalGeneration(cfg).eval()
    finally:
        torch.random.set_rng_state(state)
    return model


def export_package(vision: dict, out: Path):
    """Export the model above with vlmc and save it; returns the package directory."""
    from vlmc.exporters import Source, export

    model = clip_l_llava(vision)
    export(Source(name="clip-l-bench", model=model, config=model.config, family="llava")).save(
        out, force=True
    )
    return out


def _latency(session, feeds: dict, repeats: int) -> float:
    session.run(None, feeds)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(rows: list, quick: bool = False) -> list:
    """Quantize the vision encoder to INT8 and FP16 and time all three side by side on ORT CPU.

    Rows follow scripts/bench.py: {"benchmark", "setting", "metric", "value", "ratio", "notes"}.
    """
    from vlmc import graphs, ortsession
    from vlmc.metrics import cosine
    from vlmc.package import Package
    from vlmc.pass_api import get

    vision = QUICK if quick else FULL
    repeats = 5 if quick else 7
    with tempfile.TemporaryDirectory(prefix="vlmc-bench-quant-") as tmp:
        src = export_package(vision, Path(tmp) / "fp32")
        plans = {
            "fp32": None,
            "fp16": {"weights": "fp16"},
            "int8": {"weights": "int8", "activations": "int8", "calibration": {"count": 4}},
        }
        pkgs = {}
        for variant, plan in plans.items():
            pkg = Package.load(src)
            if plan is not None:
                get("quantize")(vision_encoder=plan, eval_tokens=0, eval_samples=0).run(pkg)
                pkg = Package.load(pkg.save(Path(tmp) / variant))
            pkgs[variant] = pkg
        feeds = {
            "pixel_values": np.random.default_rng(0)
            .standard_normal((1, 3, vision["image_size"], vision["image_size"]))
            .astype(np.float32)
        }
        sessions = {v: ortsession.for_graph(p, "vision_encoder") for v, p in pkgs.items()}
        ref = sessions["fp32"].run(None, feeds)[0]
        lat: dict[str, list[float]] = {v: [] for v in sessions}
        for _ in range(repeats):  # interleaved, so machine load hits every variant alike
            for v, s in sessions.items():
                lat[v].append(_latency(s, feeds, 1))
        base_bytes = graphs.initializer_bytes(pkgs["fp32"].model("vision_encoder"))
        base_lat = statistics.median(lat["fp32"])
        widths = "quick widths" if quick else "CLIP ViT-L/14-336 widths"
        setting = f"vision encoder, {widths}, {vision['num_hidden_layers']} layers, {{}}"
        for v, p in pkgs.items():
            b = graphs.initializer_bytes(p.model("vision_encoder"))
            out = sessions[v].run(None, feeds)[0]
            ms = statistics.median(lat[v])
            rows.append(
                {
                    "benchmark": "quantize",
                    "setting": setting.format(v),
                    "metric": "ORT CPU latency ms",
                    "value": round(1000 * ms, 2),
                    "ratio": f"{ms / base_lat:.2f}× fp32",
                    "notes": f"median of {repeats} interleaved runs, batch 1",
                }
            )
            rows.append(
                {
                    "benchmark": "quantize",
                    "setting": setting.format(v),
                    "metric": "weight bytes",
                    "value": b,
                    "ratio": f"{b / base_bytes:.3f}× fp32",
                    "notes": f"image_features cosine vs fp32 {cosine(ref, out.astype(np.float32)):.4f}",
                }
            )
        rows += _ascend_bytes(pkgs["int8"], Path(src), Path(tmp), base_bytes, setting)
    return rows


def _ascend_bytes(int8_pkg, src: Path, tmp: Path, base_bytes: int, setting: str) -> list:
    """Weight bytes of the graphs the Ascend lowering writes: INT8 static, and INT4 held as INT8."""

    from vlmc import graphs
    from vlmc.backends.ascend import lower
    from vlmc.package import Package
    from vlmc.pass_api import get

    int4 = Package.load(src)
    get("quantize")(vision_encoder={"weights": "int4", "group_size": 32}, eval_tokens=0, eval_samples=0).run(
        int4
    )
    rows = []
    for variant, pkg in (("int8", int8_pkg), ("int4 weight-only g32", int4)):
        model = pkg.model("vision_encoder").clone()  # the lowering's own copy; weights shared, not read
        portable = graphs.initializer_bytes(model)
        low, report = lower.lower(model, "vision_encoder", pkg.info("vision_encoder"))
        b = graphs.initializer_bytes(low)
        rows.append(
            {
                "benchmark": "quantize",
                "setting": setting.format(variant) + ", lowered for Ascend",
                "metric": "weight bytes",
                "value": b,
                "ratio": f"{b / base_bytes:.3f}× fp32",
                "notes": f"portable graph {portable / base_bytes:.3f}× fp32"
                + ("; INT4 held as INT8 on the NPU" if report.int4_storage == "int8" else ""),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny widths (seconds)")
    args = ap.parse_args()
    rows: list = []
    run(rows, args.quick)
    print("| setting | metric | value | ratio | notes |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['metric']} | {r['value']} | {r['ratio']} | {r['notes']} |")


if __name__ == "__main__":
    main()
