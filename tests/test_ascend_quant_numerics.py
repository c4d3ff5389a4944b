"""The quantize pass's own output, lowered from its recorded facts, against onnxruntime on the QDQ graph.

The numpy reference executor models what the NPU computes (GE's offset correction, float16 antiquant
parameters), so agreement here within the quantization step means the lowered graph computes what the
portable graph does. Also: the group sizes and INT4 numerics of NPUWeightQuantBatchMatmulV2, and the
refusal of a group size the NPU does not take.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from vlmc.backends.ascend import lower, ops, precheck
from vlmc.errors import VlmcError
from vlmc.passes.quantize import calib, scheme, static, weight_only
from vlmc.runtime.executors import reference

K, HID, N = 256, 256, 64


def _weight_only(model: onnx.ModelProto, plan, feeds):
    """The pass's weight-only step on the IR of ``model``; the result back as a proto for inspection."""
    m, facts = weight_only.quantize_weight_only(ir.from_proto(model), plan, feeds)
    return ir.to_proto(m), facts


def _int8(model: onnx.ModelProto, reader, plan):
    """The pass's static INT8 step on the IR of ``model``; the result back as a proto for inspection."""
    m, facts = static.quantize_int8(ir.from_proto(model), reader, plan)
    return ir.to_proto(m), facts


