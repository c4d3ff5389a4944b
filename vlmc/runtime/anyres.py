"""Anyres tiling (kind ``anyres``): LLaVA-NeXT's and LLaVA-OneVision's image processing and token layout.

Matches transformers' LlavaNextImageProcessorPil / LlavaOnevisionImageProcessorPil and the models'
``pack_image_features``, without torch:

- preprocessing: the grid pinpoint that keeps most of the image (``select_best_resolution``), the image
  resized into it keeping its aspect ratio, zero-padded to it, cut into ``tile``-sized tiles; the whole
  image resized to one tile goes first. ``pixel_values`` is [images, max tiles, 3, tile, tile] (images
  with fewer tiles are zero-padded, as the processor's ``do_pad``), ``image_sizes`` [images, 2] (h, w).
- token layout: the base tile's features, then the tiles' feature map stitched into one
  [rows x cols] grid, the padding rows/columns removed ("unpadding"), for OneVision (``max_tiles``,
  from ``anyres_max_9``) bilinearly downscaled when it is more than 1.1x larger than that many tiles, and
  ``image_newline`` after every row.

The vision graph runs the tower and projector on every tile and gathers its output tokens from them:
``image_feature_index`` [image tokens, 4] names, for each output token, four rows of the table
[all tiles' features..., image_newline] and ``image_feature_weight`` [image tokens, 4] the bilinear
weights (w0, w1 along the row, h0, h1 across rows: out = (x00*w0 + x01*w1)*h0 + (x10*w0 + x11*w1)*h1,
torch's order); a token that is not interpolated has four equal indices and weights (1, 0, 1, 0), which
gives the feature exactly. Both are computed here from ``image_sizes`` (:func:`graph_feeds`), so one graph
serves any image size and the count rule lives in one place (:func:`tokens_for_size`, also used by plan).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from vlmc.errors import VlmcError
from vlmc.runtime import imaging

logger = logging.getLogger(__name__)


def select_best_resolution(height: int, width: int, pinpoints: list) -> tuple[int, int]:
    """The (h, w) pinpoint that keeps the most of the image, then wastes the least (transformers' rule)."""
    best, best_eff, best_waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        dw, dh = int(width * scale), int(height * scale)
        eff = min(dw * dh, width * height)
        waste = w * h - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (int(h), int(w)), eff, waste
    return best


def _fit(height: int, width: int, th: int, tw: int) -> tuple[int, int]:
    # get_patch_output_size: scale to the pinpoint by the tighter side, the other side rounded up.
    sw, sh = tw / width, th / height
    if sw < sh:
        return min(math.ceil(height * sw), th), tw
    return th, min(math.ceil(width * sh), tw)


def _unpadded(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """(first row, rows, first col, cols) of the feature grid that the image covers (unpad_image)."""
    if width / height > cols / rows:
        new_h = int(round(height * (cols / width), 7))
        pad = (rows - new_h) // 2
        return pad, rows - 2 * pad, 0, cols
    new_w = int(round(width * (rows / height), 7))
    pad = (cols - new_w) // 2
    return 0, rows, pad, cols - 2 * pad


def _grid(height: int, width: int, facts: dict) -> tuple[int, int, int, int, int, int]:
    """Tile grid (gh, gw), feature map unpadded (r0, h, c0, w) for one image."""
    bh, bw = select_best_resolution(height, width, facts["grid_pinpoints"])
    tile, side = int(facts["tile_size"]), int(facts["tile_tokens_side"])
    gh, gw = bh // tile, bw // tile
    r0, h, c0, w = _unpadded(height, width, gh * side, gw * side)
    return gh, gw, r0, h, c0, w


def _downscaled(h: int, w: int, facts: dict) -> tuple[int, int]:
    limit = facts.get("max_tiles")
    if not limit:
        return h, w
    side = int(facts["tile_tokens_side"])
    ratio = math.sqrt(h * w / (int(limit) * side**2))
    if ratio > 1.1:
        return int(h // ratio), int(w // ratio)
    return h, w


def tokens_for_size(height: int, width: int, facts: dict) -> int:
    """Image tokens of one image of this size: base tile + unpadded (maybe downscaled) grid + newlines."""
    _, _, _, h, _, w = _grid(height, width, facts)
    h, w = _downscaled(h, w, facts)
    return int(facts["tile_tokens"]) + h * w + h


def token_counts(vision: dict[str, np.ndarray], facts: dict) -> list[int]:
    return [tokens_for_size(int(h), int(w), facts) for h, w in vision["image_sizes"]]


# ---- preprocessing ---------------------------------------------------------------------------


def _resize(img: np.ndarray, height: int, width: int, resample: str) -> np.ndarray:
    if img.shape[0] == height and img.shape[1] == width:
        return img  # PIL returns a copy for a same-size resize
    return imaging.resize(img, height, width, resample)


def _normalize(img: np.ndarray, facts: dict) -> np.ndarray:
    x = img.astype(np.float32) * np.float32(facts.get("rescale_factor", 1 / 255))
    x = (x - np.array(facts["mean"], np.float32)) / np.array(facts["std"], np.float32)
    return x.transpose(2, 0, 1)


def _tile_to_size(img: np.ndarray, facts: dict) -> np.ndarray:
    """The processor's per-tile resize (to ``size``: exact h x w, or shortest edge) and center crop."""
    size = facts["size"]
    resample = facts.get("resample", "bicubic")
    if "shortest_edge" in size:
        s = int(size["shortest_edge"])
        h, w = img.shape[:2]
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(s * long / short)
        nh, nw = (new_long, s) if w <= h else (s, new_long)
        img = _resize(img, nh, nw, resample)
    else:
        img = _resize(img, int(size["height"]), int(size["width"]), resample)
    crop = facts.get("crop_size")
    if crop:
        ch, cw = int(crop["height"]), int(crop["width"])
        h, w = img.shape[:2]
        top, left = (h - ch) // 2, (w - cw) // 2
        if top < 0 or left < 0:
            raise VlmcError(f"anyres: tile {h}x{w} is smaller than the crop {ch}x{cw}")
        img = img[top : top + ch, left : left + cw]
    return img


def tiles(img: np.ndarray, facts: dict) -> np.ndarray:
    """One image -> [1 + rows*cols, 3, tile, tile] normalized tiles (base first), as the processor makes them."""
    height, width = img.shape[:2]
    th, tw = select_best_resolution(height, width, facts["grid_pinpoints"])
    nh, nw = _fit(height, width, th, tw)
    resample = facts.get("resample", "bicubic")
    resized = _resize(img, nh, nw, resample)
    py, ry = divmod(th - nh, 2)
    px, rx = divmod(tw - nw, 2)
    padded = np.pad(resized, ((py, py + ry), (px, px + rx), (0, 0)), mode="constant", constant_values=0)
    tile = int(facts["tile_size"])
    base_h, base_w = facts["base_size"]
    parts = [_resize(img, int(base_h), int(base_w), resample)]
    parts += [padded[i : i + tile, j : j + tile] for i in range(0, th, tile) for j in range(0, tw, tile)]
    return np.stack([_normalize(_tile_to_size(p, facts), facts) for p in parts])


def preprocess(images: list[np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    per = [tiles(img, facts) for img in images]
    most = max(len(p) for p in per)
    pixels = np.zeros((len(per), most, *per[0].shape[1:]), np.float32)
    for i, p in enumerate(per):
        pixels[i, : len(p)] = p
    sizes = np.array([img.shape[:2] for img in images], np.int64)
    return {"pixel_values": pixels, "image_sizes": sizes}


# ---- token layout ----------------------------------------------------------------------------


def _linear(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """torch's bilinear (align_corners=False) source indices and weights along one axis, in float32."""
    scale = np.float32(n_in) / np.float32(n_out)
    d = np.arange(n_out, dtype=np.float32)
    src = scale * (d + np.float32(0.5)) - np.float32(0.5)
    src = np.where(src < 0, np.float32(0), src).astype(np.float32)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.where(i0 < n_in - 1, i0 + 1, i0)
    l1 = np.clip(src - i0.astype(np.float32), 0, 1).astype(np.float32)
    l0 = (np.float32(1) - l1).astype(np.float32)
    return i0, i1, l0, l1


def image_layout(height: int, width: int, first_row: int, facts: dict, newline: int):
    """Index and weight rows [tokens, 4] of one image whose tiles start at table row ``first_row``."""
    per_tile, side = int(facts["tile_tokens"]), int(facts["tile_tokens_side"])
    gh, gw, r0, h, c0, w = _grid(height, width, facts)
    oh, ow = _downscaled(h, w, facts)

    def row_of(y, x):  # table row of feature-map position (y, x) of the stitched grid
        return first_row + (1 + (y // side) * gw + x // side) * per_tile + (y % side) * side + (x % side)

    base = first_row + np.arange(per_tile, dtype=np.int64)
    idx = [np.repeat(base[:, None], 4, axis=1)]
    wts = [np.tile(np.array([1, 0, 1, 0], np.float32), (per_tile, 1))]
    if (oh, ow) == (h, w):
        ys = np.arange(h)[:, None] + r0
        xs = np.arange(w)[None, :] + c0
        grid = row_of(ys, xs)  # [h, w]
        rows = np.concatenate([grid, np.full((h, 1), newline)], axis=1).reshape(-1)
        idx.append(np.repeat(rows[:, None], 4, axis=1))
        wts.append(np.tile(np.array([1, 0, 1, 0], np.float32), (len(rows), 1)))
    else:
        y0, y1, hl0, hl1 = _linear(h, oh)
        x0, x1, wl0, wl1 = _linear(w, ow)
        Y0, Y1 = (y0 + r0)[:, None], (y1 + r0)[:, None]
        X0, X1 = (x0 + c0)[None, :], (x1 + c0)[None, :]
        quad = np.stack(
            np.broadcast_arrays(row_of(Y0, X0), row_of(Y0, X1), row_of(Y1, X0), row_of(Y1, X1)), axis=-1
        )  # [oh, ow, 4]
        weight = np.stack(
            np.broadcast_arrays(wl0[None, :], wl1[None, :], hl0[:, None], hl1[:, None]), axis=-1
        ).astype(np.float32)
        nl_idx = np.full((oh, 1, 4), newline, np.int64)
        nl_w = np.tile(np.array([1, 0, 1, 0], np.float32), (oh, 1, 1))
        idx.append(np.concatenate([quad, nl_idx], axis=1).reshape(-1, 4))
        wts.append(np.concatenate([weight, nl_w], axis=1).reshape(-1, 4))
    return np.concatenate(idx).astype(np.int64), np.concatenate(wts).astype(np.float32)


def graph_feeds(vision: dict[str, np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    """image_feature_index / image_feature_weight for the vision graph, from pixel_values' shape and image_sizes."""
    n, most = vision["pixel_values"].shape[:2]
    per_tile = int(facts["tile_tokens"])
    newline = n * most * per_tile  # the table's last row
    idx, wts = [], []
    for i, (h, w) in enumerate(vision["image_sizes"]):
        a, b = image_layout(int(h), int(w), i * most * per_tile, facts, newline)
        idx.append(a)
        wts.append(b)
    return {"image_feature_index": np.concatenate(idx), "image_feature_weight": np.concatenate(wts)}


# ---- resolution gears (a compile output's fixed tile and image-token counts) ---------------------
def tile_counts(facts: dict) -> list[int]:
    """Every tile count of one image (the base tile included): one per grid pinpoint."""
    tile = int(facts["tile_size"])
    return sorted({1 + (int(h) // tile) * (int(w) // tile) for h, w in facts["grid_pinpoints"]})


def most_tokens(facts: dict) -> int:
    """The most image tokens one image can give (an upper bound): over every pinpoint's feature grid and
    every unpadded part of it (full rows or full columns, :func:`_unpadded`).

    Not only the full grid: OneVision's downscale keeps ~``max_tiles`` tiles of features but one newline
    per row, so a narrow unpadded part left un-downscaled can give more tokens than the full grid.
    """
    tile, side, base = int(facts["tile_size"]), int(facts["tile_tokens_side"]), int(facts["tile_tokens"])
    most = 0
    for ph, pw in facts["grid_pinpoints"]:
        rows, cols = int(ph) // tile * side, int(pw) // tile * side
        for h, w in [(rows, c) for c in range(1, cols + 1)] + [(r, cols) for r in range(1, rows + 1)]:
            oh, ow = _downscaled(h, w, facts)
            most = max(most, base + oh * ow + oh)
    return most


def default_tile_gears(facts: dict, vision: dict | None = None) -> list[int]:
    counts = tile_counts(facts)
    return imaging.power_buckets(counts[0], counts[-1])


def default_token_gears(facts: dict, vision: dict | None = None) -> list[int]:
    """Image tokens per image: powers of two from the base tile's tokens up to the most, and the most."""
    return imaging.power_buckets(int(facts["tile_tokens"]) + 1, most_tokens(facts))[1:] or [
        most_tokens(facts)
    ]


def check_tile_gears(facts: dict, values: list[int], vision: dict | None = None) -> str | None:
    most = tile_counts(facts)[-1]
    if max(values) < most:
        return f"the largest tile gear {max(values)} is below the {most} tiles an image can become"
    return None


def check_token_gears(facts: dict, values: list[int], vision: dict | None = None) -> str | None:
    most = most_tokens(facts)
    if max(values) < most:
        return f"the largest image-token gear {max(values)} is below the {most} tokens an image can give"
    return None


def pad_to_gear(vision: dict[str, np.ndarray], values: list[int]) -> tuple[dict[str, np.ndarray], str | None]:
    """``pixel_values`` [images, tiles, ...] zero-padded along tiles to the smallest gear that holds them.

    Exact: the processor pads a batch's images the same way (``do_pad``), and the feature index
    (:func:`graph_feeds`, computed after this) never names a padding tile's rows.
    """
    pixels = vision["pixel_values"]
    most = pixels.shape[1]
    fits = [v for v in sorted(values) if v >= most]
    if not fits:
        raise VlmcError(f"an image has {most} tiles, more than every tile gear {sorted(values)}")
    if fits[0] == most:
        return vision, None
    pad = np.zeros((pixels.shape[0], fits[0] - most, *pixels.shape[2:]), pixels.dtype)
    note = f"tiles padded from {most} to the gear {fits[0]} with zero tiles (never indexed: tokens unchanged)"
    return {**vision, "pixel_values": np.concatenate([pixels, pad], axis=1)}, note
