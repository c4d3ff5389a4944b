"""LLaVA-NeXT (LlavaNextForConditionalGeneration) on the generic tier: anyres tiles, unpadding, image_newline.

The family's own parts: the anyres preprocessing facts (grid pinpoints, tile and base sizes, the
processor's resize/crop/normalize settings; runtime in vlmc/runtime/anyres.py), and a vision module,
because ``get_image_features`` loops in Python over the image sizes (``select_best_resolution``), which
would fix the image count and sizes in a traced graph. The graph runs tower + projector on all tiles and
gathers the output tokens with the runtime's ``image_feature_index`` / ``image_feature_weight``.
"""

from __future__ import annotations

import logging

import torch

from vlmc.errors import VlmcError
from vlmc.exporters import base, generic, llava, zoo
from vlmc.exporters._facts import CLIP_MEAN, CLIP_STD, PIL_RESAMPLE, image_processor_config
from vlmc.runtime import anyres

logger = logging.getLogger(__name__)

IMAGE_TOKENS = "image_tokens"  # symbolic dim of the packed features


class AnyresVision(torch.nn.Module):
    """pixel_values [images, tiles, 3, S, S], image_feature_index / _weight [tokens, 4] -> image_features [tokens, hidden].

    Tower and projector as ``get_image_features`` (feature layer(s), CLS dropped for "default"), on every
    tile; the table [tile features..., image_newline] is then gathered and bilinearly mixed per output
    token (see vlmc/runtime/anyres.py), which is pack_image_features' unpad / downscale / newline.
    """

    def __init__(self, model) -> None:
        super().__init__()
        inner = model.model
        self.tower = inner.vision_tower
        self.projector = inner.multi_modal_projector
        self.newline = inner.image_newline
        cfg = model.config
        fl = cfg.vision_feature_layer
        self.layers = [fl] if isinstance(fl, int) else list(fl)
        self.drop_cls = cfg.vision_feature_select_strategy == "default"

    def forward(self, pixel_values, image_feature_index, image_feature_weight):
        x = pixel_values.reshape(-1, *pixel_values.shape[2:])
        hidden = self.tower(x, output_hidden_states=True, return_dict=True).hidden_states
        picked = [hidden[i][:, 1:] if self.drop_cls else hidden[i] for i in self.layers]
        feats = self.projector(picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1))
        table = torch.cat([feats.reshape(-1, feats.shape[-1]), self.newline.unsqueeze(0)], dim=0)
        g = table[image_feature_index]  # [tokens, 4, hidden]
        w = image_feature_weight.unsqueeze(-1)
        top = g[:, 0] * w[:, 0] + g[:, 1] * w[:, 1]
        bottom = g[:, 2] * w[:, 0] + g[:, 3] * w[:, 1]
        return top * w[:, 2] + bottom * w[:, 3]


