"""Ascend target options: the typed schema a recipe's ``target`` is validated against, and cross-option checks."""

from __future__ import annotations

import logging

from vlmc import limits, pass_api
from vlmc.backends.ascend import atc, soc
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

NAME = "ascend"
DEFAULT_SEQUENCE_BUCKETS = [128, 256, 512, 1024, 2048]
PRECISIONS = ("auto", "fp16", "mixed_float16", "mixed_bfloat16", "origin")
QUANTIZED_PRECISIONS = ("int8", "int8_weight_only", "int4_weight_only")
# per-image resolution gears (vlmc.runtime.preprocess.GEARS names which apply to which preprocessing kind)
RESOLUTION_OPTIONS = ("patch_gears", "tile_gears", "crop_gears", "image_token_gears")

TARGET_OPTIONS = (
    pass_api.Option(
        "soc", str, soc.FAMILY_910B, "Ascend SoC: an exact --soc_version or the family Ascend910B"
    ),
    pass_api.Option(
        "soc_variant",
        str,
        None,
        "910B variant when soc is the family and npu-smi is absent (e.g. Ascend910B4)",
    ),
    pass_api.Option(
        "sequence_buckets",
        list,
        list(DEFAULT_SEQUENCE_BUCKETS),
        "prefill sequence-length gears",
        items=int,
        min=1,
        max=limits.MAX_POSITIONS,
        max_items=limits.MAX_GEARS,
    ),
    pass_api.Option(
        "past_buckets",
        list,
        None,
        "decode past-length gears (default: sequence_buckets)",
        items=int,
        min=0,
        max=limits.MAX_POSITIONS,
        max_items=limits.MAX_GEARS,
    ),
    pass_api.Option(
        "batch_sizes",
        list,
        [1],
        "batch-size gears",
        items=int,
        min=1,
        max=limits.MAX_BATCH,
        max_items=limits.MAX_GEARS,
    ),
    pass_api.Option(
        "images",
        list,
        [1],
        "images-per-request gears for vision graphs",
        items=int,
        min=1,
        max=limits.MAX_BATCH,
        max_items=limits.MAX_GEARS,
    ),
    pass_api.Option(
        "patch_gears",
        list,
        None,
        "resolution gears of packed-patch vision graphs (vision.preprocess kind packed_patches): patches per image, each a "
        "multiple of merge_size² (default: from the preprocessor's min/max pixels)",
        items=int,
        min=1,
        max=limits.MAX_IMAGE_PIXELS,
        max_items=limits.MAX_GEARS,
    ),
    pass_api.Option(
        "tile_gears",
        list,
        None,
        "resolution gears of tiled vision graphs (preprocess kinds tiles and anyres): tiles per image, "
        "thumbnail or base tile included (default: from the preprocessor's max tiles or grid pinpoints)",
        items=int,
        min=1,
        max=limits.MAX_TOKENS_PER_IMAGE,
        max_items=limits.MAX_GEARS,
    ),
    pass_api.Option(
        "crop_gears",
        list,
        None,
        "resolution gears of HD-crop vision graphs (preprocess kind hd_crops): crops per image, the global "
        "image included; the largest is num_crops + 1 (default: powers of two up to it)",
        items=int,
        min=1,
        max=limits.MAX_TOKENS_PER_IMAGE,
        max_items=limits.MAX_GEARS,
    ),
    pass_api.Option(
        "image_token_gears",
        list,
        None,
        "resolution gears of anyres and HD-crop vision graphs (preprocess kinds anyres, hd_crops): image tokens per image "
        "(default: powers of two up to the most an image gives)",
        items=int,
        min=1,
        max=limits.MAX_TOKENS_PER_IMAGE,
        max_items=limits.MAX_GEARS,
    ),
    pass_api.Option("dims", dict, None, "sizes for other symbolic dims: name -> int or list of ints"),
    pass_api.Option(
        "precision",
        str,
        "auto",
        "ATC --precision_mode_v2; auto derives it from the package precision",
        choices=PRECISIONS,
    ),
    pass_api.Option(
        "keep_fp32_ops",
        list,
        None,
        "Ascend IR op types kept in fp32 via --modify_mixlist (mixed_* precisions only)",
        items=str,
    ),
    pass_api.Option(
        "int4_weights",
        str,
        "int8",
        "INT4 weight storage in the lowered graph: int8 (one value per int8; builds on any CANN) or int4 "
        "(ONNX INT4, two per byte; needs an ATC that maps ONNX INT4, hicann/ge 14b93e226, in no release tag yet; "
        "unverified)",
        choices=("int8", "int4"),
    ),
    pass_api.Option("run", bool, False, "run atc when it is on PATH and collect the .om files"),
    pass_api.Option("log", str, None, "ATC --log level", choices=atc.ENUMS["log"]),
    pass_api.Option("host_env_os", str, None, "ATC --host_env_os", choices=atc.ENUMS["host_env_os"]),
    pass_api.Option("host_env_cpu", str, None, "ATC --host_env_cpu", choices=atc.ENUMS["host_env_cpu"]),
)


def check_target(opts: dict, where: str) -> None:
    """Cross-option checks for an ascend target (raises VlmcError)."""
    soc.check(opts["soc"], opts.get("soc_variant"), where)
    for key in ("sequence_buckets", "past_buckets", "batch_sizes", "images", *RESOLUTION_OPTIONS):
        values = opts.get(key)
        if values is None:
            continue
        if not values:
            raise VlmcError(f"{where}: {key} must list at least one value")
        if any(v <= 0 for v in values):
            raise VlmcError(f"{where}: {key} values must be positive, got {values}")
    for dim, v in (opts.get("dims") or {}).items():
        vals = v if isinstance(v, list) else [v]
        if not vals or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in vals):
            raise VlmcError(f"{where}: dims.{dim} must be a positive int or a list of them, got {v!r}")
    if opts.get("keep_fp32_ops") and opts.get("precision") not in ("mixed_float16", "mixed_bfloat16"):
        raise VlmcError(
            f"{where}: keep_fp32_ops needs precision mixed_float16 or mixed_bfloat16 (ATC allows "
            "--modify_mixlist only with mixed precisions)"
        )


def options(target: dict | None, where: str = "target") -> dict:
    """Validate a target mapping (its 'backend' key is ignored) and fill defaults."""
    rest = {k: v for k, v in (target or {}).items() if k != "backend"}
    out = pass_api.validate(TARGET_OPTIONS, rest, f"{where} ({NAME})")
    check_target(out, where)
    return out
