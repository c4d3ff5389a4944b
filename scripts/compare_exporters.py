"""Export the tiny LLaVA decoder with torch.onnx's TorchScript exporter (what vlmc uses) and its dynamo
exporter, and compare both with torch on onnxruntime (docs/architecture.md, "Which torch exporter").

Needs onnxscript for the dynamo exporter (not a vlmc dependency), e.g. on PYTHONPATH:
    PYTHONPATH=$PWD:/path/to/onnxscript .venv/bin/python scripts/compare_exporters.py [--layers N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime
import torch

from vlmc import exporters
from vlmc.exporters import base


def _inputs(cfg, layers: int, batch: int, seq: int, past: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    tcfg = cfg.text_config
    heads = tcfg.num_key_value_heads
    head_dim = tcfg.hidden_size // tcfg.num_attention_heads
    embeds = torch.randn(batch, seq, tcfg.hidden_size, generator=generator)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    positions = torch.arange(past, past + seq).unsqueeze(0).expand(batch, seq).contiguous()
    kv = [torch.randn(batch, heads, past, head_dim, generator=generator) for _ in range(2 * layers)]
    return [embeds, mask, positions, *kv]


def _cause(exc: BaseException) -> str:
    """The innermost error's first line (torch.onnx wraps torch.export's in its own)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the built-in's)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    source = exporters.load_source("tiny-llava")
    model = source.model
    if args.layers:
        from transformers import LlavaForConditionalGeneration

        cfg = model.config
        cfg.text_config.num_hidden_layers = args.layers
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(cfg).eval()
        exporters._eager(model)
    cfg = model.config
    layers = cfg.text_config.num_hidden_layers
    wrapper = base.DecoderWrapper(model.model.language_model, model.lm_head, layers).eval()
    past, present = base.kv_names(layers)
    names = ["inputs_embeds", "attention_mask", "position_ids", *past]
    outputs = ["logits", *present]
    sample = _inputs(cfg, layers, 2, 5, 3, 0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        timings = {}
        start = time.perf_counter()
        paths["torchscript"] = Path(tmp, "ts.onnx")
        torch.onnx.export(
            wrapper,
            tuple(sample),
            str(paths["torchscript"]),
            input_names=names,
            output_names=outputs,
            dynamic_axes=base.decoder_axes(layers),
            opset_version=17,
            dynamo=False,
        )
        timings["torchscript"] = time.perf_counter() - start
        start = time.perf_counter()
        paths["dynamo"] = Path(tmp, "dynamo.onnx")
        batch, seq, total = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("total")
        past_dim = torch.export.Dim("past")
        # forward(inputs_embeds, attention_mask, position_ids, *past): the past K/V are one tuple argument
        shapes = (
            {0: batch, 1: seq},
            {0: batch, 1: total},
            {0: batch, 1: seq},
            tuple({0: batch, 2: past_dim} for _ in range(2 * layers)),
        )
        try:
            program = torch.onnx.export(
                wrapper,
                tuple(sample),
                input_names=names,
                output_names=outputs,
                dynamic_shapes=shapes,
                opset_version=18,
                dynamo=True,
            )
            program.save(str(paths["dynamo"]))
            timings["dynamo"] = time.perf_counter() - start
        except Exception as exc:  # report what the dynamo exporter says, then the TorchScript numbers
            print(
                f"dynamo: export failed after {time.perf_counter() - start:.1f} s: {type(exc).__name__}: "
                f"{_cause(exc)}"
            )
            paths.pop("dynamo")
        for seed, (batch_n, seq_n, past_n) in enumerate([(2, 5, 3), (1, 7, 4), (3, 1, 9)]):
            feeds = _inputs(cfg, layers, batch_n, seq_n, past_n, seed)
            with torch.no_grad():
                want = wrapper(*feeds)[0].numpy()
            for kind, path in paths.items():
                session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                got = session.run(["logits"], {n: t.numpy() for n, t in zip(names, feeds)})[0]
                print(
                    f"{kind}: batch {batch_n} seq {seq_n} past {past_n}: max |logits - torch| "
                    f"{float(np.abs(got - want).max()):.3g}"
                )
        for kind, seconds in timings.items():
            print(f"{kind}: export {seconds:.2f} s, {layers} decoder layers")


if __name__ == "__main__":
    main()
