"""Deepstack decoder inputs (Qwen3-VL): vision-layer features added at the image positions of the first layers.

Driven by the manifest's ``text.deepstack`` (docs/architecture.md, "Interfaces"): the image chain's output
``vision_output`` [layers, image_tokens, hidden] becomes the decoder input ``embeds_input``, and
``mask_input`` (int64 [batch, seq]) marks the image placeholders they belong to, in batch-major order.
Decode steps and text-only prompts feed an all-zero mask and one zero row ([layers, 1, hidden]): the graph
reads row 0 of its own zero-padded table at every unmarked position, so the row is never used, and no
dimension is ever 0 (ATC needs positive sizes; the Ascend build's decode gear is 1 row).
"""

from __future__ import annotations

import logging

import numpy as np

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


def feeds(manifest: dict, input_ids: np.ndarray, image_outputs: dict, hidden: int, prefill: bool) -> dict:
    """The deepstack decoder inputs for one step; {} for packages without deepstack."""
    ds = manifest["text"].get("deepstack")
    if not ds:
        return {}
    layers = int(ds["layers"])
    if not prefill:
        batch = input_ids.shape[0]
        return {
            ds["mask_input"]: np.zeros((batch, 1), np.int64),
            ds["embeds_input"]: np.zeros((layers, 1, hidden), np.float32),
        }
    mask = (input_ids == int(manifest["vision"]["image_token_id"])).astype(np.int64)
    stack = image_outputs.get(ds["vision_output"]) if image_outputs else None
    if stack is None:
        if mask.any():
            raise VlmcError(
                f"the decoder needs {ds['embeds_input']!r} for the image placeholders, and the image "
                f"chain did not output {ds['vision_output']!r}"
            )
        return {ds["mask_input"]: mask, ds["embeds_input"]: np.zeros((layers, 1, hidden), np.float32)}
    stack = np.asarray(stack).reshape(layers, -1, stack.shape[-1])
    if stack.shape[1] != int(mask.sum()):
        raise VlmcError(
            f"{int(mask.sum())} image placeholders but the image chain gave {stack.shape[1]} deepstack rows"
        )
    return {ds["mask_input"]: mask, ds["embeds_input"]: stack}
