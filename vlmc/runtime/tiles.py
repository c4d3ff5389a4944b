"""Tiled preprocessing (kind ``tiles``): InternVL's dynamic tiles plus a thumbnail, as GotOcr2's processor makes them.

Matches transformers' GotOcr2ImageProcessorPil with ``crop_to_patches`` (what InternVLProcessor asks for):

- the tile grid (columns x rows, ``min_tiles <= columns * rows <= max_tiles``) is the one whose aspect ratio
  is closest to the image's; on a tie the later (larger) grid wins while the image's area is above half the
  grid's area (:func:`tile_grid`);
- the image is resized to the grid (``columns * tile_w`` x ``rows * tile_h``) and cut into tiles in row-major
  order; when there is more than one tile, a thumbnail (the whole image resized to one tile) comes last;
- each tile is rescaled in float64 and cast to float32, then normalized in float32 (transformers'
  ``rescale`` and ``normalize``).

The vision graph sees every tile as one image row (``pixel_values`` [tiles, 3, H, W]); the prompt gets
``tokens_per_image`` placeholders per tile, which is why the tile count of each image leaves here too.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from vlmc.runtime import imaging

logger = logging.getLogger(__name__)

# The key of the per-image tile counts in the preprocessing output; not a graph input (the pipeline takes
# it out before feeding the graphs).
TILES_KEY = "image_tiles"


@functools.lru_cache(maxsize=16)
def tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) with min_tiles <= columns * rows <= max_tiles, in the processor's order.

    Generated columns-major, then stably sorted by tile count (GotOcr2's get_all_supported_aspect_ratios);
    the order decides ties in :func:`tile_grid`.
    """
    grids = [
        (c, r)
        for c in range(1, max_tiles + 1)
        for r in range(1, max_tiles + 1)
        if min_tiles <= c * r <= max_tiles
    ]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def tile_grid(
    height: int, width: int, tile_h: int, tile_w: int, min_tiles: int, max_tiles: int
) -> tuple[int, int]:
    """(columns, rows) for an image of ``height`` x ``width`` (GotOcr2's get_optimal_tiled_canvas)."""
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in tile_grids(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile_h * tile_w * cols * rows:
            best = (cols, rows)
    return best


def tiles_for(height: int, width: int, facts: dict) -> int:
    """How many tiles (thumbnail included) an image of ``height`` x ``width`` becomes; also used by plan."""
    if not facts.get("crop_to_patches", True) or int(facts["max_tiles"]) <= 1:
        return 1
    th, tw = facts["tile_size"]
    cols, rows = tile_grid(height, width, int(th), int(tw), int(facts["min_tiles"]), int(facts["max_tiles"]))
    n = cols * rows
    return n + 1 if n > 1 and facts.get("thumbnail", True) else n


def _normalize(tile: np.ndarray, facts: dict) -> np.ndarray:
    x = (tile.astype(np.float64) * float(facts.get("rescale_factor", 1 / 255))).astype(np.float32)
    mean, std = np.array(facts["mean"], np.float32), np.array(facts["std"], np.float32)
    return ((x - mean) / std).transpose(2, 0, 1)


def tiles(images: list[np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    """Images (uint8 HWC) -> pixel_values [tiles, 3, H, W] float32 and image_tiles [images] int64."""
    th, tw = (int(s) for s in facts["tile_size"])
    resample = facts.get("resample", "bicubic")
    out, counts = [], []
    for img in images:
        h, w = img.shape[:2]
        if not facts.get("crop_to_patches", True) or int(facts["max_tiles"]) <= 1:
            pieces = [imaging.resize(img, th, tw, resample)]
        else:
            cols, rows = tile_grid(h, w, th, tw, int(facts["min_tiles"]), int(facts["max_tiles"]))
            canvas = imaging.resize(img, rows * th, cols * tw, resample)
            pieces = [
                canvas[r * th : (r + 1) * th, c * tw : (c + 1) * tw] for r in range(rows) for c in range(cols)
            ]
            if len(pieces) > 1 and facts.get("thumbnail", True):
                pieces.append(imaging.resize(img, th, tw, resample))
        out.extend(_normalize(p, facts) for p in pieces)
        counts.append(len(pieces))
    return {"pixel_values": np.stack(out).astype(np.float32), TILES_KEY: np.array(counts, np.int64)}


def max_tiles_per_image(facts: dict) -> int:
    """The most tiles an image can become (the grid at max_tiles, plus the thumbnail)."""
    if not facts.get("crop_to_patches", True) or int(facts["max_tiles"]) <= 1:
        return 1
    return int(facts["max_tiles"]) + (1 if facts.get("thumbnail", True) else 0)


def tokens_for_size(vision: dict, height: int | None, width: int | None) -> tuple[int, int, str]:
    """Image tokens of one image from the manifest's vision facts: (tokens, tiles, how they were counted).

    Without a size, the worst case (:func:`max_tiles_per_image`).
    """
    facts = vision["preprocess"]
    per_tile = int(vision["tokens_per_image"])
    if height is None or width is None:
        n = max_tiles_per_image(facts)
        return n * per_tile, n, f"at most {n} tiles of {per_tile} tokens (give an image size for its count)"
    n = tiles_for(height, width, facts)
    return n * per_tile, n, f"{height}x{width}: {n} tiles of {per_tile} tokens"


# ---- resolution gears (a compile output's fixed tile counts) -------------------------------------
def tile_counts(facts: dict) -> list[int]:
    """Every tile count (thumbnail included) the processor can give one image."""
    if not facts.get("crop_to_patches", True) or int(facts["max_tiles"]) <= 1:
        return [1]
    thumb = 1 if facts.get("thumbnail", True) else 0
    return sorted(
        {
            c * r + (thumb if c * r > 1 else 0)
            for c, r in tile_grids(int(facts["min_tiles"]), int(facts["max_tiles"]))
        }
    )


def default_gears(facts: dict, vision: dict | None = None) -> list[int]:
    """Tiles per image: the powers of two up to the most tiles an image can become, and that most."""
    return imaging.power_buckets(min(tile_counts(facts)), max_tiles_per_image(facts))


def check_gears(facts: dict, values: list[int], vision: dict | None = None) -> str | None:
    """The largest tile gear must hold the most tiles an image can become (tiles are padded up, never cut)."""
    most = max_tiles_per_image(facts)
    if max(values) < most:
        return f"the largest tile gear {max(values)} is below the {most} tiles an image can become"
    return None
