"""Finding one attention layer's probabilities, queries and keys in an exported (eager) ONNX graph.

Exporters call :func:`locate` once, with the Softmax node of the layer a family cares about, and
write the result into the manifest (``vision.attention``); passes such as ``prune_visual_tokens``
then read tensor names from the manifest instead of matching node names themselves.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
from onnx import numpy_helper

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Ops that may sit between the Q·Kᵀ MatMul and the Softmax in an eager attention graph.
_BETWEEN = ("Mul", "Div", "Add", "Cast", "Where")


def _constants(model: onnx.ModelProto) -> tuple[set[str], dict[str, np.ndarray]]:
    """Names of the graph's constant tensors, and the values of the one-element ones.

    Only one-element values are needed (scale factors); converting every initializer to numpy would
    copy all the weights.
    """
    names: set[str] = set()
    scalars: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            names.add(node.output[0])
            if math.prod(node.attribute[0].t.dims) == 1:
                scalars[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    for t in model.graph.initializer:
        names.add(t.name)
        if math.prod(t.dims) == 1 and (t.data_location != onnx.TensorProto.EXTERNAL or t.raw_data):
            scalars[t.name] = numpy_helper.to_array(t)
    return names, scalars


def softmax_nodes(model: onnx.ModelProto, scope: str | None = None) -> list[onnx.NodeProto]:
    """Softmax nodes in graph order, optionally only those whose name contains ``scope``."""
    return [n for n in model.graph.node if n.op_type == "Softmax" and (scope is None or scope in n.name)]


def locate(model: onnx.ModelProto, softmax: onnx.NodeProto) -> dict:
    """Describe one attention from its Softmax: probs tensor, Q, Kᵀ, scale, and whether a mask is added.

    Walks back from the Softmax input through scale/mask ops to the ``MatMul(Q, Kᵀ)``. Q is
    ``[batch, heads, queries, head_dim]`` and Kᵀ ``[batch, heads, head_dim, keys]`` as eager
    attention computes them; ``scale`` is the product of constant factors applied after the MatMul.

    Raises:
        VlmcError: the Softmax is not fed by a Q·Kᵀ MatMul (e.g. a fused attention kernel).
    """
    producers = {o: n for n in model.graph.node for o in n.output}
    consts, scalars = _constants(model)
    scale, masked = 1.0, False
    tensor = softmax.input[0]
    for _ in range(8):
        node = producers.get(tensor)
        if node is None:
            break
        if node.op_type == "MatMul":
            return {
                "probs": softmax.output[0],
                "query": node.input[0],
                "key_t": node.input[1],
                "scale": float(scale),
                "masked": masked,
            }
        if node.op_type not in _BETWEEN:
            break
        dynamic = [i for i in node.input if i and i not in consts]
        const = [scalars.get(i) for i in node.input if i in consts]
        if node.op_type in ("Mul", "Div") and len(const) == 1 and const[0] is not None:
            factor = float(const[0].reshape(()))
            scale = scale * factor if node.op_type == "Mul" else scale / factor
        elif node.op_type in ("Add", "Where"):
            masked = True
            # The scores come from the MatMul side; the mask (or condition) from elsewhere.
            values = (
                dynamic if node.op_type == "Add" else [i for i in node.input[1:] if i and i not in consts]
            )
            dynamic = [
                i
                for i in values
                if producers.get(i) is not None and producers[i].op_type in ("MatMul", "Mul", "Div", "Cast")
            ][:1]
        elif node.op_type != "Cast":
            break
        if len(dynamic) != 1:
            break
        tensor = dynamic[0]
    raise VlmcError(
        f"Softmax {softmax.name!r} is not fed by a Q·Kᵀ MatMul; cannot locate its attention inputs"
    )
