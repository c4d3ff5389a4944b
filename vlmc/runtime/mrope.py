"""3-D M-RoPE position ids (temporal, height, width) for prompts with images, as Qwen2-VL's get_rope_index.

Text tokens advance all three axes together; an image's placeholder run gets (t, row, column) of its merged
grid offset by the running position, and the running position then jumps by the larger grid side. Decode
steps continue at max + 1 (``positions.next_positions``), which is transformers' rope-delta continuation.
What is read from the manifest: ``vision.image_token_id`` and ``vision.spatial_merge_size``.
"""

from __future__ import annotations

import logging

import numpy as np

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


def image_positions(start: int, grid: np.ndarray, merge: int) -> np.ndarray:
    """[3, t*h*w/merge^2] positions of one image's tokens, starting at ``start``."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


def positions_mrope(input_ids: np.ndarray, attention_mask: np.ndarray, ctx: dict) -> np.ndarray:
    """[3, batch, seq] int64; left padding gets 1 on every axis (masked out, as in the 1-D kind).

    Images are taken in order across the batch (prompt 0's images first), as the grids are laid out. Each
    image owns the next ``t*h*w/merge^2`` placeholder tokens, so two adjacent images are told apart too.
    """
    v = ctx["manifest"]["vision"]
    image_id = int(v["image_token_id"])
    merge = int(v.get("spatial_merge_size", 1))
    grids = ctx.get("vision", {}).get("image_grid_thw")
    grids = np.zeros((0, 3), np.int64) if grids is None else np.asarray(grids)
    # A pruned package keeps k tokens per image (vision.pruning): they keep their original (t, h, w)
    # positions, picked by the indices the vision graph outputs; text after the image continues
    # where it would without pruning.
    # A merged graph that returns its positions (graph entry ``positions_output``) adds the kept tokens'
    # offsets itself: it is given every kept token at its image's start.
    pruned = v.get("pruning")
    kept = None
    at_start = False
    if pruned:
        kept = (ctx.get("image_outputs") or {}).get(pruned.get("indices_output", "image_token_indices"))
        at_start = kept is None and _offsets_in_graph(ctx["manifest"])
        if kept is None and not at_start:
            raise VlmcError(
                "a pruned M-RoPE package needs the vision graph's kept token indices for positions, "
                "and the image chain did not provide them"
            )
        if kept is not None:
            kept = np.asarray(kept).reshape(-1, int(pruned["keep"]))
    batch, seq = input_ids.shape
    out = np.ones((3, batch, seq), np.int64)
    k = 0
    for b in range(batch):
        cols = np.flatnonzero(attention_mask[b] != 0)
        ids = input_ids[b, cols]
        pos = np.empty((3, len(ids)), np.int64)
        cur, i = 0, 0
        while i < len(ids):
            if ids[i] != image_id:
                pos[:, i] = cur
                cur += 1
                i += 1
                continue
            if k >= len(grids):
                raise VlmcError(
                    f"prompt {b} has more image placeholder runs than the {len(grids)} image grid(s)"
                )
            grid = grids[k]
            full = image_positions(cur, grid, merge)
            if kept is not None:
                full = full[:, kept[k]]
            elif at_start:
                full = np.full((3, int(pruned["keep"])), cur, np.int64)
            n = full.shape[1]
            if not np.all(ids[i : i + n] == image_id):
                raise VlmcError(f"prompt {b}: image {k} needs {n} placeholder tokens in a row")
            pos[:, i : i + n] = full
            cur += max(int(grid[1]), int(grid[2])) // merge
            i += n
            k += 1
        out[:, b, cols] = pos
    if k != len(grids):
        raise VlmcError(f"{len(grids)} image grid(s) but {k} image placeholder run(s) in the prompts")
    return out


def _offsets_in_graph(manifest: dict) -> bool:
    """True if the package's merged graph places the kept image tokens itself (it returns its positions)."""
    merged = manifest.get("pipeline", {}).get("vlm")
    return bool(merged and manifest["graphs"].get(merged, {}).get("positions_output"))
