"""Position ids for prefill, chosen by the manifest's ``text.position``; decode continues at max + 1."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from vlmc.errors import VlmcError
from vlmc.runtime import mrope

logger = logging.getLogger(__name__)


def positions_1d(input_ids: np.ndarray, attention_mask: np.ndarray, ctx: dict) -> np.ndarray:
    """[batch, seq]: running count of real tokens (left padding gets 1, as transformers does)."""
    pos = np.cumsum(attention_mask, axis=-1) - 1
    return np.where(attention_mask == 0, 1, pos).astype(np.int64)


# name -> fn(input_ids, attention_mask, ctx) -> position_ids; ctx carries the manifest and image grids.
KINDS: dict[str, Callable[[np.ndarray, np.ndarray, dict], np.ndarray]] = {
    "1d": positions_1d,
    "mrope": mrope.positions_mrope,
}


def prefill(kind: str, input_ids: np.ndarray, attention_mask: np.ndarray, ctx: dict) -> np.ndarray:
    """Prefill position ids of the manifest's ``text.position`` kind.

    Raises:
        VlmcError: the kind is not one this runtime knows (a package from a newer vlmc).
    """
    if kind not in KINDS:
        raise VlmcError(
            f"unknown position kind {kind!r} (text.position); known kinds: {', '.join(KINDS)}; "
            "upgrade vlmc, or re-export the package with this one"
        )
    return KINDS[kind](input_ids, attention_mask, ctx)


def next_positions(position_ids: np.ndarray) -> np.ndarray:
    """Positions for one decode step: one past the largest position of each sequence.

    Works for 1-D [batch, seq] and multi-axis [axes, batch, seq] ids (M-RoPE's rope delta is
    exactly this continuation).
    """
    last = position_ids.max(axis=-1, keepdims=True)
    if position_ids.ndim == 3:
        last = last.max(axis=0, keepdims=True)
        return np.broadcast_to(last + 1, (position_ids.shape[0], position_ids.shape[1], 1)).astype(np.int64)
    return (last + 1).astype(np.int64)
