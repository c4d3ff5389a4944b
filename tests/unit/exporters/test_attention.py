"""vlmc.exporters.attention on small hand-built onnx-ir graphs: the walk from a Softmax back to Q·Kᵀ."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc.errors import VlmcError
from vlmc.exporters import attention

FLOAT = ir.DataType.FLOAT


def _attention(scale_op: str = "Mul", mask: bool = True, constant_node: bool = False) -> ir.Model:
    """scores = MatMul(q, kᵀ) scaled by a constant, optionally plus a mask, then Softmax (as eager exports)."""
    tape = ir.tape.Tape()
    q = ir.val("q", FLOAT, [1, 2, 5, 4])
    k_t = ir.val("k_t", FLOAT, [1, 2, 4, 5])
    bias = ir.val("bias", FLOAT, [1, 1, 5, 5])
    factor = 0.5 if scale_op == "Mul" else 2.0
    if constant_node:
        scale = tape.op("Constant", [], {"value": ir.tensor(np.array(factor, np.float32), name="scale")})
    else:
        scale = tape.initializer(ir.tensor(np.array(factor, np.float32), name="scale"))
    weight = tape.initializer(ir.tensor(np.ones((4, 4), np.float32), name="weight"))  # not a scale
    projected = tape.op("MatMul", [q, weight])
    scores = tape.op("MatMul", [projected, k_t], name="/layers.0/attn/MatMul")
    scores = tape.op(scale_op, [scores, scale])
    if mask:
        scores = tape.op("Add", [bias, scores])
    probs = tape.op("Softmax", [scores], {"axis": -1}, name="/layers.0/attn/Softmax")
    probs.name = "probs"
    graph = ir.Graph(
        [q, k_t, bias], [probs], nodes=tape.nodes, initializers=tape.initializers, opset_imports={"": 17}
    )
    return ir.Model(graph, ir_version=8)


@pytest.mark.parametrize("scale_op, constant_node", [("Mul", False), ("Div", False), ("Mul", True)])
def test_locate_walks_back_to_the_scores_matmul(scale_op, constant_node):
    model = _attention(scale_op, mask=True, constant_node=constant_node)
    (softmax,) = attention.softmax_nodes(model, scope="/layers.0/")
    facts = attention.locate(model, softmax)
    matmul = model.graph.node("/layers.0/attn/MatMul")
    assert facts == {
        "probs": "probs",
        "query": matmul.inputs[0].name,
        "key_t": "k_t",
        "scale": 0.5,
        "masked": True,
    }


def test_unmasked_attention_and_scope_filter():
    model = _attention(mask=False)
    assert attention.softmax_nodes(model, scope="/layers.1/") == []
    facts = attention.locate(model, attention.softmax_nodes(model)[0])
    assert facts["masked"] is False and facts["scale"] == 0.5


def test_a_softmax_without_scores_matmul_is_refused():
    x = ir.val("x", FLOAT, [1, 5])
    tape = ir.tape.Tape()
    probs = tape.op("Softmax", [tape.op("Relu", [x])], {"axis": -1}, name="fused")
    model = ir.Model(ir.Graph([x], [probs], nodes=tape.nodes, opset_imports={"": 17}), ir_version=8)
    with pytest.raises(VlmcError, match="'fused' is not fed by a Q·Kᵀ MatMul"):
        attention.locate(model, attention.softmax_nodes(model)[0])
    other = _attention()
    with pytest.raises(VlmcError, match="not a node of the graph given"):
        attention.locate(other, attention.softmax_nodes(model)[0])
