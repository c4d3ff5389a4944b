"""InternVL exporter (InternVLForConditionalGeneration, the "-hf" checkpoints: InternVL2.5 / 3 / 3.5).

An image becomes dynamic tiles plus a thumbnail (GotOcr2's image processor, crop_to_patches); every tile
is one row of the vision graph: InternViT, then pixel shuffle 0.5 (each 2x2 patch group folded into one
token) and the MLP projector, ``(tile / patch)² / 4`` tokens per tile. The processor writes
``<img>`` + ``<IMG_CONTEXT>`` x tokens x tiles + ``</img>`` for each image; the manifest says so with
``text.image_expansion`` and the tile rule with ``vision.preprocess`` (kind ``tiles``), so the runtime, plan and
the passes need no InternVL code.
"""

from __future__ import annotations

import logging

import torch

from vlmc.errors import VlmcError
from vlmc.exporters import attention, base, generic, processor, zoo
from vlmc.exporters._facts import PIL_RESAMPLE
from vlmc.runtime import tiles

logger = logging.getLogger(__name__)

MODEL_TYPES = ("internvl",)
ARCHITECTURES = ("InternVLForConditionalGeneration",)
# The -hf checkpoints' image placeholder and its wrap (the tokenizer's context/start/end image tokens).
IMAGE_MARKER = "<IMG_CONTEXT>"
IMAGE_WRAP = ("<img>", "</img>")
# The converted checkpoints' chat layout (transformers' convert_internvl_weights_to_hf.py): Qwen turns,
# one "<IMG_CONTEXT>\n" per image ahead of the text.
INTERNVL_TEMPLATE = "<|im_start|>user\n{marker}\n{{prompt}}<|im_end|>\n<|im_start|>assistant\n"
# ImageNet statistics, which every converted InternVL checkpoint's image processor uses.
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
# What InternVLProcessor asks of GotOcr2's image processor unless told otherwise, and GotOcr2's defaults.
DEFAULT_TILING = {"crop_to_patches": True, "min_patches": 1, "max_patches": 12}


def _model_class():
    from transformers import InternVLForConditionalGeneration

    return InternVLForConditionalGeneration


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (list, tuple)) else (int(v), int(v))


def tokens_per_tile(config) -> int:
    """Visual tokens one tile gives: its patches, folded 1/ratio² at a time by the pixel shuffle."""
    v = config.vision_config
    (h, w), (ph, pw) = _pair(v.image_size), _pair(v.patch_size)
    fold = int(round(1 / float(config.downsample_ratio))) ** 2
    return (h // ph) * (w // pw) // fold


# ---- built-in ----------------------------------------------------------------------------------


def tiny_internvl_config(vision_over: dict | None = None, **text_over):
    """A small InternVL3-like config: 64 px tiles of 8 px patches (16 tokens a tile), Qwen2 decoder."""
    from transformers import InternVLConfig, InternVLVisionConfig, Qwen2Config

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=64,
        patch_size=8,
        initializer_range=0.2,
        layer_scale_init_value=1.0,
    )
    vision.update(vision_over or {})
    text = Qwen2Config(**zoo._text_kwargs(**text_over))
    cfg = InternVLConfig(
        vision_config=InternVLVisionConfig(**vision),
        text_config=text,
        image_token_id=zoo.TINY_IMAGE_TOKEN,
        tie_word_embeddings=False,
    )
    cfg.image_seq_length = tokens_per_tile(cfg)
    return cfg


def _build_internvl():
    from transformers import InternVLForConditionalGeneration

    return InternVLForConditionalGeneration(tiny_internvl_config())


zoo.register_builtin("tiny-internvl", "internvl", _build_internvl)


# ---- manifest facts ----------------------------------------------------------------------------


