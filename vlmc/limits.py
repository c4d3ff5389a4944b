"""Bounds on work an untrusted package, recipe or input can ask for (docs/security.md lists them).

Each bound has a default sized for real models (7B+ VLMs at their published resolutions) with room to
spare, and an environment variable that raises it for a user who needs more, e.g.
``VLMC_MAX_IMAGE_PIXELS=400000000 vlmc run ...``. A value past a bound is refused with one line
naming the key and the variable, before any work is done.
"""

from __future__ import annotations

import os


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        return default
    return value if value > 0 else default


# Pixels of one input image file (width x height), checked from its header before it is decoded.
# PIL's own decompression-bomb guard is set to the same number.
MAX_IMAGE_PIXELS = _env_int("VLMC_MAX_IMAGE_PIXELS", 8192 * 8192)
# One side of an image size a manifest states (image_size, crop_size, resize sizes).
MAX_IMAGE_SIDE = _env_int("VLMC_MAX_IMAGE_SIDE", 8192)
# Vocabulary size; every token id a manifest states must be below the package's vocab_size.
MAX_VOCAB = _env_int("VLMC_MAX_VOCAB", 1 << 22)
# Decoder layers, heads, hidden widths and positions a manifest may state.
MAX_LAYERS = _env_int("VLMC_MAX_LAYERS", 1024)
MAX_HEADS = _env_int("VLMC_MAX_HEADS", 4096)
MAX_HIDDEN = _env_int("VLMC_MAX_HIDDEN", 1 << 17)
MAX_POSITIONS = _env_int("VLMC_MAX_POSITIONS", 1 << 22)
# Visual tokens one image may give.
MAX_TOKENS_PER_IMAGE = _env_int("VLMC_MAX_TOKENS_PER_IMAGE", 1 << 16)
# vlmc.json size on disk, and the nesting depth of any JSON value in it.
MAX_MANIFEST_BYTES = _env_int("VLMC_MAX_MANIFEST_BYTES", 64 * 1024 * 1024)
MAX_JSON_DEPTH = 32
# Nesting depth, integer digits and alias-expanded nodes of any JSON or YAML input (vlmc/parsing.py).
MAX_INT_DIGITS = 40
MAX_YAML_NODES = _env_int("VLMC_MAX_YAML_NODES", 100_000)
# A recipe file on disk.
MAX_RECIPE_BYTES = _env_int("VLMC_MAX_RECIPE_BYTES", 4 * 1024 * 1024)
# compile.json, vlmc-build.json and the rank table of a build directory on disk.
MAX_BUILD_JSON_BYTES = _env_int("VLMC_MAX_BUILD_JSON_BYTES", 64 * 1024 * 1024)
# An error line: longer ones (a 100 kB pass name echoed back) are cut, keeping both ends.
MAX_ERROR_CHARS = 1000
# Calibration / evaluation samples a recipe may ask for (each is one full FP32 pipeline run).
MAX_CALIBRATION_SAMPLES = _env_int("VLMC_MAX_CALIBRATION_SAMPLES", 4096)
# Batch-size / image-count gears and plan sizes a recipe or the command line may ask for.
MAX_BATCH = _env_int("VLMC_MAX_BATCH", 4096)
MAX_GEARS = 64
# A chat template render: characters of output and seconds of work.
MAX_TEMPLATE_OUTPUT_CHARS = _env_int("VLMC_MAX_TEMPLATE_OUTPUT_CHARS", 1 << 20)
MAX_TEMPLATE_SECONDS = _env_int("VLMC_MAX_TEMPLATE_SECONDS", 5)
# Loop iterations a chat template may run in total (every range() and for-loop step counts).
MAX_TEMPLATE_STEPS = _env_int("VLMC_MAX_TEMPLATE_STEPS", 1_000_000)
# Fidelity of a quantized build vs FP32 (the quantize pass's report) runs graphs on onnxruntime on the
# CPU: an FP32 reference run while calibrating and a quantized run after; onnxruntime holds a copy of
# each graph's weights. Per-graph fidelity is skipped for a graph whose FP32 weights are above
# VLMC_MAX_FIDELITY_BYTES, end-to-end fidelity when the pipeline's graphs together are (default 4 GiB:
# the 512 M-parameter real-width row passes, a 7B decoder, 26 GB, does not); the report says so.
# Above it, quantize's option streamed_fidelity measures per-graph fidelity segment by segment instead
# (one segment's weights resident; passes/quantize/stream_fidelity.py): the limit bounds the whole-graph path.
MAX_FIDELITY_BYTES = _env_int("VLMC_MAX_FIDELITY_BYTES", 4 << 30)
# Greedy tokens end-to-end fidelity generates in all (eval_samples x eval_tokens; each is a decoder
# call on the quantized package): eval_tokens is cut to fit, and the report says so.
MAX_FIDELITY_TOKENS = _env_int("VLMC_MAX_FIDELITY_TOKENS", 64)
