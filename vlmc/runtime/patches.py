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


# ---- resolution gears (a compile output's fixed patch counts) ------------------------------------
# A build for an NPU has one static shape per gear, so it takes a few patch counts per image, not any
# (docs/ascend.md, "Resolution gears"). Each image is resized to a grid of a compiled count; the token
# count of that grid is then exact, and the package given the resized image sees the same grid.
MAX_DEFAULT_GEARS = 8


def _frames(facts: dict) -> int:
    """Frames the pixel bounds count: the temporal frames for GLM-4.1V's rule, else one."""
    return int(facts["temporal_patch_size"]) if facts.get("resize", "pixels") == "temporal_pixels" else 1


def patch_bounds(facts: dict, vision: dict | None = None) -> tuple[int, int]:
    """The fewest and most patches per image the preprocessor's min/max pixels allow.

    A pruned package (``vision.pruning``) keeps ``tokens_per_image`` tokens of each image, so an image
    needs at least that many merge blocks.
    """
    patch, frames = int(facts["patch_size"]), _frames(facts)
    lo = math.ceil(int(facts["min_pixels"]) / frames / patch**2)
    hi = int(facts["max_pixels"]) // frames // patch**2
    kept = (vision or {}).get("tokens_per_image")
    if (vision or {}).get("pruning") and isinstance(kept, int):
        lo = max(lo, kept * int(facts["merge_size"]) ** 2)
    return lo, hi


def default_gears(facts: dict, vision: dict | None = None) -> list[int]:
    """Patches per image: ``merge² · 2^j`` for the powers of two inside the preprocessor's bounds.

    Powers of two (in merged units) give every power-of-two aspect ratio at adjacent counts; above
    :data:`MAX_DEFAULT_GEARS` of them only the largest are kept (smaller images are scaled up, so no
    detail is lost), which keeps the profiles of the builds that multiply them well under ATC's 100.
    """
    merge2 = int(facts["merge_size"]) ** 2
    lo, hi = patch_bounds(facts, vision)
    out, m = [], 1
    while m * merge2 <= hi:
        if m * merge2 >= lo:
            out.append(m * merge2)
        m *= 2
    return out[-MAX_DEFAULT_GEARS:]


def check_gears(facts: dict, values: list[int], vision: dict | None = None) -> str | None:
    """Why a patch gear cannot hold an image (None when every one can)."""
    merge2 = int(facts["merge_size"]) ** 2
    lo, hi = patch_bounds(facts, vision)
    for v in values:
        if v % merge2:
            return (
                f"{v} patches is not a multiple of merge_size² ({merge2}): the grid's sides are merge blocks"
            )
        if not lo <= v <= hi:
            return (
                f"{v} patches is outside what the preprocessor's min/max pixels (and a pruned package's "
                f"kept tokens) allow ({lo}..{hi})"
            )
        if not _grids(facts, v):
            return f"{v} patches has no grid the preprocessor keeps as it is"
    return None


def _grids(facts: dict, count: int) -> list[tuple[int, int]]:
    """Every (grid_h, grid_w) of ``count`` patches in merge blocks that the smart resize leaves unchanged."""
    patch, merge = int(facts["patch_size"]), int(facts["merge_size"])
    resize = RESIZE_RULES[facts.get("resize", "pixels")]
    units = count // (merge * merge)
    out = []
    for a in range(1, units + 1):
        if units % a:
            continue
        gh, gw = a * merge, units // a * merge
        if max(gh, gw) / min(gh, gw) > 200:
            continue
        h, w = gh * patch, gw * patch
        if resize(h, w, patch * merge, int(facts["min_pixels"]), int(facts["max_pixels"])) == (h, w):
            out.append((gh, gw))
    return out


def gear_grid(height: int, width: int, facts: dict, values: list[int]) -> tuple[int, int]:
    """The compiled grid nearest the image's own, in log scale: the least ``ln(gh/h0)² + ln(gw/w0)²``.

    The image's own grid (h0, w0) is the processor's smart resize; every grid of every compiled count
    is a candidate. Scaling both sides alike is nearer than stretching one, so the aspect ratio is kept
    where a compiled count allows it (ties: fewer patches, then the taller grid).
    """
    patch, merge = int(facts["patch_size"]), int(facts["merge_size"])
    resize = RESIZE_RULES[facts.get("resize", "pixels")]
    nh, nw = resize(height, width, patch * merge, int(facts["min_pixels"]), int(facts["max_pixels"]))
    h0, w0 = nh // patch, nw // patch
    candidates = [(gh, gw) for v in values for gh, gw in _grids(facts, v)]
    if not candidates:
        raise VlmcError(f"vision.preprocess.gears.patches {values} has no grid this preprocessor keeps")
    return min(
        candidates,
        key=lambda g: (
            round(math.log(g[0] / h0) ** 2 + math.log(g[1] / w0) ** 2, 9),
            g[0] * g[1],
            -g[0],
        ),
    )


def fit(images: list[np.ndarray], facts: dict, values: list[int]) -> tuple[list[np.ndarray], list[str]]:
    """Each image resized to its compiled grid's pixels (:func:`gear_grid`), and one note per image.

    Every image of one request takes the same patch count (a build's gear pairs ``images`` with
    ``images × patches per image``): the largest that any image's nearest grid has.
    """
    patch, merge = int(facts["patch_size"]), int(facts["merge_size"])
    count = max(gh * gw for gh, gw in (gear_grid(*img.shape[:2], facts, values) for img in images))
    out, notes = [], []
    for i, img in enumerate(images):
        h, w = img.shape[:2]
        gh, gw = gear_grid(h, w, facts, [count])
        out.append(imaging.resize(img, gh * patch, gw * patch, facts.get("resample", "bicubic")))
        notes.append(
            f"image {i}: {h}x{w} resized to {gh * patch}x{gw * patch} for the patches gear {gh * gw} "
            f"(grid 1x{gh}x{gw}, {gh * gw // (merge * merge)} image tokens)"
        )
    return out, notes
