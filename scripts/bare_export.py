"""Baseline for the pipeline-cost benchmark: only torch.onnx.export of the same three stages, nothing else.

Uses vlmc's wrapper modules so both sides export identical computations; no package, manifest,
checks, passes or compile.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch

from vlmc.exporters import base
from vlmc.exporters.llava import VisionWrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg = model.config
    t, v = cfg.text_config, cfg.vision_config
    layers, heads = t.num_hidden_layers, t.num_attention_heads
    kvh = t.num_key_value_heads or heads
    hd = getattr(t, "head_dim", None) or t.hidden_size // heads
    past_names, present_names = base.kv_names(layers)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        px = torch.randn(1, 3, v.image_size, v.image_size)
        torch.onnx.export(
            VisionWrapper(model),
            (px,),
            os.path.join(tmp, "v.onnx"),
            input_names=["pixel_values"],
            output_names=["image_features"],
            dynamic_axes={"pixel_values": {0: "images"}},
            opset_version=17,
            dynamo=False,
        )
        ids = torch.zeros(1, 4, dtype=torch.int64)
        torch.onnx.export(
            base.EmbedWrapper(model.get_input_embeddings()),
            (ids,),
            os.path.join(tmp, "e.onnx"),
            input_names=["input_ids"],
            output_names=["inputs_embeds"],
            dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}},
            opset_version=17,
            dynamo=False,
        )
        emb = torch.randn(2, 5, t.hidden_size)
        mask = torch.ones(2, 8, dtype=torch.int64)
        pos = torch.arange(3, 8).unsqueeze(0).expand(2, 5).contiguous()
        past = [torch.randn(2, kvh, 3, hd) for _ in range(2 * layers)]
        torch.onnx.export(
            base.DecoderWrapper(model.model.language_model, model.lm_head, layers),
            (emb, mask, pos, *past),
            os.path.join(tmp, "d.onnx"),
            input_names=["inputs_embeds", "attention_mask", "position_ids", *past_names],
            output_names=["logits", *present_names],
            dynamic_axes=base.decoder_axes(layers),
            opset_version=17,
            dynamo=False,
        )


if __name__ == "__main__":
    main()
