"""The proto seam (vlmc/interop.py) on small hand-built IR graphs: what a tool sees, what comes back."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from vlmc import interop


def _mlp(big_rows: int = 512) -> ir.Model:
    """x[2, big_rows] -> MatMul(w big) -> Add(b small) -> y, built with onnx-ir (fixed seed)."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", shape=ir.Shape([2, big_rows]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(
        name="w", const_value=ir.tensor(rng.standard_normal((big_rows, 8)).astype(np.float32), name="w")
    )
    b = ir.Value(name="b", const_value=ir.tensor(rng.standard_normal(8).astype(np.float32), name="b"))
    for v in (w, b):
        v.shape, v.dtype = v.const_value.shape, v.const_value.dtype
    mm = ir.node("MatMul", [x, w], name="mm", outputs=[ir.Value(name="h")])
    add = ir.node("Add", [mm.outputs[0], b], name="add", outputs=[ir.Value(name="y")])
    add.outputs[0].dtype = ir.DataType.FLOAT
    g = ir.Graph(
        [x], [add.outputs[0]], nodes=[mm, add], initializers=[w, b], opset_imports={"": 17}, name="g"
    )
    return ir.Model(g, ir_version=10)


def test_big_weights_are_inputs_the_tool_never_sees_and_come_back_as_the_same_tensors():
    model = _mlp()
    w_tensor = model.graph.initializers["w"].const_value
    limit = 1024  # w is 16 KiB, b is 32 B
    with interop.as_proto(model, weight_limit=limit) as seam:
        proto = seam.proto
        assert [t.name for t in proto.graph.initializer] == ["b"]  # the small weight is inside
        assert [i.name for i in proto.graph.input] == ["x", "w"]  # the big one is an opaque input
        assert set(seam.held) == {"w"}
        # the model itself is untouched while the tool works
        assert list(model.graph.initializers) == ["w", "b"] and [v.name for v in model.graph.inputs] == ["x"]
        seam.give_back(proto)
    out = seam.model
    assert out is not model and list(out.graph.initializers) == ["w", "b"]
    assert [v.name for v in out.graph.inputs] == ["x"]
    assert out.graph.initializers["w"].const_value is w_tensor  # not read, not copied


def test_without_a_result_nothing_comes_back_and_none_limit_reads_every_weight():
    model = _mlp()
    with interop.as_proto(model, weight_limit=None) as seam:
        assert sorted(t.name for t in seam.proto.graph.initializer) == ["b", "w"]
        assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in seam.proto.graph.initializer)
    assert seam.model is None and seam.proto is None


def test_a_failing_tool_leaves_the_model_as_it_was():
    model = _mlp()
    before = interop.fingerprint(model)
    with pytest.raises(RuntimeError), interop.as_proto(model, weight_limit=1024):
        raise RuntimeError("tool failed")
    assert interop.fingerprint(model) == before


def test_as_file_and_load_result_round_trip_streams_weights(tmp_path):
    model = _mlp()
    with interop.as_file(model, tmp_path, "m.onnx") as path:
        assert (tmp_path / "m.onnx.data").stat().st_size >= 512 * 8 * 4
    back = interop.load_result(path)
    assert isinstance(back.graph.initializers["w"].const_value, ir.ExternalTensor)
    np.testing.assert_array_equal(
        back.graph.initializers["w"].const_value.numpy(), model.graph.initializers["w"].const_value.numpy()
    )
    in_mem = interop.load_result(path, in_memory=True)
    assert not isinstance(in_mem.graph.initializers["w"].const_value, ir.ExternalTensor)
    assert interop.fingerprint(in_mem) == interop.fingerprint(back)
