"""Image loading and preprocessing, chosen by the manifest's ``vision.preprocess.kind``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vlmc.errors import VlmcError
from vlmc.runtime import anyres, imaging, patches, tiles

logger = logging.getLogger(__name__)

DEMO_IMAGE = "demo"


def demo_image(size: int = 96, seed: int = 0) -> np.ndarray:
    """A deterministic synthetic RGB image (uint8 HWC): gradients plus a few solid shapes."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    img = np.stack([x * 255 / size, y * 255 / size, (x + y) * 127 / size], axis=-1)
    for _ in range(3):
        cx, cy, r = rng.integers(size // 8, size - size // 8, 2).tolist() + [
            int(rng.integers(size // 10, size // 4))
        ]
        img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.integers(0, 256, 3)
    return img.astype(np.uint8)


def load_image(ref) -> np.ndarray:
    """An image as uint8 HWC RGB from a path, encoded bytes, a numpy array, or the name 'demo' / 'demo:SEED'."""
    if isinstance(ref, np.ndarray):
        return ref
    if isinstance(ref, (bytes, bytearray)):
        import io

        return _decode(io.BytesIO(ref), "the image data")
    ref = str(ref)
    if ref == DEMO_IMAGE or ref.startswith(DEMO_IMAGE + ":"):
        seed = int(ref.split(":", 1)[1]) if ":" in ref else 0
        return demo_image(seed=seed)
    path = Path(ref)
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise VlmcError(f"image {ref} {what}; pass an image file (PNG, JPEG, ...) or 'demo'")
    return _decode(path, f"image {ref}")


def _decode(source, what: str) -> np.ndarray:
    try:
        from PIL import Image, UnidentifiedImageError
    except ModuleNotFoundError as exc:
        raise VlmcError("reading image files needs pillow: pip install pillow") from exc
    from vlmc import limits

    # PIL's decompression-bomb guard at vlmc's bound (it raises past twice MAX_IMAGE_PIXELS; the size
    # check below refuses anything past the bound itself, from the header, before decoding).
    Image.MAX_IMAGE_PIXELS = limits.MAX_IMAGE_PIXELS
    try:
        with Image.open(source) as im:
            w, h = im.size
            if w * h > limits.MAX_IMAGE_PIXELS:
                raise VlmcError(
                    f"{what} is {w}x{h} = {w * h} pixels, above the {limits.MAX_IMAGE_PIXELS}-pixel "
                    "limit (raise it with VLMC_MAX_IMAGE_PIXELS); it was not decoded"
                )
            return np.asarray(im.convert("RGB"))
    except Image.DecompressionBombError as exc:
        raise VlmcError(
            f"{what} is refused as a decompression bomb ({exc}); raise VLMC_MAX_IMAGE_PIXELS if you trust it"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise VlmcError(
            f"{what} is not a readable image ({type(exc).__name__}); pass a PNG or JPEG file"
        ) from exc


def clip(images: list[np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    """CLIP-style: resize the shortest edge, center-crop, rescale, normalize -> pixel_values NCHW."""
    out = []
    ch, cw = facts["crop_size"]
    for img in images:
        h, w = img.shape[:2]
        short = facts["resize_shortest_edge"]
        scale = short / min(h, w)
        nh, nw = max(ch, round(h * scale)), max(cw, round(w * scale))
        img = imaging.resize(img, nh, nw, facts.get("resample", "bicubic"))
        top, left = (nh - ch) // 2, (nw - cw) // 2
        img = img[top : top + ch, left : left + cw]
        x = img.astype(np.float32) * np.float32(facts.get("rescale_factor", 1 / 255))
        x = (x - np.array(facts["mean"], np.float32)) / np.array(facts["std"], np.float32)
        out.append(x.transpose(2, 0, 1))
    return {"pixel_values": np.stack(out).astype(np.float32)}


def resize(images: list[np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    """BLIP-style: resize straight to ``size`` [h, w] (aspect not kept, no crop), rescale, normalize -> NCHW."""
    h, w = facts["size"]
    mean, std = np.array(facts["mean"], np.float32), np.array(facts["std"], np.float32)
    out = []
    for img in images:
        x = imaging.resize(img, h, w, facts.get("resample", "bicubic")).astype(np.float32)
        x = (x * np.float32(facts.get("rescale_factor", 1 / 255)) - mean) / std
        out.append(x.transpose(2, 0, 1))
    return {"pixel_values": np.stack(out).astype(np.float32)}


# kind -> function(images, facts) -> (vision graph inputs); family modules may add kinds.
KINDS: dict[str, Callable[[list[np.ndarray], dict], dict[str, np.ndarray]]] = {
    "clip": clip,
    "resize": resize,
    "packed_patches": patches.packed_patches,
    "tiles": tiles.tiles,
    "anyres": anyres.preprocess,
}
# A preprocessing output that is not a graph input: per-image tile counts (kind "tiles").
TILES_KEY = tiles.TILES_KEY


# kind -> function(vision inputs, facts) -> image tokens per image, for kinds whose count depends on the
# image (anyres); other kinds use vision.tokens_per_image or the image grid.
COUNTS: dict[str, Callable[[dict[str, np.ndarray], dict], list[int]]] = {"anyres": anyres.token_counts}
# kind -> function(vision inputs, facts) -> extra vision graph inputs derived from the processor's outputs
# (fed to the graphs, never compared with the processor).
FEEDS: dict[str, Callable[[dict[str, np.ndarray], dict], dict[str, np.ndarray]]] = {
    "anyres": anyres.graph_feeds
}


# kind -> function(vision manifest facts, height, width) -> (image tokens, vision-graph rows, how counted):
# the count for an image of a given size without the image (vlmc plan); for kinds whose count depends on it.
SIZE_COUNTS: dict[str, Callable[[dict, int | None, int | None], tuple[int, int, str]]] = {
    "tiles": tiles.tokens_for_size
}


def token_counts(vision: dict[str, np.ndarray], facts: dict) -> list[int] | None:
    """Image tokens per image by the preprocessing kind's own rule, or None when the kind has none."""
    fn = COUNTS.get(facts.get("kind"))
    return None if fn is None else fn(vision, facts)


def graph_feeds(vision: dict[str, np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    fn = FEEDS.get(facts.get("kind"))
    return {} if fn is None or not vision else fn(vision, facts)


def preprocess(images: list, facts: dict) -> dict[str, np.ndarray]:
    """Load and preprocess images as the manifest's ``vision.preprocess`` facts say -> vision graph inputs."""
    kind = facts.get("kind")
    if kind not in KINDS:
        raise VlmcError(
            f"unknown preprocessing kind {kind!r} (vision.preprocess.kind); known kinds: "
            f"{', '.join(KINDS)}; upgrade vlmc, or re-export the package with this one"
        )
    return KINDS[kind]([load_image(i) for i in images], facts)
