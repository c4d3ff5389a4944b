"""passes/quantize/weight_only.py: embedding tables (Gather) quantized to INT8 per row or INT4 per group."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import ortsession
from vlmc.passes.quantize import scheme as qscheme
from vlmc.passes.quantize import weight_only

VOCAB, DIM = 50, 64


def _embedding(shared: bool = False) -> ir.Model:
    rng = np.random.default_rng(0)
    ids = ir.Value(name="input_ids", shape=ir.Shape(["batch", "seq"]), type=ir.TensorType(ir.DataType.INT64))
    table = rng.standard_normal((VOCAB, DIM)).astype(np.float32) * 0.05
    w = ir.Value(name="embed.weight", const_value=ir.tensor(table, name="embed.weight"))
    w.shape, w.type = w.const_value.shape, ir.TensorType(ir.DataType.FLOAT)
    out = ir.Value(
        name="inputs_embeds", shape=ir.Shape(["batch", "seq", DIM]), type=ir.TensorType(ir.DataType.FLOAT)
    )
    nodes = [ir.node("Gather", [w, ids], {"axis": 0}, name="embed/Gather", outputs=[out])]
    outputs = [out]
    if shared:  # a tied LM head reads the same table
        y = ir.Value(name="logits", type=ir.TensorType(ir.DataType.FLOAT))
        nodes.append(ir.node("MatMul", [out, w], name="lm_head", outputs=[y]))
        outputs.append(y)
    graph = ir.Graph([ids], outputs, nodes=nodes, initializers=[w], opset_imports={"": 17})
    return ir.Model(graph, ir_version=9)


def _scheme(weights: str, embeddings: bool = True) -> qscheme.GraphScheme:
    return qscheme.GraphScheme(key="embed_tokens", weights=weights, group_size=32, embeddings=embeddings)


@pytest.mark.parametrize("weights, bits", [("int8", 8), ("int4", 4)])
def test_embedding_table_is_quantized_and_only_gathered_rows_dequantized(weights, bits):
    model = _embedding()
    table = model.graph.initializers["embed.weight"].const_value.numpy().copy()
    feed = {"input_ids": np.array([[0, 7, 49, 7], [3, 3, 1, 0]], np.int64)}
    ref = ortsession.from_model(model).run(None, feed)[0]
    np.testing.assert_array_equal(ref, table[feed["input_ids"]])
    q, facts = weight_only.quantize_weight_only(model.clone(), _scheme(weights), None)
    fact = facts["weights"]["gathers"]["embed/Gather"]
    assert fact["bits"] == bits and facts["nodes_quantized"] == ["embed/Gather"]
    assert "embed.weight" not in q.graph.initializers  # no float table left
    assert [v.name for v in q.graph.outputs] == ["inputs_embeds"]
    got = ortsession.from_model(q).run(None, feed)[0]
    # the rows equal the quantizer's own dequantized table
    if bits == 8:
        qi, s = weight_only.quant_int8_rows(table)
        expected = qi.astype(np.float32) * s
        stored = VOCAB * DIM + VOCAB * 4  # int8 rows + one float32 scale per row
    else:
        qk, s = weight_only.quant_int4_group(np.ascontiguousarray(table.T), 32)
        expected = weight_only.dequant_int4(qk, s, 32).T
        stored = VOCAB * DIM // 2 + VOCAB * (DIM // 32) * 4  # two values a byte + a scale per group
    inits = q.graph.initializers
    assert inits[fact["weight"]].const_value.nbytes + inits[fact["scale"]].const_value.nbytes == stored
    np.testing.assert_allclose(got, expected[feed["input_ids"]], rtol=1e-6, atol=1e-7)
    err = np.abs(expected - table).max() / np.abs(table).max()
    assert 0 < err < (0.01 if bits == 8 else 0.15)


def test_embeddings_are_left_alone_unless_asked_and_a_tied_table_is_skipped():
    _, facts = weight_only.quantize_weight_only(_embedding().clone(), _scheme("int8", embeddings=False), None)
    assert facts["nodes_quantized"] == [] and "gathers" not in facts["weights"]
    _, facts = weight_only.quantize_weight_only(_embedding(shared=True).clone(), _scheme("int8"), None)
    assert "embed/Gather" in facts["nodes_skipped"] and "tied" in facts["nodes_skipped"]["embed/Gather"]
