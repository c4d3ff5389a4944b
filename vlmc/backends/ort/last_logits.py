"""Compute the LM head for the last position only: ``Slice`` the hidden states before the head.

The generation loop (vlmc.runtime.pipeline ``step``, the scheduler through it) reads only the last
position's logits of every prefill and decode step. The package's decoder computes the LM head for
every position, which at a 600-token LLaVA prefill is a ``[600, 4096] x [4096, 32000]`` product whose
rows are all thrown away but one. The lowered graph keeps its interface (the output is still named
``logits``, rank 3) but its sequence axis is 1: ``logits[:, -1, :]`` is the same tensor as before.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

logger = logging.getLogger(__name__)

OUTPUT = "logits"
# The LM head forms this rule recognises: a MatMul (FP32, or the portable weight-only dequant chain)
# or the MatMulNBits the ort lowering made of it. Both are position-wise in their first input.
_HEADS = {("", "MatMul"), ("ai.onnx", "MatMul"), ("com.microsoft", "MatMulNBits")}


def _reads_graph_input(v: ir.Value, graph: ir.Graph) -> bool:
    """Whether ``v`` depends on any graph input (a weight, even a dequantized one, does not)."""
    inputs = {id(i) for i in graph.inputs}
    seen: set[int] = set()
    stack = [v]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if id(cur) in inputs:
            return True
        node = cur.producer()
        if node is not None:
            stack.extend(i for i in node.inputs if i is not None)
    return False


def lower(model: ir.Model) -> dict:
    """Slice the LM head's input to the last position, in place; the facts (``sliced`` 0 or 1, or ``skipped``)."""
    graph = model.graph
    out: dict = {"sliced": 0}
    logits = next((o for o in graph.outputs if o.name == OUTPUT), None)
    if logits is None:
        out["skipped"] = f"no {OUTPUT!r} output"
        return out
    head = logits.producer()
    if head is None or (head.domain, head.op_type) not in _HEADS:
        out["skipped"] = f"{OUTPUT!r} is not produced by a MatMul or MatMulNBits"
        return out
    hidden = head.inputs[0]
    # The exporters leave intermediate shapes unset; the graph output's rank is the interface.
    if (
        hidden is None
        or (hidden.shape is not None and len(hidden.shape) != 3)
        or len(logits.shape or ()) != 3
    ):
        out["skipped"] = "the LM head's input or output is not rank 3 [batch, sequence, hidden]"
        return out
    if _reads_graph_input(head.inputs[1], graph):
        out["skipped"] = "the LM head's weight is computed from a graph input"
        return out
    # Other readers of the hidden states (an output, a later op) keep every position: only the head's
    # read is sliced.
    consts = []
    for name, arr in (("starts", [-1]), ("ends", [np.iinfo(np.int64).max]), ("axes", [1])):
        arr = np.asarray(arr, np.int64)
        v = ir.Value(name=f"last_logits_{name}", const_value=ir.tensor(arr, name=f"last_logits_{name}"))
        v.shape, v.type = ir.Shape(arr.shape), ir.TensorType(ir.DataType.INT64)
        graph.register_initializer(v)
        consts.append(v)
    node = ir.node("Slice", [hidden, *consts], name=f"{head.name or 'lm_head'}_last_position")
    sliced = node.outputs[0]
    sliced.name = f"{hidden.name}_last_position"
    sliced.type = hidden.type
    if hidden.shape is not None:
        sliced.shape = ir.Shape([hidden.shape[0], 1, hidden.shape[2]])
    graph.insert_before(head, node)
    head.replace_input_with(0, sliced)
    logits.shape = ir.Shape([logits.shape[0], 1, logits.shape[2]])
    out["sliced"] = 1
    out["head"] = f"{head.domain + '.' if head.domain else ''}{head.op_type}"
    logger.info("ort: LM head %s computes the last position only", head.name)
    return out
