"""vlmc/interop.py's stub swap and the writers and checks built on it, on small graphs whose weights live in a file."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from vlmc import graphs, interop
from vlmc.errors import VlmcError


def _mlp() -> ir.Model:
    """x[2, 256] -> MatMul(w: 256x64 f32, 64 KiB) -> Add(b: 64 f32) -> y (fixed seed)."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", shape=ir.Shape([2, 256]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", const_value=ir.tensor(rng.standard_normal((256, 64)).astype(np.float32), name="w"))
    b = ir.Value(name="b", const_value=ir.tensor(rng.standard_normal(64).astype(np.float32), name="b"))
    for v in (w, b):
        v.shape, v.dtype = v.const_value.shape, v.const_value.dtype
    mm = ir.node("MatMul", [x, w], outputs=[ir.Value(name="h")])
    add = ir.node("Add", [mm.outputs[0], b], outputs=[ir.Value(name="y")])
    add.outputs[0].dtype = ir.DataType.FLOAT
    add.outputs[0].shape = ir.Shape([2, 64])
    g = ir.Graph(
        [x], [add.outputs[0]], nodes=[mm, add], initializers=[w, b], opset_imports={"": 17}, name="g"
    )
    return ir.Model(g, ir_version=10)


@pytest.fixture
def on_disk(tmp_path) -> ir.Model:
    """The MLP saved and opened again: ``w`` is an ExternalTensor over m.onnx.data, not yet read."""
    interop.save(_mlp(), tmp_path / "m.onnx")
    model = graphs.load_ir(tmp_path / "m.onnx")
    w = model.graph.initializers["w"].const_value
    assert isinstance(w, ir.ExternalTensor) and w.raw is None
    return model


def _tensors(model: ir.Model) -> dict[str, object]:
    return {n: v.const_value for n, v in model.graph.initializers.items()}


def test_weightless_hands_a_proto_of_stubs_and_restores_the_very_same_tensors(on_disk):
    before = _tensors(on_disk)
    w = on_disk.graph.initializers["w"]
    stub = ir.ExternalTensor("elsewhere.bin", 128, w.const_value.nbytes, w.dtype, shape=w.shape, name="w")
    with interop.weightless(on_disk, {w: stub}) as proto:
        assert isinstance(proto, onnx.ModelProto)
        by_name = {t.name: t for t in proto.graph.initializer}
        info = {e.key: e.value for e in by_name["w"].external_data}
        assert by_name["w"].data_location == onnx.TensorProto.EXTERNAL and not by_name["w"].raw_data
        assert info["location"] == "elsewhere.bin" and info["offset"] == "128"
        # the model already holds its own tensors again while the proto is in use
        assert all(_tensors(on_disk)[n] is t for n, t in before.items())
        # initializers are not described in value_info (onnx's own protos do not either)
        assert not {vi.name for vi in proto.graph.value_info} & {"w", "b"}
    assert all(_tensors(on_disk)[n] is t for n, t in before.items())
    assert before["w"].raw is None  # nothing read the weight's bytes


def test_weightless_restores_the_tensors_when_serializing_fails(on_disk):
    before = _tensors(on_disk)
    w = on_disk.graph.initializers["w"]
    with pytest.raises(Exception), interop.weightless(on_disk, {w: "not a tensor"}):  # noqa: B017 (to_proto's own error)
        pass
    assert all(_tensors(on_disk)[n] is t for n, t in before.items())


def test_check_size_and_serialization_read_no_weight(on_disk):
    w = on_disk.graph.initializers["w"].const_value
    interop.check(on_disk, "mlp")  # onnx.checker and strict shape inference on a sparse placeholder
    size = interop.protobuf_bytes(on_disk)
    assert 0 < size < w.nbytes  # the weight is a pointer in the .onnx, as save writes it
    assert w.raw is None and on_disk.graph.initializers["w"].const_value is w


def test_check_reports_a_broken_graph_in_one_line(on_disk):
    on_disk.graph.node(0).op_type = "NoSuchOp"
    with pytest.raises(VlmcError, match="^mlp: ONNX check failed"):
        interop.check(on_disk, "mlp")
    assert on_disk.graph.initializers["w"].const_value.raw is None


def test_fingerprint_sees_weight_bytes_not_their_place(tmp_path, on_disk):
    moved = tmp_path / "moved"
    moved.mkdir()
    interop.save(on_disk, moved / "other.onnx")  # the same content stored elsewhere, under another name
    again = graphs.load_ir(moved / "other.onnx")
    assert interop.fingerprint(again) == interop.fingerprint(on_disk) == interop.fingerprint(_mlp())
    changed = _mlp()
    w = changed.graph.initializers["w"]
    w.const_value = ir.tensor(w.const_value.numpy() + np.float32(1), name="w")
    assert interop.fingerprint(changed) != interop.fingerprint(on_disk)


def test_save_streams_weights_and_leaves_the_model_as_it_was(tmp_path, on_disk):
    before = _tensors(on_disk)
    interop.save(on_disk, tmp_path / "copy.onnx")
    assert all(_tensors(on_disk)[n] is t for n, t in before.items())
    back = interop.open_checked(tmp_path / "copy.onnx")  # the header is checked before it is IR
    np.testing.assert_array_equal(
        back.graph.initializers["w"].const_value.numpy(), _mlp().graph.initializers["w"].const_value.numpy()
    )


def test_open_checked_refuses_a_truncated_data_file(tmp_path):
    interop.save(_mlp(), tmp_path / "m.onnx")
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(VlmcError, match="is truncated"):
        interop.open_checked(tmp_path / "m.onnx")


def test_save_shared_stores_equal_weights_once(tmp_path, on_disk):
    twin = on_disk.clone()  # shares the weight tensors
    before = _tensors(on_disk)
    interop.save_shared({tmp_path / "a.onnx": on_disk, tmp_path / "b.onnx": twin}, tmp_path / "w.data")
    w = before["w"]
    assert (tmp_path / "w.data").stat().st_size < 2 * w.nbytes  # one copy of w (b stays inline)
    assert all(_tensors(on_disk)[n] is t for n, t in before.items())
    for name in ("a.onnx", "b.onnx"):
        loaded = graphs.load_ir(tmp_path / name)
        assert interop.fingerprint(loaded) == interop.fingerprint(on_disk)


def test_exported_names_every_node_by_its_index(tmp_path):
    model = _mlp()
    model.graph.node(1).name = ""
    model.graph.node(0).name = ""
    interop.save(model, tmp_path / "m.onnx")
    assert [n.name for n in model.graph] == ["", ""]
    assert graphs.node_names(model) == ["MatMul_0", "Add_1"]
    assert [n.name for n in model.graph] == ["", ""]  # node_names does not change the model
    proto = interop.exported(tmp_path / "m.onnx")
    assert [n.name for n in proto.graph.node] == ["MatMul_0", "Add_1"]
