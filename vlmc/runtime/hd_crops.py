"""HD crops (kind ``hd_crops``): Phi-3-vision's image processing and token layout, without torch.

Written from the published processor of microsoft/Phi-3-vision-128k-instruct (``image_processing_phi3_v.py``:
``HD_transform``, ``padding_336``, ``Phi3VImageProcessor.preprocess``; mirrored on GitHub, e.g. in
g1y5x3/vlm-study) and the model's ``image_embedding_phi3_v.py`` (``hd_feature_transform``,
``reshape_hd_patches_2x2merge``, ``add_image_newline``):

- preprocessing: the image (transposed when it is taller than wide) is resized with PIL's bilinear filter
  (torchvision's ``resize`` on a PIL image) to ``scale`` crops wide, the largest scale whose crop grid
  (``scale`` x ``ceil(scale / ratio)``) is at most ``num_crops``, its height following the aspect ratio;
  padded with white top and bottom to a multiple of the crop size; transposed back; ``ToTensor`` (/255) and
  ``Normalize``. The global image is that tensor resized to one crop with torch's bicubic
  (``interpolate(..., mode="bicubic")``, align_corners False, no antialias), reimplemented here in float32
  with torch's weights and summation order (:func:`torch_bicubic`). ``pixel_values`` is [images,
  num_crops + 1, 3, S, S]: the global image, the crops row by row, zero crops up to ``num_crops + 1``;
  ``image_sizes`` [images, 2] is the padded HD image's (h, w).
- token layout (:func:`image_layout`): each crop's 24 x 24 patch features merged 2 x 2 into 12 x 12 tokens
  of 4x the width; the crops' tokens laid out as one (rows x 12) x (cols x 12) grid with ``sub_GN`` after
  every grid row, then ``glb_GN``, then the global image's 12 x 12 tokens, ``sub_GN`` after each row:
  ``(rows * cols + 1) * 144 + 1 + (rows + 1) * 12`` tokens per image (the processor's ``num_img_tokens``).

The vision graph runs the tower on the crops the batch uses (the processor's zero crops past the largest grid
are dropped) and gathers its output tokens from the table [every crop's merged tokens..., sub_GN, glb_GN] with
``image_feature_index`` [image tokens], computed here from ``image_sizes`` (:func:`graph_feeds`), so one graph
serves every image size.
"""

from __future__ import annotations

import logging

import numpy as np

from vlmc.errors import VlmcError
from vlmc.runtime import imaging

logger = logging.getLogger(__name__)


def hd_size(height: int, width: int, facts: dict) -> tuple[int, int]:
    """The (h, w) of the padded HD image (the processor's ``calc_hd_transform_size``)."""
    side, num_crops = int(facts["crop_size"]), int(facts["num_crops"])
    transposed = width < height
    if transposed:
        width, height = height, width
    new_w, new_h = _scaled(width, height, side, num_crops)
    padded_h = int(np.ceil(new_h / side) * side)
    return (new_w, padded_h) if transposed else (padded_h, new_w)


def _scaled(width: int, height: int, side: int, num_crops: int) -> tuple[int, int]:
    ratio = width / height
    scale = 1
    while scale * np.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_w = int(scale * side)
    return new_w, int(new_w / ratio)


def grid(height: int, width: int, facts: dict) -> tuple[int, int]:
    """(rows, cols) of crops of an image of this size."""
    h, w = hd_size(height, width, facts)
    side = int(facts["crop_size"])
    return h // side, w // side


def tokens_for_grid(rows: int, cols: int, facts: dict) -> int:
    s = int(facts["crop_tokens_side"])
    return (rows * cols + 1) * s * s + 1 + (rows + 1) * s


def tokens_for_size(height: int, width: int, facts: dict) -> int:
    """Image tokens of one image of this size (``calc_num_image_tokens_from_image_size``)."""
    return tokens_for_grid(*grid(height, width, facts), facts)


