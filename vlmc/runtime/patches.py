"""Packed-patch preprocessing (kind ``packed_patches``): smart resize, then patchify into packed rows.

Matches transformers' Qwen2VLImageProcessor (PIL backend): each image keeps its aspect ratio and gets its
own grid, so ``pixel_values`` is [sum of patches, C*T*P*P] and ``image_grid_thw`` [images, 3] says which
rows belong to which image. Still images are repeated ``temporal_patch_size`` times along time.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from vlmc.errors import VlmcError
from vlmc.runtime import imaging

logger = logging.getLogger(__name__)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, pixel count within [min, max], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise VlmcError(
            f"image aspect ratio {max(height, width) / min(height, width):.0f} is above 200; crop it first"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_temporal(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, temporal: int = 2
) -> tuple[int, int]:
    """Smart resize whose pixel bounds count the ``temporal`` frames a still image is repeated into, with
    sides below ``factor`` scaled up first (truncated to int): GLM-4.1V's Glm4vImageProcessor."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VlmcError(
            f"image aspect ratio {max(height, width) / min(height, width):.0f} is above 200; crop it first"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(temporal / temporal) * temporal  # a still image is exactly `temporal` frames
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((temporal * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (temporal * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# vision.preprocess.resize -> the smart-resize rule: bounds on one frame's pixels (the default, Qwen2-VL's
# image processor), or on all temporal frames' pixels (GLM-4.1V's)
RESIZE_RULES = {"pixels": smart_resize, "temporal_pixels": smart_resize_temporal}


def patchify(image: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, int, int]:
    """CHW float image -> [grid_h*grid_w, C*T*P*P] rows in merge-block-major order, plus the grid."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    x = image.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, *x.shape[5:]))
    return x.reshape(gh * gw, c * temporal * patch * patch), gh, gw


def packed_patches(images: list[np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    """Images (uint8 HWC) -> pixel_values [patches, C*T*P*P] float32 and image_grid_thw [images, 3] int64."""

    patch, merge, temporal = (
        int(facts["patch_size"]),
        int(facts["merge_size"]),
        int(facts["temporal_patch_size"]),
    )
    mean, std = np.array(facts["mean"], np.float32), np.array(facts["std"], np.float32)
    rule = facts.get("resize", "pixels")
    if rule not in RESIZE_RULES:
        raise VlmcError(
            f"unknown smart-resize rule {rule!r} (vision.preprocess.resize); known: {', '.join(RESIZE_RULES)}; "
            "upgrade vlmc, or re-export the package with this one"
        )
    resize = RESIZE_RULES[rule]
    rows, grids = [], []
    for img in images:
        h, w = img.shape[:2]
        nh, nw = resize(h, w, patch * merge, int(facts["min_pixels"]), int(facts["max_pixels"]))
        x = imaging.resize(img, nh, nw, facts.get("resample", "bicubic")).astype(np.float32)
        x = (x * np.float32(facts.get("rescale_factor", 1 / 255)) - mean) / std
        flat, gh, gw = patchify(x.transpose(2, 0, 1), patch, merge, temporal)
        rows.append(flat)
        grids.append([1, gh, gw])
    return {
        "pixel_values": np.concatenate(rows).astype(np.float32),
        "image_grid_thw": np.array(grids, np.int64),
    }
