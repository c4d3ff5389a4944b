"""Image loading and preprocessing, chosen by the manifest's ``vision.preprocess.kind``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlmc import limits
from vlmc.errors import VlmcError
from vlmc.runtime import anyres, hd_crops, imaging, patches, tiles

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
    "hd_crops": hd_crops.preprocess,
}
# A preprocessing output that is not a graph input: per-image tile counts (kind "tiles").
TILES_KEY = tiles.TILES_KEY


# kind -> function(vision inputs, facts) -> image tokens per image, for kinds whose count depends on the
# image (anyres); other kinds use vision.tokens_per_image or the image grid.
COUNTS: dict[str, Callable[[dict[str, np.ndarray], dict], list[int]]] = {
    "anyres": anyres.token_counts,
    "hd_crops": hd_crops.token_counts,
}
# kind -> function(vision inputs, facts) -> extra vision graph inputs derived from the processor's outputs
# (fed to the graphs, never compared with the processor).
FEEDS: dict[str, Callable[[dict[str, np.ndarray], dict], dict[str, np.ndarray]]] = {
    "anyres": anyres.graph_feeds,
    "hd_crops": hd_crops.graph_feeds,
}


# kind -> function(vision manifest facts, height, width) -> (image tokens, vision-graph rows, how counted):
# the count for an image of a given size without the image (vlmc plan); for kinds whose count depends on it.
SIZE_COUNTS: dict[str, Callable[[dict, int | None, int | None], tuple[int, int, str]]] = {
    "tiles": tiles.tokens_for_size,
    "hd_crops": hd_crops.size_count,
}


def token_counts(vision: dict[str, np.ndarray], facts: dict) -> list[int] | None:
    """Image tokens per image by the preprocessing kind's own rule, or None when the kind has none."""
    fn = COUNTS.get(facts.get("kind"))
    return None if fn is None else fn(vision, facts)