def token_counts(vision: dict[str, np.ndarray], facts: dict) -> list[int]:
    side = int(facts["crop_size"])
    return [tokens_for_grid(int(h) // side, int(w) // side, facts) for h, w in vision["image_sizes"]]


# ---- preprocessing ---------------------------------------------------------------------------


def hd_transform(img: np.ndarray, facts: dict) -> np.ndarray:
    """One uint8 HWC image -> the padded HD image (uint8 HWC), as ``HD_transform`` makes it with PIL."""
    side, num_crops = int(facts["crop_size"]), int(facts["num_crops"])
    transposed = img.shape[1] < img.shape[0]
    if transposed:  # PIL's Image.TRANSPOSE swaps the axes
        img = np.ascontiguousarray(img.transpose(1, 0, 2))
    height, width = img.shape[:2]
    new_w, new_h = _scaled(width, height, side, num_crops)
    if new_h < 1:
        raise VlmcError(
            f"an image of {width}x{height} is too elongated for {num_crops} crops (its HD height is 0)"
        )
    if (new_h, new_w) != (height, width):
        img = imaging.resize(img, new_h, new_w, facts.get("resample", "bilinear"))
    target = int(np.ceil(new_h / side) * side)
    top = int((target - new_h) / 2)
    img = np.pad(img, ((top, target - new_h - top), (0, 0), (0, 0)), mode="constant", constant_values=255)
    return np.ascontiguousarray(img.transpose(1, 0, 2)) if transposed else img


def _normalize(img: np.ndarray, facts: dict) -> np.ndarray:
    # ToTensor divides by 255 (a division, not a multiply by 1/255: the last bit differs), Normalize subtracts
    # the mean and divides by the std, all in float32.
    x = img.astype(np.float32).transpose(2, 0, 1) / np.float32(255)
    mean = np.array(facts["mean"], np.float32)[:, None, None]
    std = np.array(facts["std"], np.float32)[:, None, None]
    return (x - mean) / std


def _fma(a, b, c) -> np.ndarray:
    """float32 ``a * b + c`` rounded once (a fused multiply-add), through float64: the product of two float32
    values is exact there, so only the sum is rounded twice (64 then 32 bits), which differs from one rounding
    only on exact float64 ties."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(
        np.float32
    )


def _cubic_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's bicubic source indices [out, 4] (clamped to the edge) and weights [out, 4] (A = -0.75), float32.

    As aten's ``upsample_bicubic2d`` CPU kernel computes them (``area_pixel_compute_source_index``,
    ``get_cubic_upsample_coefficients`` in ATen/native/UpSample.h), with the multiply-adds its x86 build
    fuses (measured bit for bit against torch 2.13's AVX512 kernel, tests/unit/runtime/test_hd_crops.py):
    the scale in_size / out_size in float32; the source coordinate fma(scale, i + 0.5, -0.5), not clamped
    for cubic; its floor and fraction t; cubic_convolution1(x) = ((A + 2) x - (A + 3)) x x + 1 for t and
    1 - t; cubic_convolution2(x) = ((A x - 5A) x + 8A) x - 4A for t + 1 and (1 - t) + 1, its first two
    steps fused.
    """
    f = np.float32
    a = f(-0.75)
    scale = f(in_size) / f(out_size)
    real = _fma(scale, np.arange(out_size, dtype=f) + f(0.5), f(-0.5))
    base = np.floor(real)
    t = (real - base).astype(f)

    def conv1(x):
        return ((a + f(2)) * x - (a + f(3))) * x * x + f(1)

    def conv2(x):
        return _fma(_fma(a, x, -(f(5) * a)), x, f(8) * a) * x - f(4) * a

    x2 = (f(1) - t).astype(f)
    weights = np.stack(
        [conv2((t + f(1)).astype(f)), conv1(t), conv1(x2), conv2((x2 + f(1)).astype(f))], axis=1
    )
    first = base.astype(np.int64) - 1
    index = np.clip(first[:, None] + np.arange(4)[None, :], 0, in_size - 1)
    return index, weights.astype(f)


def _taps(values: list, weights: list) -> np.ndarray:
    # x0*w0 + x1*w1 + x2*w2 + x3*w3 as the compiled kernel evaluates it: fma(x3, w3, fma(x2, w2, fma(x0, w0,
    # x1*w1)))
    out = _fma(values[0], weights[0], values[1] * weights[1])
    return _fma(values[3], weights[3], _fma(values[2], weights[2], out))


def torch_bicubic(x: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """``torch.nn.functional.interpolate(x[None], (out_h, out_w), mode="bicubic")[0]`` for x [C, H, W] float32.

    aten's CPU kernel interpolates each of the four source rows along the width, then those four values
    along the height, both with :func:`_taps`; torch is not needed (the runtime runs without it), and the
    result is torch's float32 bits.
    """
    x = np.asarray(x, np.float32)
    yi, yw = _cubic_weights(x.shape[1], out_h)
    xi, xw = _cubic_weights(x.shape[2], out_w)
    rows = []
    for j in range(4):
        src = x[:, yi[:, j]]  # [C, out_h, W]
        rows.append(_taps([src[:, :, xi[:, k]] for k in range(4)], [xw[:, k] for k in range(4)]))
    return _taps(rows, [yw[:, j][None, :, None] for j in range(4)])


def crops(img: np.ndarray, facts: dict) -> np.ndarray:
    """One uint8 HWC image -> [1 + rows*cols, 3, S, S] normalized crops (global first), as the processor."""
    side = int(facts["crop_size"])
    hd = _normalize(hd_transform(img, facts), facts)
    _, h, w = hd.shape
    glob = torch_bicubic(hd, side, side)
    tiles = (
        hd.reshape(3, h // side, side, w // side, side).transpose(1, 3, 0, 2, 4).reshape(-1, 3, side, side)
    )
    return np.concatenate([glob[None], tiles])


def preprocess(images: list[np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    side, most = int(facts["crop_size"]), int(facts["num_crops"]) + 1
    pixels = np.zeros((len(images), most, 3, side, side), np.float32)
    sizes = np.zeros((len(images), 2), np.int64)
    for i, img in enumerate(images):
        per = crops(img, facts)
        pixels[i, : len(per)] = per
        sizes[i] = hd_size(img.shape[0], img.shape[1], facts)
    return {"pixel_values": pixels, "image_sizes": sizes}


# ---- token layout ----------------------------------------------------------------------------


def image_layout(rows: int, cols: int, first: int, facts: dict, sub: int, glb: int) -> np.ndarray:
    """Table rows [tokens] of one image whose crops (global first) start at table row ``first``."""
    s = int(facts["crop_tokens_side"])
    per = s * s
    ys = np.arange(rows * s)[:, None]
    xs = np.arange(cols * s)[None, :]
    crop = 1 + (ys // s) * cols + xs // s
    grid_rows = first + crop * per + (ys % s) * s + xs % s  # [rows*s, cols*s]
    local = np.concatenate([grid_rows, np.full((rows * s, 1), sub)], axis=1).reshape(-1)
    g = first + np.arange(per).reshape(s, s)
    glob = np.concatenate([g, np.full((s, 1), sub)], axis=1).reshape(-1)
    return np.concatenate([local, [glb], glob]).astype(np.int64)


def graph_feeds(vision: dict[str, np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    """The vision graph's inputs from the processor's: ``pixel_values`` without the zero crops no image of the
    batch uses (the processor pads every image to num_crops + 1; the features of those crops are never read, so
    the graph runs only the crops the batch's largest grid needs), and ``image_feature_index`` into that table."""
    side, per = int(facts["crop_size"]), int(facts["crop_tokens_side"]) ** 2
    pixels = vision["pixel_values"]
    grids = [(int(h) // side, int(w) // side) for h, w in vision["image_sizes"]]
    most = max(1 + r * c for r, c in grids)
    if most > pixels.shape[1]:
        raise VlmcError(
            f"an image has {most - 1} crops, more than pixel_values holds ({pixels.shape[1] - 1})"
        )
    most = _crop_gear(most, facts)
    n = pixels.shape[0]
    sub = n * most * per  # the table's last two rows: sub_GN, glb_GN
    index = [image_layout(r, c, i * most * per, facts, sub, sub + 1) for i, (r, c) in enumerate(grids)]
    return {
        "pixel_values": np.ascontiguousarray(pixels[:, :most]),
        "image_feature_index": np.concatenate(index),
    }


def most_tokens(facts: dict) -> int:
    """The most image tokens one image can give: over every crop grid of at most ``num_crops`` crops."""
    n = int(facts["num_crops"])
    return max(tokens_for_grid(r, c, facts) for r in range(1, n + 1) for c in range(1, n // r + 1))


def size_count(vision: dict, height: int | None, width: int | None) -> tuple[int, int, str]:
    """(image tokens, vision-graph crops, how counted) for one image of this size (vlmc plan); without a size,
    the most any image gives."""
    facts = vision["preprocess"]
    if height is None or width is None:
        n = int(facts["num_crops"])
        return (
            most_tokens(facts),
            n + 1,
            f"at most {most_tokens(facts)} tokens ({n} crops; give an image size)",
        )
    rows, cols = grid(height, width, facts)
    tokens = tokens_for_grid(rows, cols, facts)
    return (
        tokens,
        1 + rows * cols,
        f"{height}x{width}: {rows}x{cols} crops + the global image, {tokens} tokens",
    )


# ---- resolution gears (a compile output's fixed crop and image-token counts) ----------------------
def _grids(facts: dict) -> list[tuple[int, int]]:
    """Every crop grid (rows, cols) an image can get: at most ``num_crops`` crops."""
    n = int(facts["num_crops"])
    return [(r, c) for r in range(1, n + 1) for c in range(1, n // r + 1)]


def _crop_gear(most: int, facts: dict) -> int:
    """The crops the vision graph runs for a batch whose largest image uses ``most`` (the global one included):
    that count in a package, the smallest compiled gear holding it in a build (``vision.preprocess.gears``).
    The crops past an image's grid are the processor's zero crops, whose features are never indexed."""
    gears = (facts.get("gears") or {}).get("crops")
    if not gears:
        return most
    fits = [v for v in sorted(gears) if v >= most]
    if not fits:
        raise VlmcError(f"an image uses {most} crops, more than every crop gear {sorted(gears)}")
    return fits[0]


def default_crop_gears(facts: dict, vision: dict | None = None) -> list[int]:
    """Crops per image (the global image included): powers of two from the fewest to ``num_crops`` + 1."""
    counts = sorted({1 + r * c for r, c in _grids(facts)})
    return imaging.power_buckets(counts[0], int(facts["num_crops"]) + 1)


def check_crop_gears(facts: dict, values: list[int], vision: dict | None = None) -> str | None:
    most = int(facts["num_crops"]) + 1
    if max(values) != most:
        return f"the largest crop gear must be {most} (num_crops + 1, what the processor pads every image to)"
    return None


def default_token_gears(facts: dict, vision: dict | None = None) -> list[int]:
    """Image tokens per image: powers of two from the fewest an image gives to the most, and the most."""
    counts = sorted(tokens_for_grid(r, c, facts) for r, c in _grids(facts))
    return imaging.power_buckets(counts[0], counts[-1])


def check_token_gears(facts: dict, values: list[int], vision: dict | None = None) -> str | None:
    most = most_tokens(facts)
    if max(values) < most:
        return f"the largest image-token gear {max(values)} is below the {most} tokens an image can give"
    return None