def _processor_settings(directory) -> tuple[dict, int | None]:
    """The image settings InternVLProcessor actually passes to its image processor, and its image_seq_length.

    The processor's own defaults (crop_to_patches: True) take precedence over the image processor's
    attributes (GotOcr2's crop_to_patches: False, which the hub configs also save), so the settings are
    read from the loaded processor the way its __call__ merges them, not from preprocessor_config.json.
    """
    proc = processor.load(directory)
    ip = getattr(proc, "image_processor", None)
    if ip is None:
        raise VlmcError(f"{directory}: the processor has no image processor")
    if "GotOcr2" not in type(ip).__name__:
        raise VlmcError(
            f"{directory}: internvl export reproduces GotOcr2's tiling; this checkpoint's image processor is "
            f"{type(ip).__name__}, which vlmc does not reproduce yet"
        )
    merged = proc._merge_kwargs(tokenizer_init_kwargs=proc.tokenizer.init_kwargs)["images_kwargs"]
    keys = (
        "crop_to_patches",
        "min_patches",
        "max_patches",
        "size",
        "image_mean",
        "image_std",
        "rescale_factor",
        "resample",
        "do_rescale",
        "do_normalize",
    )
    out = {k: merged.get(k, getattr(ip, k, None)) for k in keys}
    if out["do_rescale"] is False or out["do_normalize"] is False:
        raise VlmcError(
            f"{directory}: the image processor turns off rescale or normalize, which vlmc does not reproduce"
        )
    return out, getattr(proc, "image_seq_length", None)


def preprocess_facts(config, directory) -> dict:
    """Tile rule and pixel statistics: the source processor's settings, else the converted checkpoints'."""
    th, tw = _pair(config.vision_config.image_size)
    facts = {
        "kind": "tiles",
        "tile_size": [th, tw],
        "crop_to_patches": DEFAULT_TILING["crop_to_patches"],
        "min_tiles": DEFAULT_TILING["min_patches"],
        "max_tiles": DEFAULT_TILING["max_patches"],
        "thumbnail": True,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "rescale_factor": 1 / 255,
        "resample": "bicubic",
        "patch_size": _pair(config.vision_config.patch_size)[0],
    }
    if directory is None:
        return facts
    s, seq_len = _processor_settings(directory)
    size = s["size"]
    size = (size.get("height"), size.get("width")) if isinstance(size, dict) else (size.height, size.width)
    if tuple(int(x) for x in size) != (th, tw):
        raise VlmcError(
            f"{directory}: the image processor makes {size[0]}x{size[1]} tiles but the vision tower takes "
            f"{th}x{tw}; the processor and config.json do not belong together"
        )
    if seq_len is not None and int(seq_len) != tokens_per_tile(config):
        raise VlmcError(
            f"{directory}: the processor writes {seq_len} image tokens per tile (image_seq_length) but the "
            f"model gives {tokens_per_tile(config)}; the processor and config.json do not belong together"
        )
    resample = 3 if s["resample"] is None else int(s["resample"])
    if resample not in PIL_RESAMPLE:
        raise VlmcError(f"{directory}: image processor resample={resample} is not one vlmc reproduces")
    facts.update(
        crop_to_patches=bool(s["crop_to_patches"]),
        min_tiles=int(s["min_patches"]),
        max_tiles=int(s["max_patches"]),
        mean=[float(x) for x in s["image_mean"]],
        std=[float(x) for x in s["image_std"]],
        rescale_factor=float(s["rescale_factor"]),
        resample=PIL_RESAMPLE[resample],
    )
    return facts