class LlavaNext(generic.Family):
    name = "llava_next"
    model_types = ("llava_next",)
    architectures = ("LlavaNextForConditionalGeneration",)
    template = "USER: <image>\n{prompt} ASSISTANT:"
    # the image processor's class defaults (LlavaNextImageProcessorPil)
    default_center_crop = True

    def model_class(self, config=None):
        from transformers import LlavaNextForConditionalGeneration

        return LlavaNextForConditionalGeneration

    def default_size(self, tower: int) -> dict:
        return {"shortest_edge": tower}

    def max_tiles(self, config) -> int | None:
        return None  # LLaVA-NeXT keeps the whole unpadded grid

    def anyres_facts(self, config, directory=None) -> dict:
        """The runtime's anyres settings: the source processor's where it has them, else the class defaults."""
        v = config.vision_config
        tower, patch = int(v.image_size), int(v.patch_size)
        side = tower // patch
        pc = image_processor_config(directory) or {}
        size = pc.get("size") or self.default_size(tower)
        center = pc.get("do_center_crop", self.default_center_crop)
        crop = pc.get("crop_size") if center else None
        if center and crop is None:
            crop = {"height": tower, "width": tower}
        base_size = (
            [int(size["height"]), int(size["width"])]
            if "height" in size and "width" in size
            else [int(size["shortest_edge"])] * 2
        )
        tile = int(crop["height"]) if crop else int(size.get("height", size.get("shortest_edge")))
        if tile != tower:
            logger.warning("%s: processor tile %d differs from the vision tower's %d", self.name, tile, tower)
        pinpoints = pc.get("image_grid_pinpoints") or config.image_grid_pinpoints
        facts = {
            "kind": "anyres",
            "grid_pinpoints": [[int(h), int(w)] for h, w in pinpoints],
            "size": {k: int(x) for k, x in size.items()},
            "crop_size": {k: int(x) for k, x in crop.items()} if crop else None,
            "base_size": base_size,
            "tile_size": tile,
            "tile_tokens_side": side,
            "tile_tokens": side * side,
            "max_tiles": self.max_tiles(config),
            "mean": pc.get("image_mean", CLIP_MEAN),
            "std": pc.get("image_std", CLIP_STD),
            "rescale_factor": pc.get("rescale_factor", 1 / 255),
            "resample": PIL_RESAMPLE.get(pc.get("resample", 3), "bicubic"),
        }
        return facts

    def vision_facts(self, source) -> dict:
        cfg = source.config
        v = cfg.vision_config
        if cfg.vision_feature_select_strategy != "default" and "clip" in v.model_type:
            raise_full_cls(self.name)
        side = int(v.image_size) // int(v.patch_size)
        return {
            "image_size": None,
            "tokens_per_image": None,
            "dynamic_resolution": True,
            "packed_features": True,
            "image_token_id": int(cfg.image_token_id),
            "preprocess": self.anyres_facts(cfg, source.directory),
            "patch_grid": [side, side],
            "feature_layer": cfg.vision_feature_layer,
            "select_strategy": cfg.vision_feature_select_strategy,
            "has_cls_token": "clip" in v.model_type,
            # How the output tokens are gathered from the tiles' feature table (read by prune_visual_tokens):
            # row r of the table is tile r // tile_tokens's feature r % tile_tokens, image i's tiles start at
            # row i * tiles * tile_tokens, and the table's last row is image_newline.
            "token_table": {
                "index_input": "image_feature_index",
                "weight_input": "image_feature_weight",
                "pixels_input": "pixel_values",
                "tile_tokens": side * side,
                "most_rows": _most_rows(self.anyres_facts(cfg, source.directory)),
            },
        }

    def after_export(self, source, pkg, vision_graph) -> None:
        cls = bool(pkg.manifest["vision"].get("has_cls_token"))
        pkg.manifest["vision"]["attention"] = llava.attention_facts(vision_graph, source.config, cls=cls)

    def text_facts(self, source) -> dict:
        return {"prompt_template": self.template, "image_marker": "<image>"}

    def tokens_for_size(self, config, height: int, width: int, directory=None) -> int:
        return anyres.tokens_for_size(height, width, self.anyres_facts(config, directory))

    def vision_trace(self, model, config) -> generic.VisionTrace:
        # Two images of different aspect ratios (different tile grids and unpadding), padded to 3 tiles.
        facts = self.anyres_facts(config)
        tile = facts["tile_size"]
        g = torch.Generator().manual_seed(0)
        pixels = torch.randn(2, 3, 3, tile, tile, generator=g)
        import numpy as np

        sizes = np.array([[tile, 2 * tile], [2 * tile, tile]], np.int64)
        feeds = anyres.graph_feeds({"pixel_values": pixels.numpy(), "image_sizes": sizes}, facts)
        names = ["pixel_values", "image_feature_index", "image_feature_weight"]
        args = [
            pixels,
            torch.from_numpy(feeds["image_feature_index"]),
            torch.from_numpy(feeds["image_feature_weight"]),
        ]
        return generic.VisionTrace(
            AnyresVision(model),
            args,
            names,
            {
                "pixel_values": {0: base.IMAGES, 1: "tiles"},
                "image_feature_index": {0: IMAGE_TOKENS},
                "image_feature_weight": {0: IMAGE_TOKENS},
            },
            output_axes={0: IMAGE_TOKENS},
        )


def _most_rows(facts: dict) -> int:
    """The most feature-grid rows (each ends in image_newline) one image can give: over every pinpoint's
    grid and every unpadded part of it, as ``anyres.most_tokens`` (a narrow part may escape the downscale)."""
    tile, side = int(facts["tile_size"]), int(facts["tile_tokens_side"])
    most = 0
    for ph, pw in facts["grid_pinpoints"]:
        rows, cols = int(ph) // tile * side, int(pw) // tile * side
        for h, w in [(rows, c) for c in range(1, cols + 1)] + [(r, cols) for r in range(1, rows + 1)]:
            most = max(most, anyres._downscaled(h, w, facts)[0])
    return most


def raise_full_cls(name: str):
    raise VlmcError(
        f"{name}: vision_feature_select_strategy 'full' with a CLS tower gives tiles one token more than "
        "their patch grid, which transformers' pack_image_features cannot lay out either"
    )


globals().update(generic.module_api(LlavaNext()))


# ---- built-in ------------------------------------------------------------------------------------


def tiny_llava_next_config(**text_over):
    """A small LLaVA-NeXT (CLIP 32 px tiles, patch 8: 16 tokens per tile; pinpoints up to 2x2 tiles)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        projection_dim=32,
        initializer_range=0.2,
    )
    text = LlamaConfig(**zoo._text_kwargs(**text_over))
    return LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=zoo.TINY_IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=[[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]],
        pad_token_id=0,
    )


def _build():
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration(tiny_llava_next_config())


zoo.register_builtin("tiny-llava-next", "llava_next", _build)
