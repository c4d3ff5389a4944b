"""LLaVA family exporter (LlavaForConditionalGeneration: CLIP-like vision tower + projector + causal LM)."""

from __future__ import annotations

import logging

import torch

from vlmc.exporters import attention, base, streaming
from vlmc.exporters._facts import (
    CLIP_MEAN,
    CLIP_STD,
    image_processor_config,
    kv_facts,
    normalization,
    text_facts,
)
from vlmc.package import Package

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llava",)
ARCHITECTURES = ("LlavaForConditionalGeneration",)
LLAVA_TEMPLATE = "USER: <image>\n{prompt} ASSISTANT:"


def model_class():
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration


def stream_depths(config) -> dict:
    """Layer stacks a streaming export may cut (vlmc/exporters/streaming.py): the decoder, and the
    vision tower when its feature layer counts from the end (hidden_states[f], f < 0: the layers
    after the picked one are dead, so a tower cut to 1 - f layers traces two live ones)."""
    return {**streaming.decoder_depths(config), **streaming.feature_layer_depth(config)}


class VisionWrapper(torch.nn.Module):
    """pixel_values [images, 3, H, W] -> image_features [images, tokens, hidden] (after the projector).

    Mirrors LlavaModel.get_image_features, which returns a per-image list; tracing that list would
    fix the image count, so the selection is written here on the batched tensor.
    """

    def __init__(self, model) -> None:
        super().__init__()
        self.vision_tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        cfg = model.config
        self.layers = (
            [cfg.vision_feature_layer]
            if isinstance(cfg.vision_feature_layer, int)
            else list(cfg.vision_feature_layer)
        )
        self.drop_cls = cfg.vision_feature_select_strategy == "default"

    def forward(self, pixel_values):
        hidden = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True).hidden_states
        picked = [hidden[i][:, 1:] if self.drop_cls else hidden[i] for i in self.layers]
        return self.projector(picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1))


def preprocess_facts(config, directory) -> dict:
    """How pixel_values are made: the source processor's settings, else CLIP defaults at the tower size."""
    size = int(config.vision_config.image_size)
    facts = {
        "kind": "clip",
        "resize_shortest_edge": size,
        "crop_size": [size, size],
        "mean": CLIP_MEAN,
        "std": CLIP_STD,
        "rescale_factor": 1 / 255,
        "resample": "bicubic",
    }
    pc = image_processor_config(directory)
    if pc is not None:
        s = pc.get("size", {})
        facts["resize_shortest_edge"] = int(
            s.get("shortest_edge", s.get("height", size)) if isinstance(s, dict) else s
        )
        c = pc.get("crop_size", {})
        facts["crop_size"] = (
            [int(c.get("height", size)), int(c.get("width", size))] if isinstance(c, dict) else [int(c)] * 2
        )
        facts.update(normalization(pc))
    return facts


def tokens_per_image(config) -> int:
    v = config.vision_config
    n = (v.image_size // v.patch_size) ** 2
    return n if config.vision_feature_select_strategy == "default" else n + 1


def attention_facts(vision_graph, config, cls: bool = True) -> dict | None:
    """Where the attention of the feature layer lives in the vision graph (read by prune_visual_tokens).

    hidden_states[0] is the embeddings, so hidden_states[f] (f < 0: L + f) is the output of encoder
    layer L + f (f > 0: f - 1); FasterVLM scores tokens with that same layer's CLS attention row.
    ``cls``: the tower has a CLS token (CLIP) as key 0; without one (SigLIP) the keys are the patches.
    """
    v = config.vision_config
    n_layers = int(v.num_hidden_layers)
    picked = (
        config.vision_feature_layer
        if isinstance(config.vision_feature_layer, int)
        else max((f if f >= 0 else n_layers + 1 + f) for f in config.vision_feature_layer)
    )
    layer = n_layers + picked if picked < 0 else picked - 1
    if layer < 0:
        return None  # features are the patch embeddings: no attention before them
    nodes = attention.softmax_nodes(vision_graph, scope=f"/encoder/layers.{layer}/")
    if len(nodes) != 1:
        logger.warning(
            "llava: found %d Softmax nodes for vision layer %d; attention facts not written",
            len(nodes),
            layer,
        )
        return None
    facts = attention.locate(vision_graph, nodes[0])
    n_patches = (int(v.image_size) // int(v.patch_size)) ** 2
    # Keys are [CLS, patches...]; feature tokens are the patches (default) or CLS + patches (full).
    facts.update(
        {
            "graph": "vision_encoder",
            "layer": layer,
            "layers": n_layers,
            "query_index": 0 if cls else None,
            "token_offset": 1 if cls and config.vision_feature_select_strategy == "default" else 0,
            "keys_per_image": n_patches + (1 if cls else 0),
        }
    )
    return facts


def export(source, pkg: Package) -> None:
    model, cfg = source.model, source.config
    tcfg, vcfg = cfg.text_config, cfg.vision_config
    n_tokens = tokens_per_image(cfg)
    size = int(vcfg.image_size)

    m = pkg.manifest
    m["vision"] = {
        "image_size": [size, size],
        "tokens_per_image": n_tokens,
        "image_token_id": int(cfg.image_token_index),
        "preprocess": preprocess_facts(cfg, source.directory),
        "patch_grid": [size // vcfg.patch_size] * 2,
        "has_cls_token": True,
        "feature_layer": cfg.vision_feature_layer,
        "select_strategy": cfg.vision_feature_select_strategy,
        "hidden_size": int(tcfg.hidden_size),
    }
    m["text"] = text_facts(cfg, tcfg, prompt_template=LLAVA_TEMPLATE, image_marker="<image>")
    m["kv"] = kv = kv_facts(tcfg)
    m["pipeline"] = {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}

    vision, pixels = base.export_square_vision(pkg, VisionWrapper(model), size, "image_features")
    m["vision"]["attention"] = attention_facts(vision, cfg)
    del vision
    base.export_embed(pkg, model.get_input_embeddings(), tcfg.vocab_size)
    base.export_decoder(
        pkg,
        model.model.language_model,
        model.lm_head,
        kv["layers"],
        kv["kv_heads"],
        kv["head_dim"],
        tcfg.hidden_size,
    )