def vision_facts(config, directory) -> dict:
    v = config.vision_config
    (th, tw), (ph, pw) = _pair(v.image_size), _pair(v.patch_size)
    fold = int(round(1 / float(config.downsample_ratio)))
    return {
        "image_size": [th, tw],
        "tokens_per_image": tokens_per_tile(config),
        "tiled": True,
        "image_token_id": int(config.image_token_id),
        "preprocess": preprocess_facts(config, directory),
        "patch_grid": [th // ph, tw // pw],
        # pixel shuffle: tokens run row-major over fold x fold patch groups of each tile
        "token_grid": [th // ph // fold, tw // pw // fold],
        "has_cls_token": True,
        "feature_layer": config.vision_feature_layer,
        "select_strategy": config.vision_feature_select_strategy,
        "downsample_ratio": float(config.downsample_ratio),
        "attention": None,  # written after export (_attention_facts), from the traced graph
    }


def _shuffle_groups(model, config) -> list[list[int]]:
    """[tokens, fold²] the patch each token's pixel-shuffle channels come from (the model's own shuffle
    applied to patch numbers), plus 1 for the CLS key column."""
    v = config.vision_config
    (th, tw), (ph, pw) = _pair(v.image_size), _pair(v.patch_size)
    rows, cols = th // ph, tw // pw
    numbers = torch.arange(rows * cols, dtype=torch.float32).reshape(1, rows, cols, 1)
    shuffled = model.model.pixel_shuffle(numbers, scale_factor=float(config.downsample_ratio))
    groups = shuffled.reshape(-1, shuffled.shape[-1]).round().long() + 1  # key 0 is CLS
    return groups.tolist()


def _attention_facts(source, vision_graph) -> dict | None:
    """The feature layer's CLS attention, each token scored by the patches its pixel-shuffle group folds."""
    cfg = source.config
    v = cfg.vision_config
    layers = int(v.num_hidden_layers)
    layer = attention.feature_layer_index(cfg.vision_feature_layer, layers)
    (th, tw), (ph, pw) = _pair(v.image_size), _pair(v.patch_size)
    facts = attention.grouped_facts(
        vision_graph,
        f"/encoder/layer.{layer}/",
        (th // ph) * (tw // pw) + 1,
        0,
        _shuffle_groups(source.model, cfg),
        "internvl",
    )
    if facts:
        facts.update({"layer": layer, "layers": layers})
    return facts


def _has_tokenizer(source) -> bool:
    # The byte tokenizer of a built-in maps only "<image>" to the image id and has no <img>/</img> tokens.
    return source.directory is not None and any(
        (source.directory / f).is_file() for f in ("tokenizer.json", "vocab.json")
    )


class InternVL(generic.Family):
    """InternVL on the generic tier: get_image_features traces as is (one tile per vision-graph row)."""

    name = "internvl"
    model_types = MODEL_TYPES
    architectures = ARCHITECTURES

    def model_class(self, config=None):
        return _model_class()

    def vision_facts(self, source) -> dict:
        if isinstance(source.config.vision_feature_layer, list):
            raise VlmcError("internvl: a list of vision_feature_layer is not exported yet (one layer only)")
        return vision_facts(source.config, source.directory)

    def after_export(self, source, pkg, vision_graph) -> None:
        pkg.manifest["vision"]["attention"] = _attention_facts(source, vision_graph)

    def text_facts(self, source) -> dict:
        if not _has_tokenizer(source):
            return {"prompt_template": INTERNVL_TEMPLATE.format(marker="<image>"), "image_marker": "<image>"}
        # The chat template writes <IMG_CONTEXT> per image; the processor replaces each with
        # <img> + <IMG_CONTEXT> x tokens x tiles + </img>.
        return {
            "prompt_template": INTERNVL_TEMPLATE.format(marker=IMAGE_MARKER),
            "image_marker": IMAGE_MARKER,
            "image_token": IMAGE_MARKER,
            "image_expansion": IMAGE_WRAP[0] + "{tokens}" + IMAGE_WRAP[1],
        }

    def tokens_per_image(self, config):
        return None  # the tile count depends on the image size (tokens_for_size)

    def tokens_for_size(self, config, height: int, width: int, directory=None) -> int:
        return self.vision_rows_for_size(config, height, width, directory) * tokens_per_tile(config)

    def vision_rows_for_size(self, config, height: int, width: int, directory=None) -> int:
        """Tiles (vision-graph rows) of an image of this size, by the source processor's tile settings."""
        return tiles.tiles_for(height, width, preprocess_facts(config, directory))

    def vision_trace(self, model, config) -> generic.VisionTrace:
        th, tw = _pair(config.vision_config.image_size)
        pixels = torch.randn(3, int(config.vision_config.num_channels), th, tw, generator=generic._gen())
        return generic.VisionTrace(
            generic.ImageFeatures(model, ["pixel_values"]),
            [pixels],
            ["pixel_values"],
            {"pixel_values": {0: base.IMAGES}},
        )


globals().update(generic.module_api(InternVL()))
