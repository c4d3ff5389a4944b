"""Lowering QDQ to the AMCT deploy form and weight-only to NPUWeightQuantBatchMatmulV2, checked numerically
through the numpy references against onnxruntime on the portable graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from vlmc.backends.ascend import lower, precheck
from vlmc.errors import CheckFailed
from vlmc.runtime.executors import reference

K, N = 16, 8


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # ORT's optimizer fuses DQ+MatMul into dynamically quantized kernels; the QDQ semantics are unfused.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, feeds
    )


def _fp32_matmul_add(gemm: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K) if gemm else (K, N)).astype(np.float32) * 0.5
    b = rng.standard_normal(N).astype(np.float32)
    if gemm:
        nodes = [
            helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="fc", transB=1),
            helper.make_node("Relu", ["y"], ["z"], name="relu"),
        ]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])
        z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, N])
    else:
        nodes = [
            helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
            helper.make_node("Add", ["m", "b"], ["y"], name="add"),
            helper.make_node("Relu", ["y"], ["z"], name="relu"),
        ]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", K])
        z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", "sequence", N])
    g = helper.make_graph(
        nodes, "g", [x], [z], [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")]
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


class _Reader(CalibrationDataReader):
    def __init__(self, shape, n=8, seed=1):
        rng = np.random.default_rng(seed)
        self._it = iter([{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)])

    def get_next(self):
        return next(self._it, None)


def _quantize(
    model: onnx.ModelProto, tmp_path, shape, activation=QuantType.QUInt8, per_channel=False, extra=None
) -> onnx.ModelProto:
    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(model, src)
    quantize_static(
        str(src),
        str(dst),
        _Reader(shape),
        quant_format=QuantFormat.QDQ,
        per_channel=per_channel,
        activation_type=activation,
        weight_type=QuantType.QInt8,
        extra_options={"WeightSymmetric": True, **(extra or {})},
    )
    return onnx.load(str(dst))


def _lowered(q: onnx.ModelProto):
    """The lowering runs on the IR; the result comes back as a proto for the checks below."""
    low, report = lower.lower(ir.from_proto(q), "g")
    return ir.to_proto(low), report


def _scale(model: onnx.ModelProto, name: str) -> float:
    return float(next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name))


@pytest.mark.parametrize("activation", [QuantType.QUInt8, QuantType.QInt8])
def test_qdq_matmul_add_lowers_to_deploy_form(tmp_path, activation):
    q = _quantize(_fp32_matmul_add(), tmp_path, (1, 4, K), activation)
    low, report = _lowered(q)
    assert [n.op_type for n in low.graph.node] == ["AscendQuant", "MatMul", "Add", "AscendDequant", "Clip"]
    assert report.quantized_layers == ["mm"] and report.fake_quant_clips == 1
    inits = {t.name: numpy_helper.to_array(t) for t in low.graph.initializer}
    quant, mm, add, deq = low.graph.node[:4]
    assert inits[mm.input[1]].dtype == np.int8 and inits[mm.input[1]].shape == (K, N)
    assert inits[add.input[1]].dtype == np.int32
    deq_scale = inits[deq.input[1]]
    assert (
        deq_scale.dtype == np.uint64 and deq_scale.shape == (1,) and (deq_scale >> np.uint64(32) == 0).all()
    )
    s_x, s_w = _scale(q, "x_scale"), _scale(q, "W_scale")
    assert reference.unpack_deq_scale(deq_scale)[0] == pytest.approx(s_x * s_w, rel=1e-6)
    attrs = {a.name: helper.get_attribute_value(a) for a in quant.attribute}
    assert attrs["scale"] == pytest.approx(1 / s_x, rel=1e-6) and attrs["dst_type"] == b"INT8"
    assert deq.attribute[0].name == "dtype" and deq.attribute[0].i == 0
    assert precheck.check_ops(ir.from_proto(low), "g", lowered=True) == []


@pytest.mark.parametrize("activation", [QuantType.QUInt8, QuantType.QInt8])
def test_lowered_int8_matches_portable_qdq(tmp_path, activation):
    q = _quantize(_fp32_matmul_add(), tmp_path, (1, 4, K), activation)
    low, _ = _lowered(q)
    x = np.random.default_rng(7).standard_normal((2, 5, K)).astype(np.float32)
    expected = _ort(q, {"x": x})[0]
    # The deploy form skips the accumulator's fake quant and does not round the output to the output grid.
    atol = 0.5 * (_scale(q, "m_scale") + _scale(q, "z_scale")) + 1e-5
    exact = reference.run(low, {"x": x}, fp16=False)["z"]
    np.testing.assert_allclose(exact, expected, rtol=0, atol=atol)
    on_npu = reference.run(low, {"x": x}, fp16=True)["z"]
    np.testing.assert_allclose(on_npu, expected, rtol=0, atol=atol + 0.01 * np.abs(expected).max())


def test_gemm_trans_b_lowers_and_matches(tmp_path):
    q = _quantize(_fp32_matmul_add(gemm=True), tmp_path, (4, K))
    low, report = _lowered(q)
    assert report.quantized_layers == ["fc"]
    assert [n.op_type for n in low.graph.node if n.op_type != "Clip"] == [
        "AscendQuant",
        "MatMul",
        "Add",
        "AscendDequant",
    ]
    x = np.random.default_rng(3).standard_normal((4, K)).astype(np.float32)
    expected = _ort(q, {"x": x})[0]
    got = reference.run(low, {"x": x}, fp16=False)["z"]
    np.testing.assert_allclose(got, expected, rtol=0, atol=_scale(q, "z_scale") + 1e-5)


def test_conv_per_channel_lowers_and_matches(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    b = rng.standard_normal(4).astype(np.float32) * 0.1
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "W", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    q = _quantize(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
        tmp_path,
        (1, 3, 8, 8),
        QuantType.QInt8,
        per_channel=True,
        extra={"ActivationSymmetric": True},
    )
    low, report = _lowered(q)
    assert report.quantized_layers == ["conv"]
    ops = [n.op_type for n in low.graph.node]
    assert ops[:3] == ["AscendQuant", "Conv", "AscendDequant"]
    deq = next(n for n in low.graph.node if n.op_type == "AscendDequant")
    assert next(numpy_helper.to_array(t) for t in low.graph.initializer if t.name == deq.input[1]).shape == (
        4,
    )
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    expected = _ort(q, {"x": x})[0]
    got = reference.run(low, {"x": x}, fp16=False)["y"]
    np.testing.assert_allclose(got, expected, rtol=0, atol=_scale(q, "y_scale") + 1e-5)


def test_fp32_graph_is_unchanged():
    from vlmc import interop

    model = ir.from_proto(_fp32_matmul_add())
    before = interop.fingerprint(model.clone())
    low, report = lower.lower(model, "g")
    assert [n.op_type for n in low.graph] == ["MatMul", "Add", "Relu"]
    assert not report.quantized and report.fake_quant_clips == 0 and report.kept_fp32 == []
    assert interop.fingerprint(low) == before


def test_per_channel_matmul_is_refused_by_default_naming_the_node(tmp_path):
    """AMCT deploys MatMul/Gemm weights per tensor; per-channel is refused unless the switch is flipped."""
    q = _quantize(_fp32_matmul_add(), tmp_path, (1, 4, K), per_channel=True)
    with pytest.raises(CheckFailed, match=r"mm \(MatMul\).*per tensor"):
        _lowered(q)


def test_per_channel_matmul_switch_gives_cout_deq_scale(tmp_path, monkeypatch):
    from vlmc.backends.ascend.rules import _qdq_matmul

    monkeypatch.setattr(_qdq_matmul, "ALLOW_PER_CHANNEL_MATMUL", True)
    q = _quantize(_fp32_matmul_add(), tmp_path, (1, 4, K), per_channel=True)
    low, report = _lowered(q)
    assert report.quantized_layers == ["mm"]
    deq = next(n for n in low.graph.node if n.op_type == "AscendDequant")
    assert next(numpy_helper.to_array(t) for t in low.graph.initializer if t.name == deq.input[1]).shape == (
        N,
    )
    x = np.random.default_rng(7).standard_normal((2, 5, K)).astype(np.float32)
    atol = 0.5 * (_scale(q, "m_scale") + _scale(q, "z_scale")) + 1e-5
    np.testing.assert_allclose(
        reference.run(low, {"x": x}, fp16=False)["z"], _ort(q, {"x": x})[0], rtol=0, atol=atol
    )


def _hand_qdq_matmul(w_axis: int | None, k: int = 8, n: int = 8, zp: int = 0) -> onnx.ModelProto:
    """x -> Q -> DQ -> MatMul <- DQ(int8 W [k, n]) with weight scales along ``w_axis`` (None: per tensor)."""
    rng = np.random.default_rng(3)
    wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
    if w_axis is None:
        ws, wz, kw = np.array(0.01, np.float32), np.array(0, np.int8), {}
    else:
        size = (k, n)[w_axis]
        ws = (rng.random(size).astype(np.float32) + 0.5) * 0.01
        wz, kw = np.zeros(size, np.int8), {"axis": w_axis}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq"),
        helper.make_node("DequantizeLinear", ["Wq", "Ws", "Wz"], ["W"], name="w_dq", **kw),
        helper.make_node("MatMul", ["xd", "W"], ["y"], name="mm"),
    ]
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
        numpy_helper.from_array(np.array(zp, np.int8), "xz"),
        numpy_helper.from_array(wq, "Wq"),
        numpy_helper.from_array(ws, "Ws"),
        numpy_helper.from_array(wz, "Wz"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("allow", [False, True])
def test_square_matmul_weight_quantized_on_its_input_axis_is_refused(monkeypatch, allow):
    """A square [k, k] weight with scales along axis 0 has as many scales as output channels; it must
    not pass as per-output-channel, whatever the per-channel switch says."""
    from vlmc.backends.ascend.rules import _qdq_matmul

    monkeypatch.setattr(_qdq_matmul, "ALLOW_PER_CHANNEL_MATMUL", allow)
    with pytest.raises(CheckFailed, match=r"mm \(MatMul\).*axis 0, its input axis"):
        _lowered(_hand_qdq_matmul(w_axis=0))


def test_rules_report_rewrites_and_reasons():
    low, report = _lowered(_hand_qdq_matmul(w_axis=None))
    assert [n.op_type for n in low.graph.node] == ["AscendQuant", "MatMul", "AscendDequant"]
    assert report.rules["qdq_matmul"]["applied"] == 1
    assert report.rules["qdq_conv"]["applied"] == 0 and report.rules["weight_only_matmul"]["applied"] == 0
    fp32, fp32_report = _lowered(_fp32_matmul_add())
    assert fp32_report.rules["qdq_matmul"]["not_matched"] == {"input 0 is not a DequantizeLinear": 1}
    assert fp32_report.rules["weight_only_matmul"]["not_matched"] == {
        "the weight is a plain initializer (not quantized)": 1
    }


@pytest.mark.parametrize("zp", [0, -10])
def test_asymmetric_activation_follows_amct_form_and_ge_applies_the_offset(zp):
    """Bias = round(b/(s_w*s_x)) with no -zp*sum(w) term; AscendQuant carries the offset; the reference
    executor applies GE's correction, so the result matches onnxruntime on the QDQ graph."""
    model = _hand_qdq_matmul(w_axis=None, zp=zp)
    low, report = _lowered(model)
    quant = next(n for n in low.graph.node if n.op_type == "AscendQuant")
    assert {a.name: helper.get_attribute_value(a) for a in quant.attribute}["offset"] == zp
    assert report.asymmetric_layers == (["mm"] if zp else [])
    assert any("unverified on hardware" in note for note in report.notes) == bool(zp)
    assert not any(n.op_type == "Add" for n in low.graph.node)  # no bias: nothing folded into one
    corrected, touched = reference.ge_offset_correction(low)
    assert touched == (1 if zp else 0)
    x = np.random.default_rng(2).standard_normal((2, 8)).astype(np.float32)
    expected = _ort(model, {"x": x})[0]
    got = reference.run(low, {"x": x}, fp16=False)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_activation_scale_beyond_fp16_is_rejected(tmp_path):
    q = _quantize(_fp32_matmul_add(), tmp_path, (1, 4, K))
    for t in q.graph.initializer:
        if t.name == "x_scale":
            t.CopyFrom(numpy_helper.from_array(np.array(1e-6, np.float32), "x_scale"))
    with pytest.raises(CheckFailed, match="beyond fp16"):
        _lowered(q)