def graph_feeds(vision: dict[str, np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    fn = FEEDS.get(facts.get("kind"))
    return {} if fn is None or not vision else fn(vision, facts)


@dataclass(frozen=True)
class GearRule:
    """How a compile output's resolution gears size one vision-graph dim of a preprocessing kind.

    A build for an NPU takes a few shapes (gears), so an image must reach one of them. ``fit`` says how:
    ``resize`` (the image is resized to a compiled resolution before preprocessing, so its tokens change
    to the gear's, exactly), ``pad`` (the preprocessing pads up to the gear; tokens unchanged) or ``rows``
    (the build runner pads the dim with copies of its first row and drops their outputs; tokens
    unchanged). ``combine`` says what one request's dim is from its images' per-image gears: ``paired``
    (images × gear, exact: every image of the request takes the same gear), ``sum`` (images × gear,
    padded up) or ``max`` (the gear itself: a per-image axis).
    """

    symbol: str  # the graph dim
    option: str  # the target option that names the per-image values
    what: str  # what one value counts, for messages
    combine: str
    fit: str
    defaults: Callable[[dict, dict | None], list[int]]  # (preprocess facts, vision facts) -> per-image gears
    # (preprocess facts, values, vision facts) -> why the values cannot serve (None: they can)
    check: Callable[[dict, list[int], dict | None], str | None]
    effect: str  # the effect on the image tokens, for compile.json and docs
    # fit "resize": (uint8 images, facts, gears) -> (resized images, one note per image)
    resize: Callable[[list[np.ndarray], dict, list[int]], tuple[list[np.ndarray], list[str]]] | None = None
    # fit "pad": (vision inputs, gears) -> (padded inputs, a note or None)
    pad: Callable[[dict[str, np.ndarray], list[int]], tuple[dict[str, np.ndarray], str | None]] | None = None


# kind -> the gear rules of its vision graphs' image-sized dims (kinds of fixed size have none).
GEARS: dict[str, tuple[GearRule, ...]] = {
    "packed_patches": (
        GearRule(
            "patches",
            "patch_gears",
            "patches per image",
            "paired",
            "resize",
            patches.default_gears,
            patches.check_gears,
            "each image is resized to the grid of a compiled patch count nearest its own (least log-scale "
            "change of the two sides); its image tokens are that grid's (patches / merge_size²), exactly, and "
            "every image of a request takes the largest gear any of them needs",
            resize=patches.fit,
        ),
    ),
    "tiles": (
        GearRule(
            "images",
            "tile_gears",
            "tiles per image",
            "sum",
            "rows",
            tiles.default_gears,
            tiles.check_gears,
            "none: each image keeps the processor's tile grid; the vision build runs on the tile count padded "
            "up to the next gear with copies of the first tile, whose outputs are dropped (tiles are "
            "independent rows of the vision graph)",
        ),
    ),
    "anyres": (
        GearRule(
            "tiles",
            "tile_gears",
            "tiles per image",
            "max",
            "pad",
            anyres.default_tile_gears,
            anyres.check_tile_gears,
            "none: pixel_values is zero-padded along tiles to the next gear, as the processor pads a batch; "
            "the feature index never names a padding tile",
            pad=anyres.pad_to_gear,
        ),
        GearRule(
            "image_tokens",
            "image_token_gears",
            "image tokens per image",
            "sum",
            "rows",
            anyres.default_token_gears,
            anyres.check_token_gears,
            "none: the feature index and weights are padded up to the next gear with copies of their first "
            "row, and the extra output tokens are dropped (each token is its own gather)",
        ),
    ),
    "hd_crops": (
        GearRule(
            "crops",
            "crop_gears",
            "crops per image, the global image included",
            "max",
            "pad",
            hd_crops.default_crop_gears,
            hd_crops.check_crop_gears,
            "none: the vision graph runs the smallest crop gear holding the batch's largest grid; the crops "
            "past an image's grid are the processor's own zero crops, never indexed",
        ),
        GearRule(
            "image_tokens",
            "image_token_gears",
            "image tokens per image",
            "sum",
            "rows",
            hd_crops.default_token_gears,
            hd_crops.check_token_gears,
            "none: the feature index is padded up to the next gear with copies of its first row, and the "
            "extra output tokens are dropped (each token is its own gather)",
        ),
    ),
}
# kind -> dims a build runner must never pad by rows, though it pads them for other kinds: anyres' feature
# index names image_newline as the table's last row, after every image's tiles, and HD crops' names sub_GN
# and glb_GN there, so a padded image would move them (a request must then fill an images gear exactly).
UNPADDED: dict[str, tuple[str, ...]] = {"anyres": ("images",), "hd_crops": ("images",)}
GEAR_OPTIONS = tuple(dict.fromkeys(r.option for rules in GEARS.values() for r in rules))
# The key of a compile output's gears in its runtime manifest: vision.preprocess.gears {symbol: values}.
GEARS_KEY = "gears"


def _gear_values(facts: dict, rule: GearRule) -> list[int] | None:
    """The per-image gears a compile output wrote for ``rule`` (None in a package), checked."""
    table = facts.get(GEARS_KEY)
    if table is None or rule.symbol not in table:
        return None
    values = table[rule.symbol]
    if (
        not isinstance(values, list)
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
    ):
        raise VlmcError(f"vision.preprocess.gears.{rule.symbol} must list positive integers, got {values!r}")
    why = rule.check(facts, values, None)
    if why:
        raise VlmcError(f"vision.preprocess.gears.{rule.symbol}: {why}")
    return values


def fit_to_gears(images: list, facts: dict) -> tuple[list[np.ndarray], list[str]]:
    """The images (uint8 HWC) as a compile output with resolution gears takes them, and what changed.

    Only ``resize`` rules change an image (a package, which has no gears, gets its images back). The
    package run on the returned images sees exactly what the build sees (``vlmc run --against``).
    """
    images = [load_image(i) for i in images]
    notes: list[str] = []
    for rule in GEARS.get(facts.get("kind"), ()):
        values = _gear_values(facts, rule) if rule.resize is not None else None
        if values is not None and images:
            images, said = rule.resize(images, facts, values)
            notes += said
    return images, notes


def pad_to_gears(vision: dict[str, np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    """Vision inputs padded to a compile output's ``pad`` gears (anyres tiles); a package's are unchanged."""
    for rule in GEARS.get(facts.get("kind"), ()):
        values = _gear_values(facts, rule) if rule.pad is not None else None
        if values is not None and vision:
            vision, note = rule.pad(vision, values)
            if note:
                logger.info("%s", note)
    return vision


def preprocess(images: list, facts: dict) -> dict[str, np.ndarray]:
    """Load and preprocess images as the manifest's ``vision.preprocess`` facts say -> vision graph inputs.

    A compile output's runtime manifest may carry resolution gears (``vision.preprocess.gears``): the
    images are then first fitted to them (:func:`fit_to_gears`) and the inputs padded (:func:`pad_to_gears`).
    """
    kind = facts.get("kind")
    if kind not in KINDS:
        raise VlmcError(
            f"unknown preprocessing kind {kind!r} (vision.preprocess.kind); known kinds: "
            f"{', '.join(KINDS)}; upgrade vlmc, or re-export the package with this one"
        )
    fitted, notes = fit_to_gears(images, facts)
    for note in notes:
        logger.info("%s", note)
    return pad_to_gears(KINDS[kind](fitted, facts), facts)
