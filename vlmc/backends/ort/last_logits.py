"""Compute the LM head for the last position only: ``Slice`` the hidden states before the head.

The generation loop (vlmc.runtime.pipeline ``step``, the scheduler through it) reads only the last
position's logits of every prefill and decode step. The package's decoder computes the LM head for
every position, which at a 600-token LLaVA prefill is a ``[600, 4096] x [4096, 32000]`` product whose
rows are all thrown away but one. The lowered graph keeps its interface (the output is still named
``logits``, rank 3) but its sequence axis is 1: ``logits[:, -1, :]`` is the same tensor as before.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from vlmc import graphs

logger = logging.getLogger(__name__)

OUTPUT = "logits"


def lower(model: ir.Model) -> dict:
    """Slice the LM head's input to the last position, in place; the facts (``sliced`` 0 or 1, or ``skipped``)."""
    out = graphs.slice_lm_head(model, OUTPUT)
    if out["sliced"]:
        logger.info("ort: the LM head (%s) computes the last position only", out["head"])
    return out
