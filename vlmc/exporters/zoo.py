"""Built-in tiny models: small random-weight configs built in code, so everything runs offline.

Each entry builds a real transformers model with a fixed seed; the same name always gives the same
weights, which is how `vlmc verify` rebuilds the source of a built-in package.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Byte-level fallback tokenizer layout used by built-ins (see vlmc/runtime/tokenizer.py):
# 0 pad, 1 bos, 2 eos, 3..258 the bytes, the last id is the image placeholder.
TINY_VOCAB = 320
TINY_IMAGE_TOKEN = TINY_VOCAB - 1


def _text_kwargs(**over) -> dict:
    kw = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    kw.update(over)
    return kw


def tiny_llava_config(**text_over):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=64,
        patch_size=8,
        projection_dim=48,
        initializer_range=0.2,
    )
    text = LlamaConfig(**_text_kwargs(**text_over))
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=TINY_IMAGE_TOKEN,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        pad_token_id=0,
    )


def _build_llava():
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration(tiny_llava_config())


BUILTINS: dict[str, tuple[str, Callable]] = {
    "tiny-llava": ("llava", _build_llava),
}


def register_builtin(name: str, family: str, builder: Callable) -> None:
    """Add a built-in (family modules call this for their tiny configs)."""
    BUILTINS[name] = (family, builder)


def build(name: str):
    """Instantiate a built-in model with its fixed seed (weights are identical on every call)."""
    import torch

    if name not in BUILTINS:
        raise VlmcError(f"unknown built-in {name!r}; built-ins: {', '.join(sorted(BUILTINS))}")
    _, builder = BUILTINS[name]
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = builder()
    finally:
        torch.random.set_rng_state(state)
    return model.eval()