def _mlp(seed: int = 0, K: int = K, HID: int = HID) -> onnx.ModelProto:  # noqa: N803
    """x[1, 4, K] -> MatMul -> Add(bias) -> Relu -> MatMul -> y[1, 4, N], fixed seed."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((K, HID)) / np.sqrt(K)).astype(np.float32)
    b1 = (rng.standard_normal(HID) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((HID, N)) / np.sqrt(HID)).astype(np.float32)
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["m1"], name="fc1"),
            helper.make_node("Add", ["m1", "b1"], ["a1"], name="fc1_bias"),
            helper.make_node("Relu", ["a1"], ["r1"], name="relu"),
            helper.make_node("MatMul", ["r1", "w2"], ["y"], name="fc2"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, N])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(b1, "b1"),
            numpy_helper.from_array(w2, "w2"),
        ],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 4, K)).astype(np.float32)} for _ in range(n)]


def _ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # ORT would fuse DQ -> MatMul into kernels that quantize differently; the QDQ semantics are unfused.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _plan(opts: dict, target: str = "ascend") -> scheme.GraphScheme:
    return scheme.parse_graph("mlp", opts, "quantize", scheme.Calibration(), scheme.KeepFp32(), target)


def _lower(model: onnx.ModelProto, facts: dict, int4_weights: str = "int8"):
    """The lowering on the IR of ``model``; the result back as a proto for inspection."""
    low, report = lower.lower(ir.from_proto(model), "mlp", {"quantization": facts}, int4_weights=int4_weights)
    return ir.to_proto(low), report


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_symmetric_int8_lowered_matches_onnxruntime_within_one_step():
    plan = _plan({"weights": "int8", "activations": "int8"})
    assert plan.activation_symmetric  # the default for target ascend
    q, facts = _int8(_mlp(), calib.FeedReader(_feeds(8)), plan)
    assert facts["activations"]["symmetric"] is True and facts["target"] == "ascend"
    assert all(e["granularity"] == "per_tensor" for e in facts["weights"]["nodes"].values())
    assert all(t["zero_point"] == 0 for t in facts["activations"]["tensors"].values())
    low, report = _lower(q, facts)
    assert sorted(report.quantized_layers) == ["fc1", "fc2"] and report.rules["qdq_matmul"]["applied"] == 2
    assert report.asymmetric_layers == [] and report.notes == []
    inits = _inits(low)
    for n in low.graph.node:
        if n.op_type == "AscendQuant":
            assert {a.name: helper.get_attribute_value(a) for a in n.attribute}["offset"] == 0.0
        if n.op_type == "AscendDequant":
            assert inits[n.input[1]].shape == (1,)  # one deq_scale value behind each MatMul
    assert reference.ge_offset_correction(low)[1] == 0
    # the last layer's dequant step: its output is not requantized, so one step of its input
    # quantizer (from a rounding tie broken differently) moves y by at most s_x2 * max|w2| per term
    s_x2 = facts["activations"]["tensors"]["r1"]["scale"]
    for feed in _feeds(3, seed=9):
        expected = _ort(q, feed)
        got = reference.run(low, feed, fp16=False)["y"]
        step = s_x2 * float(
            np.abs(numpy_helper.to_array(next(t for t in _mlp().graph.initializer if t.name == "w2"))).max()
        )
        np.testing.assert_allclose(got, expected, rtol=0, atol=2 * step)
        # almost every value is exact: the int32 accumulation equals the float sum of dequantized terms
        assert np.mean(np.abs(got - expected) <= 1e-4 * np.abs(expected).max()) > 0.95


@pytest.mark.parametrize("int4_weights", ["int8", "int4"])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("storage", ["packed", "int8"])
def test_int4_lowered_from_facts_matches_onnxruntime(group, storage, int4_weights):
    model = _mlp()
    w1 = numpy_helper.to_array(model.graph.initializer[0])
    plan = _plan({"weights": "int4", "group_size": group, "int4_storage": storage})
    q, facts = _weight_only(model, plan, None)
    facts.pop("_weight_bytes")
    assert facts["weights"]["group_size"] == group  # the key lowering reads (not facts["group_size"])
    low, report = _lower(q, facts, int4_weights)
    assert report.weight_only_sources == {"facts": 2} and report.weight_only_bits == 4
    assert report.int4_storage == int4_weights
    if int4_weights == "int8":  # the default: said plainly
        assert any("INT4 runs with INT8 storage on Ascend" in n for n in report.notes)
    else:  # ONNX INT4, two per byte (GE DT_INT4 layout), IR 10
        assert any("unverified on hardware" in n.lower() for n in report.notes)
        assert low.ir_version >= 10
        packed = [t for t in low.graph.initializer if t.data_type == onnx.TensorProto.INT4]
        assert len(packed) == 2 and all(len(t.raw_data) * 2 == np.prod(t.dims) for t in packed)
    inits = _inits(low)
    mm = [n for n in low.graph.node if n.op_type == "NPUWeightQuantBatchMatmulV2"]
    assert [n.name for n in mm] == ["fc1", "fc2"]
    for n in mm:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["antiquant_group_size"] == group
        wq, scale = inits[n.input[1]], inits[n.input[2]]
        k = wq.shape[0]
        assert group % 32 == 0 and group <= k - 1
        assert wq.dtype == (np.int8 if int4_weights == "int8" else ml_dtypes.int4)
        assert wq.astype(np.int8).min() >= -8 and wq.astype(np.int8).max() <= 7
        assert scale.dtype == np.float16 and scale.shape == (k // group, wq.shape[1])
        assert len(n.input) == 3  # symmetric: no antiquant_offset
    # INT4 numerics: the lowered (weight, scale) are the quantize pass's RTN values for fc1
    q1, s1 = weight_only.quant_int4_group(w1, group)
    np.testing.assert_array_equal(inits[mm[0].input[1]].astype(np.int8), q1)
    np.testing.assert_array_equal(inits[mm[0].input[2]], s1.astype(np.float16))
    np.testing.assert_allclose(
        reference.dequant_weight(inits[mm[0].input[1]], inits[mm[0].input[2]], None, group),
        weight_only.dequant_int4(q1, s1, group),
        rtol=2**-10,
    )
    for feed in _feeds(2, seed=5):
        expected = _ort(q, feed)
        got = reference.run(low, feed, fp16=False)["y"]
        # only the float16 antiquant scales differ from the QDQ graph: 2^-11 relative per weight
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-3 * np.abs(expected).max())
        on_npu = reference.run(low, feed)["y"]
        np.testing.assert_allclose(on_npu, expected, rtol=0, atol=1e-2 * np.abs(expected).max())
    assert precheck.check_ops(ir.from_proto(low), "mlp", lowered=True) == []


def test_group_as_large_as_k_becomes_per_channel():
    model = _mlp()
    plan = _plan({"weights": "int4", "group_size": 256})  # k = 256 for both layers: one group
    q, facts = _weight_only(model, plan, None)
    low, _ = _lower(q, facts)
    mm = [n for n in low.graph.node if n.op_type == "NPUWeightQuantBatchMatmulV2"]
    assert len(mm) == 2
    for n in mm:
        assert {a.name: helper.get_attribute_value(a) for a in n.attribute}["antiquant_group_size"] == 0
        assert _inits(low)[n.input[2]].shape == (_inits(low)[n.input[1]].shape[1],)


@pytest.mark.parametrize("group", [48, 112])
def test_group_size_the_npu_refuses_is_refused_by_quantize_for_ascend(group):
    with pytest.raises(VlmcError, match=rf"group_size={group} is refused by the NPU.*multiple of 32") as e:
        _plan({"weights": "int4", "group_size": group})
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert _plan({"weights": "int4", "group_size": group}, target="portable").group_size == group


def test_group_size_the_npu_refuses_is_refused_by_compile():
    """A package quantized for target portable with group 48 cannot be built for the NPU."""
    model = _mlp(K=96, HID=96)  # 48 divides 96: quantize (portable) takes it
    q, facts = _weight_only(model, _plan({"weights": "int4", "group_size": 48}, "portable"), None)
    assert facts["nodes_quantized"] == ["fc1", "fc2"]
    with pytest.raises(VlmcError, match=r"fc1 \(MatMul\): antiquant_group_size 48 is refused") as e:
        _lower(q, facts)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_cli_refuses_an_illegal_group_size_in_one_line(tiny_llava, tmp_path):
    from vlmc.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("passes:\n  - quantize:\n      decoder: {weights: int4, group_size: 112}\n")
    result = CliRunner().invoke(
        main, ["optimize", str(tiny_llava), "-r", str(recipe), "-o", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("vlmc:")]
    assert len(errors) == 1 and "group_size=112 is refused by the NPU" in errors[0]
    assert not (tmp_path / "o").exists()


def test_asymmetric_activations_are_an_explicit_option_in_amct_form():
    plan = _plan({"weights": "int8", "activations": "int8", "activation_symmetric": False})
    q, facts = _int8(_mlp(), calib.FeedReader(_feeds(8)), plan)
    assert facts["activations"]["symmetric"] is False
    low, report = _lower(q, facts)
    offsets = [
        {a.name: helper.get_attribute_value(a) for a in n.attribute}["offset"]
        for n in low.graph.node
        if n.op_type == "AscendQuant"
    ]
    assert any(o != 0 for o in offsets)  # x is symmetric-ish, but Relu's output is all positive
    assert report.asymmetric_layers and any("unverified on hardware" in n for n in report.notes)
    # AMCT's bias: round(b/(s_w*s_x)) with no zero-point term
    inits = _inits(low)
    add = next(n for n in low.graph.node if n.op_type == "Add" and n.name.startswith("fc1"))
    s_deq = reference.unpack_deq_scale(inits["fc1_deq_scale"])
    b1 = numpy_helper.to_array(_mlp().graph.initializer[1]).astype(np.float64)
    np.testing.assert_array_equal(
        inits[add.input[1]], np.rint(b1 / s_deq.astype(np.float64)).astype(np.int32)
    )
    for feed in _feeds(2, seed=4):
        expected = _ort(q, feed)
        got = reference.run(low, feed, fp16=False)["y"]
        assert np.mean(np.abs(got - expected) <= 1e-4 * np.abs(expected).max()) > 0.95


def test_npu_domain_lists_every_op_the_parsers_register():
    assert len(ops.NPU_DOMAIN_OPS) == 32
    assert {"WeightQuantBatchMatmulV2", "NPURmsNorm", "NPURotaryMul", "NPUAddRmsNorm"} <= ops.NPU_DOMAIN_OPS
    assert ops.supported("NPURmsNorm", "npu", {"": 17, "npu": 1})
    assert not ops.supported("NPURmsNorm", "npu", {"": 17})  # the npu domain needs its own opset_import
    assert not ops.supported("NPUWeightQuantBatchMatmulV2", "npu", {"": 17, "npu": 1})  # no NPU prefix there


def test_plan_says_int4_runs_with_int8_storage_on_ascend():
    from vlmc import budget

    graphs = [budget.GraphWeights("decoder", "decoder", "int4_weight_only", 1000, 500)]
    spec = budget.Spec(
        name="toy",
        graphs=graphs,
        layers=2,
        kv_heads=4,
        head_dim=8,
        kv_dtype="float16",
        tokens_per_image=10,
        tokens_per_image_unpruned=10,
        max_positions=100,
        hidden=32,
        heads=4,
        intermediate=64,
        vocab=50,
    )
    notes = budget.fit(spec, 1_000_000, text_tokens=13).notes
    assert [n for n in notes if "INT4 runs with INT8 storage on Ascend (decoder)" in n and "500 B more" in n]
    graphs[0].precision = "fp16"
    assert not [n for n in budget.fit(spec, 1_000_000, text_tokens=13).notes if "INT4" in n]


def test_conv_stays_per_channel_and_matches_onnxruntime():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    b = (rng.standard_normal(8) * 0.1).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    q, facts = _int8(model, calib.FeedReader(feeds), _plan({"weights": "int8", "activations": "int8"}))
    assert facts["weights"]["nodes"]["conv"]["granularity"] == "per_channel"
    assert facts["weights"]["nodes"]["conv"]["axis"] == 0
    low, report = _lower(q, facts)
    assert [n.op_type for n in low.graph.node] == ["AscendQuant", "Conv", "AscendDequant"]
    assert report.rules["qdq_conv"]["applied"] == 1
    deq = low.graph.node[2]
    assert _inits(low)[deq.input[1]].shape == (8,)  # one deq_scale per output channel
    expected = _ort(q, feeds[0])
    got = reference.run(low, feeds[0], fp16=False)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
