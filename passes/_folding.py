"""What constant folding must leave alone: graphs whose weights are stored compressed."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Quantized graphs keep int8/int4 weights behind a dequantize subgraph; folding that subgraph would
# turn them back into float weights and silently undo the compression.
_COMPRESSED = ("int8", "int8_weight_only", "int4_weight_only", "mixed")


def foldable(package, names: list[str], pass_name: str) -> tuple[list[str], dict[str, str]]:
    """Split graph names into those a folding pass may touch and those it must skip (with reasons)."""
    keep, skipped = [], {}
    for name in names:
        info = package.info(name)
        if info.get("precision") in _COMPRESSED or info.get("quantization"):
            skipped[name] = (
                f"{info.get('precision')} weights; folding would undo the quantization (run {pass_name} before quantize)"
            )
            logger.warning("%s: skipping %s: %s", pass_name, name, skipped[name])
        else:
            keep.append(name)
    return keep, skipped
