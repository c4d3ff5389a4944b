"""Streaming quantization on small hand-built IR graphs: row blocks, the scratch store, calibration stride."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from vlmc import graphs, interop, ortsession
from vlmc.passes.quantize import scheme, static, weight_only
from vlmc.passes.quantize.calib import FeedReader


def _matmul_ir(w: np.ndarray, rows: int = 3) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape([rows, w.shape[0]]), type=ir.TensorType(ir.DataType.FLOAT))
    wv = ir.Value(name="w", const_value=ir.tensor(w, name="w"))
    wv.shape, wv.dtype = wv.const_value.shape, wv.const_value.dtype
    mm = ir.node("MatMul", [x, wv], name="mm", outputs=[ir.Value(name="y")])
    mm.outputs[0].dtype = ir.DataType.FLOAT
    mm.outputs[0].shape = ir.Shape([rows, w.shape[1]])
    g = ir.Graph([x], mm.outputs, nodes=[mm], initializers=[wv], opset_imports={"": 17}, name="g")
    return ir.Model(g, ir_version=10)


def _on_disk(model: ir.Model, tmp_path) -> ir.Model:
    """The model saved and reopened, so its weight is an ExternalTensor read from the file."""
    interop.save(model, tmp_path / "m.onnx")
    out = graphs.load_ir(tmp_path / "m.onnx")
    assert isinstance(out.graph.initializers["w"].const_value, ir.ExternalTensor)
    return out


@pytest.mark.parametrize("weights, storage", [("int4", "packed"), ("int4", "int8"), ("int8", "packed")])
def test_row_blocks_give_the_whole_array_result_bit_for_bit(weights, storage, tmp_path, monkeypatch):
    monkeypatch.setattr(weight_only, "_BLOCK_BYTES", 1)  # one group (or row) per block
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 24)).astype(np.float32)
    model = _on_disk(_matmul_ir(w), tmp_path)
    plan = scheme.GraphScheme(key="g", weights=weights, group_size=32, int4_storage=storage)
    store = interop.TensorStore(tmp_path / "q.data")
    out, facts = weight_only.quantize_weight_only(model, plan, None, store)
    store.close()
    inits = {n: v.const_value.numpy() for n, v in out.graph.initializers.items()}
    if weights == "int4":
        q, s = weight_only.quant_int4_group(w, 32)
        expect = weight_only.pack_int4(q) if storage == "packed" else q
        name = "w_int4_packed" if storage == "packed" else "w_int4"
        np.testing.assert_array_equal(inits["w_scale"].reshape(s.shape), s)
    else:
        expect, s = weight_only.quant_int8_channel(w)
        name = "w_int8"
        np.testing.assert_array_equal(inits["w_scale"], s)
    np.testing.assert_array_equal(inits[name], expect)
    assert "w" not in out.graph.initializers and facts["nodes_quantized"] == ["mm"]
    # the quantized weight lives in the scratch file, with its hash recorded as it was written
    t = out.graph.initializers[name].const_value
    assert isinstance(t, ir.ExternalTensor) and t.path == str(tmp_path / "q.data")
    assert interop.tensor_hash(t) == interop.tensor_hash(ir.tensor(expect))
    interop.check(out, "g")
    x = rng.standard_normal((3, 128)).astype(np.float32)
    y = ortsession.from_model(out, precision=f"{weights}_weight_only").run(None, {"x": x})[0]
    ref = ortsession.from_model(out).run(None, {"x": x})[0]  # constant folding on: the same numbers
    np.testing.assert_array_equal(y, ref)


def test_exact_ops_after_int4_packed_and_nothing_eligible_is_left_alone():
    w = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
    model = _matmul_ir(w)
    plan = scheme.GraphScheme(key="g", weights="int4", group_size=32)
    out, _ = weight_only.quantize_weight_only(model, plan, None)
    assert [n.op_type for n in out.graph] == [
        "Cast", "Div", "Mul", "Sub", "Unsqueeze", "Unsqueeze", "Concat", "Reshape", "Cast", "Sub",
        "Mul", "Reshape", "MatMul",
    ]  # fmt: skip
    # negative: an input size that is not a multiple of the group is skipped, the graph unchanged
    odd = _matmul_ir(np.ones((48, 8), np.float32))
    before = interop.fingerprint(odd)
    plan = scheme.GraphScheme(key="g", weights="int4", group_size=32)
    same, facts = weight_only.quantize_weight_only(odd, plan, None)
    assert facts["nodes_quantized"] == [] and "mm" in facts["nodes_skipped"]
    assert interop.fingerprint(same) == before


def test_calibration_one_sample_at_a_time_keeps_the_global_min_max():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    feeds = [{"x": (rng.standard_normal((3, 16)) * (i + 1)).astype(np.float32)} for i in range(4)]
    plan = scheme.GraphScheme(
        key="g", weights="int8", activations="int8", calibration=scheme.Calibration(count=4)
    )
    _, facts = static.quantize_int8(_matmul_ir(w), FeedReader(feeds), plan)
    amax = max(float(np.abs(f["x"]).max()) for f in feeds)
    # symmetric int8: scale = max|x| / 127 over every sample, though each was seen alone
    assert facts["activations"]["tensors"]["x"]["scale"] == pytest.approx(amax / 127, rel=1e-6)
    reader = static._OneAtATime(FeedReader(feeds))
    assert len(reader) == 4
    reader.set_range(1, 2)
    assert reader.get_next() is feeds[1] and reader.get_next() is None


def test_int32_bias_on_the_ir_replaces_the_float_bias():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    model = _matmul_ir(w)
    b = ir.Value(name="b", const_value=ir.tensor(rng.standard_normal(8).astype(np.float32), name="b"))
    b.shape, b.dtype = b.const_value.shape, b.const_value.dtype
    model.graph.register_initializer(b)
    mm = next(iter(model.graph))
    add = ir.node("Add", [mm.outputs[0], b], name="add", outputs=[ir.Value(name="z")])
    model.graph.append(add)
    model.graph.outputs[0] = add.outputs[0]
    add.outputs[0].dtype, add.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([3, 8])
    feeds = [{"x": rng.standard_normal((3, 16)).astype(np.float32)} for _ in range(2)]
    plan = scheme.GraphScheme(
        key="g", weights="int8", activations="int8", calibration=scheme.Calibration(count=2)
    )
    out, facts = static.quantize_int8(model, FeedReader(feeds), plan)
    assert facts["matmul_bias_int32"] == 1 and "b" not in out.graph.initializers
    add = next(n for n in out.graph if n.op_type == "Add")
    dq = add.inputs[1].producer()
    assert dq.op_type == "DequantizeLinear" and dq.inputs[0].const_value.dtype == ir.DataType.INT32
    onnx.checker.check_model(ir.to_proto(out), full_check=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and inf casts, in the worker threads too
@pytest.mark.parametrize("threads", [1, 2])
def test_threaded_blocks_match_the_whole_array_reference_on_edge_values(threads, tmp_path, monkeypatch):
    """The streamed int4/int8 kernels (in-place, threaded, fewer passes) give the reference's bits.

    Edge values: all-zero and negative-zero groups, subnormals, ±inf, NaN and near-max floats; the
    weight is read from its file and from memory, one group per block and a whole block.
    """
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 24)).astype(np.float32)
    w[:32, :3] = 0.0
    w[:32, 3] = -0.0
    w[5, 4] = np.float32(1e-45)
    w[32:64, 5] = np.float32(1e-44) * rng.standard_normal(32).astype(np.float32)
    w[70, 6], w[71, 7], w[72, 8], w[100, 9] = np.inf, -np.inf, np.nan, 3e38
    monkeypatch.setattr(weight_only, "_THREADS", threads)
    on_disk = _on_disk(_matmul_ir(w), tmp_path).graph.initializers["w"].const_value
    with np.errstate(all="ignore"):
        q4, s4 = weight_only.quant_int4_group(w, 32)
        q8, s8 = weight_only.quant_int8_channel(w)
        for block in (1, 1 << 20):
            monkeypatch.setattr(weight_only, "_BLOCK_BYTES", block)
            for t in (on_disk, ir.tensor(w.copy())):
                packed, s = weight_only._int4_streamed(t, 32, True)
                np.testing.assert_array_equal(packed, weight_only.pack_int4(q4))
                np.testing.assert_array_equal(s.view(np.uint32), s4.view(np.uint32))
                np.testing.assert_array_equal(weight_only._int4_streamed(t, 32, False)[0], q4)
                q, s = weight_only._int8_streamed(t)
                np.testing.assert_array_equal(q, q8)
                np.testing.assert_array_equal(s.view(np.uint32), s8.view(np.uint32))
                np.testing.assert_array_equal(t.numpy(), w)  # the source is not changed in place


def _two_matmuls_ir(rng) -> ir.Model:
    """x -> MatMul(w1) -> Relu -> MatMul(w2) -> y: the second MatMul reads an intermediate activation."""
    model = _matmul_ir(rng.standard_normal((16, 12)).astype(np.float32))
    mm = next(iter(model.graph))
    relu = ir.node("Relu", [mm.outputs[0]], name="relu", outputs=[ir.Value(name="r")])
    w2 = ir.Value(
        name="w2", const_value=ir.tensor(rng.standard_normal((12, 8)).astype(np.float32), name="w2")
    )
    w2.shape, w2.dtype = w2.const_value.shape, w2.const_value.dtype
    model.graph.register_initializer(w2)
    mm2 = ir.node("MatMul", [relu.outputs[0], w2], name="mm2", outputs=[ir.Value(name="z")])
    model.graph.extend([relu, mm2])
    model.graph.outputs[0] = mm2.outputs[0]
    mm2.outputs[0].dtype, mm2.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([3, 8])
    return model


def test_minmax_ranges_from_the_cache_equal_the_calibrators_bit_for_bit(monkeypatch, tmp_path):
    """int8 minmax takes its ranges from vlmc's session through onnxruntime's calibration cache;
    the quantized graph is the one onnxruntime's own calibrator gives (forced by failing the cache)."""
    rng = np.random.default_rng(4)
    feeds = [{"x": (rng.standard_normal((3, 16)) * (i + 1)).astype(np.float32)} for i in range(3)]
    plan = scheme.GraphScheme(
        key="g", weights="int8", activations="int8", calibration=scheme.Calibration(count=3)
    )
    cached = []
    real = static._minmax_cache
    monkeypatch.setattr(static, "_minmax_cache", lambda *a: cached.append(real(*a)) or cached[-1])
    out, facts = static.quantize_int8(_two_matmuls_ir(rng), FeedReader(feeds), plan)
    assert cached and cached[0] is not None  # the cache was written and used
    assert set(facts["activations"]["tensors"]) == {"x", "r"}
    monkeypatch.setattr(static, "_minmax_cache", lambda *a: None)  # the calibrator's way
    rng = np.random.default_rng(4)
    feeds2 = [{"x": (rng.standard_normal((3, 16)) * (i + 1)).astype(np.float32)} for i in range(3)]
    ref, ref_facts = static.quantize_int8(_two_matmuls_ir(rng), FeedReader(feeds2), plan)
    assert interop.fingerprint(out) == interop.fingerprint(ref)
    assert facts == ref_facts
    # negative: an activation that is not finite leaves the ranges to the calibrator (no cache)
    bad = [{"x": np.full((3, 16), np.inf, np.float32)}]
    model = _two_matmuls_ir(rng)
    interop.save(model, tmp_path / "fp32.onnx")
    assert real(model, ["mm", "relu", "mm2"], {"mm", "mm2"}, FeedReader(bad), tmp_path / "fp32.onnx") is None
