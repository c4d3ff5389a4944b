"""Image resizing shared by the preprocessing kinds (preprocess.py) and the patch layouts (patches.py), and their gear buckets."""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


def resample_filter(name: str) -> int:
    """PIL's filter for a manifest ``resample`` name (bicubic when unknown)."""
    from PIL import Image

    return {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR, "nearest": Image.NEAREST}.get(
        name, Image.BICUBIC
    )


def resize(img: np.ndarray, height: int, width: int, resample: str) -> np.ndarray:
    """An HWC uint8 image resized to ``height`` x ``width`` with PIL, as the HF image processors do."""
    from PIL import Image

    return np.asarray(Image.fromarray(img).resize((width, height), resample_filter(resample)))


def power_buckets(lo: int, hi: int) -> list[int]:
    """``lo``, the powers of two between ``lo`` and ``hi``, and ``hi``: resolution gears that pad by at most 2x."""
    out, p = {lo, hi}, 1
    while p < hi:
        if p > lo:
            out.add(p)
        p *= 2
    return sorted(out)
