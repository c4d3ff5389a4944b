"""vlmc/backends/ascend/precheck.py's op check on one-node graphs: what ATC takes, at which opset, and when."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from vlmc.backends.ascend import precheck


def _one_node(node, inputs, outputs, inits=(), opset=17, extra_opsets=()) -> ir.Model:
    graph = helper.make_graph([node], "g", inputs, outputs, list(inits))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])
    return ir.from_proto(proto)


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


@pytest.mark.parametrize("opset,ok", [(16, False), (17, True), (18, True)])
def test_layer_normalization_only_at_17_and_18(opset, ok):
    model = _one_node(
        helper.make_node("LayerNormalization", ["x", "g"], ["y"], name="ln"),
        [_vi("x", [2, 4])],
        [_vi("y", [2, 4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "g")],
        opset=opset,
    )
    found = precheck.check_ops(model, "g", lowered=True)
    assert (found == []) is ok
    if not ok:
        assert "'ln'" in str(found[0]) and "opset 17" in found[0].message


def test_portable_qdq_is_left_to_lowering_but_not_allowed_after():
    q = _one_node(
        helper.make_node("QuantizeLinear", ["x", "s"], ["y"], name="q"),
        [_vi("x", [2])],
        [_vi("y", [2], TensorProto.UINT8)],
        [numpy_helper.from_array(np.float32(0.1), "s")],
    )
    assert precheck.check_ops(q, "g", lowered=False) == []
    assert "run the quantize lowering" in str(precheck.check_ops(q, "g", lowered=True)[0])


def test_an_onnxruntime_only_op_is_named_with_its_domain():
    model = _one_node(
        helper.make_node("FastGelu", ["x"], ["y"], name="gelu_0", domain="com.microsoft"),
        [_vi("x", [2, 4])],
        [_vi("y", [2, 4])],
        extra_opsets=[helper.make_opsetid("com.microsoft", 1)],
    )
    found = precheck.check_ops(model, "decoder", lowered=True)
    assert len(found) == 1
    assert "'gelu_0'" in str(found[0]) and "com.microsoft::FastGelu" in str(found[0])
    relu = _one_node(helper.make_node("Relu", ["x"], ["y"], name="r"), [_vi("x", [2])], [_vi("y", [2])])
    assert precheck.check_ops(relu, "decoder", lowered=True) == []
