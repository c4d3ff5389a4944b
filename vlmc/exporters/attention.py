"""Finding one attention layer's probabilities, queries and keys in an exported (eager) graph.

Exporters call :func:`locate` once, with the Softmax node of the layer a family cares about, and
write the result into the manifest (``vision.attention``); passes such as ``prune_visual_tokens``
then read tensor names from the manifest instead of matching node names themselves.

The graph is an onnx-ir model (an exporter's weightless ModelProto goes through
:func:`vlmc.interop.from_proto`); the walk follows ``value.producer()``, and only one-element
constants (scale factors) are read, never a weight.
"""

from __future__ import annotations

import logging
import math

import onnx_ir as ir

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Ops that may sit between the Q·Kᵀ MatMul and the Softmax in an eager attention graph.
_BETWEEN = ("Mul", "Div", "Add", "Cast", "Where")


def _is_constant(value: ir.Value | None) -> bool:
    """An initializer, or the output of a Constant node."""
    if value is None:
        return False
    if value.is_initializer() or value.const_value is not None:
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"


def _scalar(value: ir.Value) -> float | None:
    """The value of a one-element constant, else None (a larger constant's bytes are never read)."""
    tensor = ir.convenience.get_const_tensor(value)  # an initializer's or a Constant node's
    # A file-backed tensor is a weight, never a scale factor (those are stored inline).
    if tensor is None or isinstance(tensor, ir.ExternalTensor) or math.prod(tensor.shape.numpy()) != 1:
        return None
    return float(tensor.numpy().reshape(()))


def softmax_nodes(model: ir.Model, scope: str | None = None) -> list[ir.Node]:
    """Softmax nodes in graph order, optionally only those whose name contains ``scope``."""
    return [
        node
        for node in model.graph
        if node.op_type == "Softmax" and (scope is None or scope in (node.name or ""))
    ]


def locate(model: ir.Model, softmax: ir.Node) -> dict:
    """Describe one attention from its Softmax: probs tensor, Q, Kᵀ, scale, and whether a mask is added.

    Walks back from the Softmax input through scale/mask ops to the ``MatMul(Q, Kᵀ)``. Q is
    ``[batch, heads, queries, head_dim]`` and Kᵀ ``[batch, heads, head_dim, keys]`` as eager
    attention computes them; ``scale`` is the product of constant factors applied after the MatMul.

    Raises:
        VlmcError: the Softmax is not fed by a Q·Kᵀ MatMul (e.g. a fused attention kernel).
    """
    if softmax.graph is not model.graph:
        raise VlmcError(f"Softmax {softmax.name!r} is not a node of the graph given")
    scale, masked = 1.0, False
    value = softmax.inputs[0]
    for _ in range(8):
        node = value.producer() if value is not None else None
        if node is None:
            break
        if node.op_type == "MatMul":
            return {
                "probs": softmax.outputs[0].name,
                "query": node.inputs[0].name,
                "key_t": node.inputs[1].name,
                "scale": float(scale),
                "masked": masked,
            }
        if node.op_type not in _BETWEEN:
            break
        dynamic = [v for v in node.inputs if v is not None and not _is_constant(v)]
        constants = [_scalar(v) for v in node.inputs if _is_constant(v)]
        if node.op_type in ("Mul", "Div") and len(constants) == 1 and constants[0] is not None:
            scale = scale * constants[0] if node.op_type == "Mul" else scale / constants[0]
        elif node.op_type in ("Add", "Where"):
            masked = True
            # The scores come from the MatMul side; the mask (or condition) from elsewhere.
            candidates = (
                dynamic
                if node.op_type == "Add"
                else [v for v in node.inputs[1:] if v is not None and not _is_constant(v)]
            )
            dynamic = [
                v
                for v in candidates
                if v.producer() is not None and v.producer().op_type in ("MatMul", "Mul", "Div", "Cast")
            ][:1]
        elif node.op_type != "Cast":
            break
        if len(dynamic) != 1:
            break
        value = dynamic[0]
    raise VlmcError(
        f"Softmax {softmax.name!r} is not fed by a Q·Kᵀ MatMul; cannot locate its attention inputs"
    )


def feature_layer_index(feature_layer: int | None, layers: int) -> int:
    """The encoder layer whose output ``hidden_states[feature_layer]`` is (None: the last layer's).

    hidden_states[0] is the embeddings, so hidden_states[f] (f < 0: L + f) is the output of encoder
    layer L + f (f > 0: f - 1).
    """
    f = -1 if feature_layer is None else int(feature_layer)
    return layers + f if f < 0 else f - 1


def grouped_facts(
    vision_graph: ir.Model, scope: str, keys: int, query_index: int | None, groups, where: str
) -> dict | None:
    """Attention facts of the one Softmax under ``scope`` whose feature tokens each pool a group of patches.

    ``groups`` [tokens, group]: the key columns (CLS included) whose attention scores each feature token
    (pixel shuffle or pooling folds those patches into it). None, with a warning, unless exactly one
    Softmax is found.
    """
    nodes = softmax_nodes(vision_graph, scope=scope)
    if len(nodes) != 1:
        logger.warning(
            "%s: found %d Softmax nodes under %s; attention facts not written", where, len(nodes), scope
        )
        return None
    facts = locate(vision_graph, nodes[0])
    facts.update(
        {
            "graph": "vision_encoder",
            "query_index": query_index,
            "token_offset": 0,
            "keys_per_image": int(keys),
            # flat (the manifest's facts nest two levels): token t pools groups[t·g : (t+1)·g]
            "groups": [int(x) for row in groups for x in row],
            "group_size": len(groups[0]),
        }
    )
    return facts