def _weight_only_dq(seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    qw = rng.integers(-127, 128, (K, N)).astype(np.int8)
    scale = (rng.random(N).astype(np.float32) + 0.5) * 0.01
    g = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["Wq", "Ws", "Wz"], ["W"], name="w_dq", axis=1),
            helper.make_node("MatMul", ["x", "W"], ["y"], name="proj"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", N])],
        [
            numpy_helper.from_array(qw, "Wq"),
            numpy_helper.from_array(scale, "Ws"),
            numpy_helper.from_array(np.zeros(N, np.int8), "Wz"),
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _weight_only_grouped(group=32, bits=4, seed=0, K=64) -> onnx.ModelProto:  # noqa: N803
    rng = np.random.default_rng(seed)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    qw = rng.integers(lo, hi + 1, (K, N)).astype(np.int8)
    scale = (rng.random((K // group, 1, N)).astype(np.float32) + 0.5) * 0.05
    zp = rng.integers(-2, 3, (K // group, 1, N)).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["Wq"], ["Wf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Reshape", ["Wf", "gshape"], ["Wg"], name="group"),
        helper.make_node("Sub", ["Wg", "Wz"], ["Wc"], name="sub_zp"),
        helper.make_node("Mul", ["Wc", "Ws"], ["Wm"], name="mul_scale"),
        helper.make_node("Reshape", ["Wm", "wshape"], ["W"], name="ungroup"),
        helper.make_node("MatMul", ["x", "W"], ["y"], name="proj"),
    ]
    inits = [
        numpy_helper.from_array(qw, "Wq"),
        numpy_helper.from_array(scale, "Ws"),
        numpy_helper.from_array(zp, "Wz"),
        numpy_helper.from_array(np.array([K // group, group, N], np.int64), "gshape"),
        numpy_helper.from_array(np.array([K, N], np.int64), "wshape"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", N])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _weight_only_packed_int4(group=32, seed=0, K=64) -> onnx.ModelProto:  # noqa: N803
    """Unsigned int4 nibbles packed two per byte (low nibble first), zero point 8, grouped scales."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 16, (K, N)).astype(np.uint8)
    flat = u.reshape(-1)
    packed = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    scale = (rng.random((K // group, 1, N)).astype(np.float32) + 0.5) * 0.05
    nodes = [
        helper.make_node("BitwiseAnd", ["packed", "low_mask"], ["lo"], name="low_nibble"),
        helper.make_node("BitShift", ["packed", "four"], ["hi"], name="high_nibble", direction="RIGHT"),
        helper.make_node("Unsqueeze", ["lo", "last"], ["lo1"], name="lo_axis"),
        helper.make_node("Unsqueeze", ["hi", "last"], ["hi1"], name="hi_axis"),
        helper.make_node("Concat", ["lo1", "hi1"], ["nibbles"], name="interleave", axis=-1),
        helper.make_node("Reshape", ["nibbles", "gshape"], ["Wg"], name="group"),
        helper.make_node("Cast", ["Wg"], ["Wf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Sub", ["Wf", "eight"], ["Wc"], name="sub_zp"),
        helper.make_node("Mul", ["Wc", "Ws"], ["Wm"], name="mul_scale"),
        helper.make_node("Reshape", ["Wm", "wshape"], ["W"], name="ungroup"),
        helper.make_node("MatMul", ["x", "W"], ["y"], name="proj"),
    ]
    inits = [
        numpy_helper.from_array(packed, "packed"),
        numpy_helper.from_array(np.array(0x0F, np.uint8), "low_mask"),
        numpy_helper.from_array(np.array(4, np.uint8), "four"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array([K // group, group, N], np.int64), "gshape"),
        numpy_helper.from_array(np.array([K, N], np.int64), "wshape"),
        numpy_helper.from_array(np.float32(8.0), "eight"),
        numpy_helper.from_array(scale, "Ws"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", N])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    "builder,group,bits",
    [(_weight_only_dq, 0, 8), (_weight_only_grouped, 32, 4), (_weight_only_packed_int4, 32, 4)],
)
def test_weight_only_lowers_to_weight_quant_batch_matmul(builder, group, bits):
    model = builder()
    K = model.graph.input[0].type.tensor_type.shape.dim[2].dim_value  # noqa: N806
    low, report = _lowered(model)
    assert [n.op_type for n in low.graph.node] == ["NPUWeightQuantBatchMatmulV2"]
    node = low.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"antiquant_group_size": group, "transpose_x": 0, "transpose_weight": 0}
    inits = {t.name: numpy_helper.to_array(t) for t in low.graph.initializer}
    assert inits[node.input[1]].dtype == np.int8 and inits[node.input[1]].shape == (K, N)
    assert inits[node.input[2]].shape == ((N,) if not group else (K // group, N))
    # antiquant_scale/offset have the type of x: float16 on the NPU (op proto), never float32
    assert all(inits[i].dtype == np.float16 for i in node.input[2:])
    assert report.weight_only_layers == ["proj"] and report.weight_only_bits == bits
    assert report.weight_only_sources == {"fit": 1}  # a foreign graph: no quantize facts
    x = np.random.default_rng(5).standard_normal((2, 3, K)).astype(np.float32)
    expected = _ort(model, {"x": x})[0]
    # the only difference left is float16 scales: 2^-11 relative
    np.testing.assert_allclose(
        reference.run(low, {"x": x}, fp16=False)["y"], expected, rtol=0, atol=1e-3 * np.abs(expected).max()
    )
    np.testing.assert_allclose(
        reference.run(low, {"x": x})["y"], expected, rtol=0, atol=0.01 * np.abs(expected).max()
    )
    assert precheck.check_ops(ir.from_proto(low), "g", lowered=True) == []


def test_reference_ascend_quant_rounds_half_to_even_and_clips():
    x = np.array([0.5, 1.5, 2.5, -0.5, 300.0, -300.0], np.float32)
    assert reference.ascend_quant(x, 1.0, 0.0).tolist() == [0, 2, 2, 0, 127, -128]
    assert reference.ascend_quant(np.array([1.0], np.float32), 1.0, 3.0).tolist() == [4]


def test_reference_deq_scale_packing_round_trips():
    values = np.array([0.001, 2.5e-5, 1.0], np.float32)
    packed = reference.pack_deq_scale(values)
    assert packed.dtype == np.uint64 and int(packed[2]) == 0x3F800000
    np.testing.assert_array_equal(reference.unpack_deq_scale(packed), values)
    acc = np.array([[1000, -40000, 3]], np.int32)
    np.testing.assert_allclose(reference.ascend_dequant(acc, packed, fp16=False), acc * values)


def test_reference_antiquant():
    y = reference.ascend_antiquant(np.array([-3, 0, 5], np.int8), scale=0.5, offset=1.0, fp16=False)
    np.testing.assert_allclose(y, [-2.0, -0.5, 2.0])


def _tiny_decoder() -> onnx.ModelProto:
    """A decoder step: present = Concat(past, new); a Shape of the past measures the past length."""
    nodes = [
        helper.make_node("Unsqueeze", ["inputs_embeds", "ax1"], ["k_new"], name="to_heads"),
        helper.make_node("Concat", ["past_key_values.0.key", "k_new"], ["present.0.key"], name="cat", axis=2),
        helper.make_node("Shape", ["past_key_values.0.key"], ["pshape"], name="past_shape"),
        helper.make_node("Gather", ["pshape", "two"], ["plen"], name="past_len", axis=0),
        helper.make_node("Cast", ["plen"], ["plen_f"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Add", ["inputs_embeds", "plen_f"], ["logits"], name="use_len"),
    ]
    g = helper.make_graph(
        nodes,
        "d",
        [
            helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, ["batch", "sequence", 4]),
            helper.make_tensor_value_info(
                "past_key_values.0.key", TensorProto.FLOAT, ["batch", 1, "past_sequence", 4]
            ),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 4]),
            helper.make_tensor_value_info(
                "present.0.key", TensorProto.FLOAT, ["batch", 1, "total_sequence", 4]
            ),
        ],
        [
            numpy_helper.from_array(np.array([1], np.int64), "ax1"),
            numpy_helper.from_array(np.array(2, np.int64), "two"),
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_strip_past_makes_an_equivalent_prefill_graph():
    model = _tiny_decoder()
    prefill, empties = lower.strip_past(ir.from_proto(model), "decoder")
    prefill = ir.to_proto(prefill)
    assert empties == 1
    assert [i.name for i in prefill.graph.input] == ["inputs_embeds"]
    assert "Concat" not in [n.op_type for n in prefill.graph.node if n.name == "cat"]
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    expected = _ort(model, {"inputs_embeds": x, "past_key_values.0.key": np.zeros((2, 1, 0, 4), np.float32)})
    got = _ort(prefill, {"inputs_embeds": x})
    for e, g_ in zip(expected, got):
        np.testing.assert_array_equal(e, g_)


def test_docs_list_every_rule_with_its_sources():
    """docs/ascend.md has a row per lowering rule naming its module, and cites every file the rule cites."""
    import re
    from pathlib import Path

    from vlmc.backends.ascend import rules

    doc = (Path(__file__).resolve().parents[1] / "docs" / "ascend.md").read_text()
    for rule in rules.default_rules():
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{rule.name}` ")), None)
        assert row is not None, f"docs/ascend.md has no table row for {rule.name}"
        for cited in rule.source.split("; "):
            repo, _, rest = cited.partition(" ")
            assert repo.startswith(("hicann/", "ai.onnx")), cited
            path = re.split(r" \(", rest)[0]
            name = path.rsplit("/", 1)[-1]
            assert name in doc, f"{rule.name}: {name} (from {cited}) is not cited in docs/ascend.md"


def test_one_activation_quantizer_shared_by_three_matmuls():
    """q/k/v projections read one Q/DQ pair: three int8 MatMuls share one AscendQuant, nothing is left."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq"),
    ]
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
        numpy_helper.from_array(np.array(0, np.int8), "xz"),
    ]
    outs = []
    for p in ("q_proj", "k_proj", "v_proj"):
        inits += [
            numpy_helper.from_array(rng.integers(-127, 128, (8, 8)).astype(np.int8), f"{p}_wq"),
            numpy_helper.from_array(np.array(0.01, np.float32), f"{p}_ws"),
            numpy_helper.from_array(np.array(0, np.int8), f"{p}_wz"),
        ]
        nodes += [
            helper.make_node(
                "DequantizeLinear", [f"{p}_wq", f"{p}_ws", f"{p}_wz"], [f"{p}_w"], name=f"{p}_w_dq"
            ),
            helper.make_node("MatMul", ["xd", f"{p}_w"], [f"{p}_y"], name=p),
        ]
        outs.append(helper.make_tensor_value_info(f"{p}_y", TensorProto.FLOAT, [2, 8]))
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])], outs, inits
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    low, report = _lowered(model)
    assert sorted(report.quantized_layers) == ["k_proj", "q_proj", "v_proj"]
    assert [n.op_type for n in low.graph.node].count("AscendQuant") == 1
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in low.graph.node)
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    expected = _ort(model, {"x": x})
    got = reference.run(low, {"x": x}, fp16=False)
    for out, e in zip(low.graph.output, expected):
        np.testing.assert_allclose(got[out.name], e, rtol=1e-5, atol=1e-5)
