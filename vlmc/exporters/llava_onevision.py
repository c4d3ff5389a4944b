"""LLaVA-OneVision (LlavaOnevisionForConditionalGeneration) on the generic tier: LLaVA-NeXT's anyres plus
the ``anyres_max_N`` downscale.

What differs from LLaVA-NeXT is only facts: a SigLIP tower (no CLS, "full" features), tiles resized to
``size`` h x w without a center crop, and ``vision_aspect_ratio`` ``anyres_max_N``: when the unpadded
feature grid is more than 1.1x the area of N tiles, pack_image_features interpolates it bilinearly down
(runtime: vlmc/runtime/anyres.py, ``max_tiles``). The processor pads several images of one prompt to
squares without tiles; the runtime reproduces the one-image-per-prompt layout and refuses more.
"""

from __future__ import annotations

import logging

from vlmc.errors import VlmcError
from vlmc.exporters import generic, zoo
from vlmc.exporters.llava_next import LlavaNext

logger = logging.getLogger(__name__)


class LlavaOnevision(LlavaNext):
    name = "llava_onevision"
    model_types = ("llava_onevision",)
    architectures = ("LlavaOnevisionForConditionalGeneration",)
    template = "<|im_start|>user <image>\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    default_center_crop = False

    def model_class(self, config=None):
        from transformers import LlavaOnevisionForConditionalGeneration

        return LlavaOnevisionForConditionalGeneration

    def default_size(self, tower: int) -> dict:
        return {"height": tower, "width": tower}

    def max_tiles(self, config) -> int | None:
        ratio = str(getattr(config, "vision_aspect_ratio", "anyres_max_9"))
        if not ratio.startswith("anyres_max_") or not ratio.removeprefix("anyres_max_").isdigit():
            raise VlmcError(f"llava_onevision: vision_aspect_ratio {ratio!r} is not anyres_max_N")
        return int(ratio.removeprefix("anyres_max_"))

    def anyres_facts(self, config, directory=None) -> dict:
        facts = super().anyres_facts(config, directory)
        # Several images in one prompt are padded to squares, one tile each (not reproduced).
        facts["max_images_per_prompt"] = 1
        return facts


globals().update(generic.module_api(LlavaOnevision()))


def tiny_llava_onevision_config(**text_over):
    """A small OneVision (SigLIP 32 px tiles, patch 8: 16 tokens per tile; pinpoints up to 3x3 tiles,
    anyres_max_4 so a 3x3 grid is downscaled)."""
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        initializer_range=0.2,
    )
    text = Qwen2Config(**zoo._text_kwargs(**text_over))
    pinpoints = [[32 * h, 32 * w] for h in range(1, 4) for w in range(1, 4)]
    return LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=zoo.TINY_IMAGE_TOKEN,
        video_token_index=zoo.TINY_IMAGE_TOKEN - 1,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_4",
        image_grid_pinpoints=pinpoints,
        pad_token_id=0,
    )


def _build():
    from transformers import LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration(tiny_llava_onevision_config())


zoo.register_builtin("tiny-llava-onevision", "llava_onevision", _build)
