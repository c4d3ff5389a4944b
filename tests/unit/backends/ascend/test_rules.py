"""The Ascend lowering rules, one by one, on small onnx_ir graphs built here.

Each rewrite is checked for its form (the ops and weights ATC reads) and its numerics: the lowered
graph on the reference executor (vlmc/runtime/executors/reference.py) against the portable graph on
onnxruntime. The memory check lowers a graph of large memory-mapped weights in a subprocess and
bounds its peak RSS growth by a few weights, with an in-memory control that shows the check fails
when the lowering holds them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from vlmc import graphs, interop
from vlmc.backends.ascend import lower, precheck
from vlmc.errors import CheckFailed
from vlmc.runtime.executors import reference

FLOAT = ir.DataType.FLOAT


# ---- builders ----------------------------------------------------------------------------------


class _Builder:
    """A few-node graph: named inputs, initializers and nodes, in order."""

    def __init__(self, opset: int = 17) -> None:
        self.inputs: list[ir.Value] = []
        self.inits: list[ir.Value] = []
        self.nodes: list[ir.Node] = []
        self.opset = opset

    def input(self, name: str, shape, dtype=FLOAT) -> ir.Value:
        v = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        self.inputs.append(v)
        return v

    def init(self, name: str, array) -> ir.Value:
        t = ir.tensor(np.asarray(array), name=name)
        v = ir.Value(name=name, const_value=t, type=ir.TensorType(t.dtype), shape=t.shape)
        self.inits.append(v)
        return v

    def op(self, op_type: str, inputs, name: str, out: str | None = None, **attrs) -> ir.Value:
        node = ir.node(op_type, inputs, attrs or None, name=name)
        node.outputs[0].name = out or f"{name}_out"
        self.nodes.append(node)
        return node.outputs[0]

    def model(self, outputs: list[ir.Value], shapes=None) -> ir.Model:
        for i, o in enumerate(outputs):
            o.type = ir.TensorType(FLOAT)
            if shapes is not None:
                o.shape = ir.Shape(shapes[i])
        g = ir.Graph(
            self.inputs, outputs, nodes=self.nodes, initializers=self.inits, opset_imports={"": self.opset}
        )
        return ir.Model(g, ir_version=10 if self.opset >= 21 else 8)


def _ort(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # ORT fuses DQ+MatMul into its own quantized kernels; the QDQ semantics are the unfused ones.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(interop.session_bytes(model), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _node(model: ir.Model, op_type: str) -> ir.Node:
    return next(n for n in model.graph if n.op_type == op_type)


def _qdq_matmul(k=16, n=8, zp=0, bias=True, seed=0) -> ir.Model:
    """x -> Q -> DQ -> MatMul <- DQ(int8 W, per tensor) -> (Add bias) -> y."""
    rng = np.random.default_rng(seed)
    b = _Builder()
    x = b.input("x", [2, k])
    xs, xz = b.init("xs", np.float32(0.02)), b.init("xz", np.int8(zp))
    xq = b.op("QuantizeLinear", [x, xs, xz], "q")
    xd = b.op("DequantizeLinear", [xq, xs, xz], "dq")
    w = b.op(
        "DequantizeLinear",
        [
            b.init("Wq", rng.integers(-127, 128, (k, n)).astype(np.int8)),
            b.init("Ws", np.float32(0.01)),
            b.init("Wz", np.int8(0)),
        ],
        "w_dq",
    )
    y = b.op("MatMul", [xd, w], "mm", out="m" if bias else "y")
    if bias:
        y = b.op("Add", [y, b.init("bias", rng.standard_normal(n).astype(np.float32))], "add", out="y")
    return b.model([y], [[2, n]])


# ---- qdq_matmul ----------------------------------------------------------------------------------


@pytest.mark.parametrize("zp", [0, -7])
def test_qdq_matmul_becomes_ascend_quant_int8_matmul_dequant(zp):
    model = _qdq_matmul(zp=zp)
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    (expected,) = _ort(model, {"x": x})
    low, report = lower.lower(model, "g")
    assert _ops(low) == ["AscendQuant", "MatMul", "Add", "AscendDequant"]
    assert report.quantized_layers == ["mm"] and report.rules["qdq_matmul"]["applied"] == 1
    assert report.asymmetric_layers == (["mm"] if zp else [])
    quant, mm, add, deq = list(low.graph)
    assert quant.attributes["scale"].value == pytest.approx(1 / 0.02, rel=1e-6)
    assert quant.attributes["offset"].value == zp and quant.attributes["dst_type"].value == "INT8"
    assert mm.inputs[1].const_value.dtype == ir.DataType.INT8
    assert add.inputs[1].const_value.dtype == ir.DataType.INT32
    s_deq = reference.unpack_deq_scale(deq.inputs[1].const_value.numpy())
    assert s_deq.shape == (1,) and s_deq[0] == pytest.approx(0.02 * 0.01, rel=1e-6)
    # the graph output is the dequant's, under its old name and type
    assert [o.name for o in low.graph.outputs] == ["y"] and low.graph.outputs[0].producer() is deq
    assert low.graph.outputs[0].dtype == FLOAT
    assert precheck.check_ops(low, "g", lowered=True) == []
    # GE's offset correction applies the zero point; with it, the deploy form equals the QDQ graph
    got = reference.run(low, {"x": x}, fp16=False)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_symmetric_int8_deploy_weight_points_at_the_package_bytes(tmp_path):
    """A stored symmetric int8 weight is its own deploy form: the lowered graph points at it (no copy)."""
    interop.save(_qdq_matmul(k=64, n=32), tmp_path / "g.onnx")  # 2 KiB weight: external data
    x = {"x": np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)}
    source = graphs.load_ir(tmp_path / "g.onnx").graph.initializers["Wq"].const_value
    store = interop.TensorStore(tmp_path / "lowered.data")
    low, _ = lower.lower(graphs.load_ir(tmp_path / "g.onnx"), "g", store=store)
    store.close()
    weight = _node(low, "MatMul").inputs[1].const_value
    assert isinstance(weight, ir.ExternalTensor) and weight.name != "Wq"
    assert (Path(weight.path), weight.offset, weight.length) == (
        Path(source.path),
        source.offset,
        source.length,
    )
    # the same build as a lowering that copies the weight (in memory, no store)
    held, _ = lower.lower(graphs.load_ir(tmp_path / "g.onnx"), "g")
    for where, model in (("a", low), ("b", held)):
        (tmp_path / where).mkdir()
        interop.save(model, tmp_path / where / "g.onnx")
    for name in ("g.onnx", "g.onnx.data"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    np.testing.assert_array_equal(
        reference.run(low, x, fp16=False)["y"], reference.run(held, x, fp16=False)["y"]
    )


def test_one_ascend_quant_serves_every_matmul_of_a_tensor():
    rng = np.random.default_rng(2)
    b = _Builder()
    x = b.input("x", [2, 8])
    xs, xz = b.init("xs", np.float32(0.05)), b.init("xz", np.int8(0))
    xd = b.op("DequantizeLinear", [b.op("QuantizeLinear", [x, xs, xz], "q"), xs, xz], "dq")
    outs = []
    for p in ("q_proj", "k_proj"):
        wq, ws, wz = (
            b.init(f"{p}_wq", rng.integers(-127, 128, (8, 8)).astype(np.int8)),
            b.init(f"{p}_ws", np.float32(0.01)),
            b.init(f"{p}_wz", np.int8(0)),
        )
        outs.append(b.op("MatMul", [xd, b.op("DequantizeLinear", [wq, ws, wz], f"{p}_dq")], p, out=p))
    model = b.model(outs, [[2, 8], [2, 8]])
    feed = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    expected = _ort(model, feed)
    low, report = lower.lower(model, "g")
    assert _ops(low).count("AscendQuant") == 1 and sorted(report.quantized_layers) == ["k_proj", "q_proj"]
    got = reference.run(low, feed, fp16=False)
    for name, e in zip(("q_proj", "k_proj"), expected):
        np.testing.assert_allclose(got[name], e, rtol=1e-5, atol=1e-5)


def test_qdq_matmul_refuses_an_activation_scale_beyond_fp16_naming_the_node():
    model = _qdq_matmul()
    model.graph.initializers["xs"].const_value = ir.tensor(np.float32(1e-6), name="xs")
    with pytest.raises(CheckFailed, match=r"mm \(MatMul\).*beyond fp16"):
        lower.lower(model, "g")


# ---- qdq_conv ------------------------------------------------------------------------------------


def test_qdq_conv_per_channel_becomes_int8_conv_with_channel_deq_scale():
    rng = np.random.default_rng(3)
    cout = 4
    wq = rng.integers(-127, 128, (cout, 3, 3, 3)).astype(np.int8)
    ws = (rng.random(cout).astype(np.float32) + 0.5) * 0.01
    b = _Builder()
    x = b.input("x", [1, 3, 6, 6])
    xs, xz = b.init("xs", np.float32(0.03)), b.init("xz", np.int8(0))
    xd = b.op("DequantizeLinear", [b.op("QuantizeLinear", [x, xs, xz], "q"), xs, xz], "dq")
    w = b.op(
        "DequantizeLinear",
        [b.init("Wq", wq), b.init("Ws", ws), b.init("Wz", np.zeros(cout, np.int8))],
        "w_dq",
        axis=0,
    )
    bias = b.init("B", rng.standard_normal(cout).astype(np.float32) * 0.1)
    y = b.op("Conv", [xd, w, bias], "conv", out="y", pads=[1, 1, 1, 1])
    model = b.model([y], [[1, cout, 6, 6]])
    feed = {"x": rng.standard_normal((1, 3, 6, 6)).astype(np.float32)}
    (expected,) = _ort(model, feed)
    low, report = lower.lower(model, "g")
    assert _ops(low) == ["AscendQuant", "Conv", "AscendDequant"] and report.quantized_layers == ["conv"]
    conv = _node(low, "Conv")
    assert list(conv.attributes["pads"].value) == [1, 1, 1, 1]  # the attributes carry over
    assert conv.inputs[1].const_value.dtype == ir.DataType.INT8
    assert conv.inputs[2].const_value.dtype == ir.DataType.INT32
    deq = _node(low, "AscendDequant")
    np.testing.assert_allclose(
        reference.unpack_deq_scale(deq.inputs[1].const_value.numpy()), ws * np.float32(0.03)
    )
    got = reference.run(low, feed, fp16=False)["y"]
    # the only difference: the bias rounded to the int32 accumulator's grid, half a step of s_w * s_x
    step = float((ws * np.float32(0.03)).max())
    np.testing.assert_allclose(got, expected, rtol=0, atol=0.5 * step + 1e-6)
    assert np.abs(got - expected).max() > 0  # (and it is there: the check is not vacuous)


# ---- weight_only_matmul --------------------------------------------------------------------------


def _packed_int4_matmul(k=64, n=32, group=32, seed=4) -> tuple[ir.Model, dict, np.ndarray, np.ndarray]:
    """quantize's int4 form: uint8 [k/2, n], row 2i low nibble, row 2i+1 high, stored q+8; grouped scales."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (k, n)).astype(np.int8)
    scale = (rng.random((k // group, 1, n)).astype(np.float32) + 0.5) * 0.05
    u = (q + 8).astype(np.uint8)
    packed = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    b = _Builder(opset=18)
    x = b.input("x", [2, 3, k])
    p = b.init("w_packed", packed)
    lo = b.op(
        "Unsqueeze",
        [b.op("BitwiseAnd", [p, b.init("mask", np.uint8(0x0F))], "lo"), b.init("ax", np.array([1]))],
        "lo1",
    )
    hi = b.op(
        "Unsqueeze",
        [
            b.op("BitShift", [p, b.init("four", np.uint8(4))], "hi", direction="RIGHT"),
            b.init("ax_", np.array([1])),
        ],
        "hi1",
    )
    rows = b.op("Reshape", [b.op("Concat", [lo, hi], "pair", axis=1), b.init("kn", np.array([k, n]))], "rows")
    wf = b.op("Sub", [b.op("Cast", [rows], "cast", to=FLOAT), b.init("eight", np.float32(8))], "center")
    wg = b.op("Reshape", [wf, b.init("gshape", np.array([k // group, group, n]))], "group")
    w = b.op(
        "Reshape",
        [b.op("Mul", [wg, b.init("w_scale", scale)], "scale"), b.init("kn_", np.array([k, n]))],
        "ungroup",
    )
    y = b.op("MatMul", [x, w], "proj", out="y")
    model = b.model([y], [[2, 3, n]])
    facts = {
        "weights": {
            "dtype": "int4",
            "group_size": group,
            "nodes": {"proj": {"axis": 1, "weight": "w_packed", "scale": "w_scale", "storage": "packed"}},
        }
    }
    return model, facts, q, scale.reshape(k // group, n)


@pytest.mark.parametrize("int4_weights", ["int8", "int4"])
def test_weight_only_int4_groups_become_weight_quant_batch_matmul_from_the_facts(int4_weights, tmp_path):
    model, facts, q, scale = _packed_int4_matmul()
    feed = {"x": np.random.default_rng(5).standard_normal((2, 3, 64)).astype(np.float32)}
    (expected,) = _ort(model, feed)
    assert expected.shape == (2, 3, 32)
    store = interop.TensorStore(tmp_path / "lowered.data")
    low, report = lower.lower(model, "g", {"quantization": facts}, int4_weights=int4_weights, store=store)
    store.close()
    assert _ops(low) == ["NPUWeightQuantBatchMatmulV2"]
    node = _node(low, "NPUWeightQuantBatchMatmulV2")
    assert {k: a.value for k, a in node.attributes.items()} == {
        "antiquant_group_size": 32,
        "transpose_weight": 0,
        "transpose_x": 0,
    }
    assert report.weight_only_sources == {"facts": 1} and report.int4_storage == int4_weights
    weight = node.inputs[1].const_value
    # the deploy weight is not made during the lowering (neither in memory nor in the store): it is
    # unpacked from the source's packed int4 when the build's data file is written
    assert isinstance(weight, ir.LazyTensor) and not weight.cache
    assert (tmp_path / "lowered.data").stat().st_size == 0
    assert weight.dtype == (ir.DataType.INT8 if int4_weights == "int8" else ir.DataType.INT4)
    assert weight.nbytes == (64 * 32 if int4_weights == "int8" else 64 * 32 // 2)
    np.testing.assert_array_equal(weight.numpy().astype(np.int8), q)
    interop.save(low, tmp_path / "low.onnx")
    written = graphs.load_ir(tmp_path / "low.onnx").graph.initializers[node.inputs[1].name].const_value
    assert isinstance(written, ir.ExternalTensor) and written.dtype == weight.dtype
    np.testing.assert_array_equal(written.numpy().astype(np.int8), q)
    assert written.tobytes() == weight.tobytes()
    antiquant = node.inputs[2].const_value.numpy()
    assert antiquant.dtype == np.float16 and np.array_equal(antiquant, scale.astype(np.float16))
    # the source's packed weight and its dequant subgraph are gone
    assert set(low.graph.initializers) == {node.inputs[1].name, node.inputs[2].name}
    got = reference.run(low, feed, fp16=False)["y"]
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-3 * np.abs(expected).max())  # fp16 scales


def test_weight_only_group_size_the_npu_refuses_is_one_line_naming_the_node():
    from vlmc.errors import VlmcError

    model, facts, _, _ = _packed_int4_matmul(k=64, group=16)
    with pytest.raises(VlmcError, match=r"proj \(MatMul\): antiquant_group_size 16 is refused"):
        lower.lower(model, "g", {"quantization": facts})


# ---- leftover_qdq --------------------------------------------------------------------------------


def test_leftover_activation_pair_becomes_clip_and_constant_dq_becomes_antiquant():
    rng = np.random.default_rng(6)
    b = _Builder()
    x = b.input("x", [4, 8])
    s, z = b.init("s", np.float32(0.05)), b.init("z", np.uint8(128))
    fake = b.op("DequantizeLinear", [b.op("QuantizeLinear", [x, s, z], "q"), s, z], "fake_dq")
    const = b.op(
        "DequantizeLinear",
        [
            b.init("c_q", rng.integers(-100, 100, (4, 8)).astype(np.int8)),
            b.init("c_s", np.float32(0.1)),
            b.init("c_z", np.int8(3)),
        ],
        "const_dq",
    )
    y = b.op("Add", [fake, const], "add", out="y")
    model = b.model([y], [[4, 8]])
    feed = {"x": (rng.standard_normal((4, 8)) * 10).astype(np.float32)}
    (expected,) = _ort(model, feed)
    low, report = lower.lower(model, "g")
    assert report.fake_quant_clips == 1 and report.antiquant_constants == 1
    assert sorted(_ops(low)) == ["Add", "AscendAntiQuant", "Clip"]
    clip = _node(low, "Clip")
    lo, hi = (v.const_value.numpy() for v in clip.inputs[1:])
    assert lo == np.float32(0.05 * (0 - 128)) and hi == np.float32(0.05 * (255 - 128))
    anti = _node(low, "AscendAntiQuant")
    assert anti.attributes["offset"].value == 3.0 and anti.attributes["scale"].value == pytest.approx(0.1)
    # Clip keeps the range the pair clamps to but not the rounding to its grid: half a step apart
    got = reference.run(low, feed, fp16=False)["y"]
    np.testing.assert_allclose(got, expected, rtol=0, atol=0.5 * 0.05 + 1e-5)
    assert np.abs(got).max() > 5  # the clamp is exercised (inputs beyond the range)


def test_leftover_per_axis_constant_dq_is_folded():
    rng = np.random.default_rng(7)
    b = _Builder()
    x = b.input("x", [2, 3])
    wq = rng.integers(-50, 50, (2, 3)).astype(np.int8)
    s = np.array([0.1, 0.2, 0.3], np.float32)
    c = b.op(
        "DequantizeLinear",
        [b.init("cq", wq), b.init("cs", s), b.init("cz", np.zeros(3, np.int8))],
        "cdq",
        axis=1,
    )
    model = b.model([b.op("Mul", [x, c], "mul", out="y")], [[2, 3]])
    low, report = lower.lower(model, "g")
    assert report.folded_constants == 1 and _ops(low) == ["Identity", "Mul"]
    np.testing.assert_allclose(_node(low, "Identity").inputs[0].const_value.numpy(), wq * s)
    feed = {"x": rng.standard_normal((2, 3)).astype(np.float32)}
    np.testing.assert_allclose(reference.run(low, feed, fp16=False)["y"], _ort(model, feed)[0], rtol=1e-6)


# ---- memory: one weight at a time ----------------------------------------------------------------

_LAYERS, _K = 8, 2048  # eight [2048, 2048] int4 weights: 2 MiB packed, 4 MiB each once lowered to int8

_MEASURE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from vlmc import graphs, interop
    from vlmc.backends.ascend import lower

    def status(key):  # kB -> bytes
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

    path, facts, store_path = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    model = graphs.load_ir(path)  # weights memory-mapped, nothing read
    # The peak is this process's own from here (getrusage's ru_maxrss survives exec, so a child
    # would report its parent's peak): reset the high-water mark to the current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    store = interop.TensorStore(store_path) if store_path != "-" else None
    low, report = lower.lower(model, "g", {"quantization": facts}, store=store)
    print(json.dumps({"growth": status("VmHWM") - before, "layers": len(report.weight_only_layers)}))
    """
)


@pytest.fixture(scope="module")
def big_weight_graph(tmp_path_factory) -> tuple[Path, dict]:
    """x -> N weight-only int4 MatMuls, saved with its weights in a data file (built one layer at a time)."""
    d = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    b = _Builder(opset=17)
    h = b.input("x", [1, _K])
    nodes = {}
    for i in range(_LAYERS):
        packed = rng.integers(0, 256, (_K // 2, _K), dtype=np.uint8)
        p = b.init(f"w{i}_packed", packed)
        scale = b.init(f"w{i}_scale", np.full((_K // 128, 1, _K), 0.01, np.float32))
        # the portable subgraph only has to hold a dequantization; the rule reads the facts
        w = b.op(
            "Reshape", [b.op("Cast", [p], f"cast{i}", to=FLOAT), b.init(f"s{i}", np.array([_K, _K]))], f"r{i}"
        )
        w = b.op("Mul", [w, b.op("Reshape", [scale, b.init(f"k{i}", np.array([1, _K]))], f"rs{i}")], f"dq{i}")
        h = b.op("MatMul", [h, w], f"mm{i}")
        nodes[f"mm{i}"] = {"axis": 1, "weight": f"w{i}_packed", "scale": f"w{i}_scale", "storage": "packed"}
    interop.save(b.model([h], [[1, _K]]), d / "g.onnx")
    return d / "g.onnx", {"weights": {"dtype": "int4", "group_size": 128, "nodes": nodes}}


def _growth(path: Path, facts: dict, store: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[4])}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), json.dumps(facts), store],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lowering_holds_about_one_weight_however_many_there_are(big_weight_graph, tmp_path):
    path, facts = big_weight_graph
    lowered = _K * _K  # bytes of one int8 deploy weight
    streamed = _growth(path, facts, str(tmp_path / "lowered.data"))
    assert streamed["layers"] == _LAYERS
    # One layer's working set: its lowered int8 weight and the unpacking's temporaries (about one
    # more), whatever the layer count; all eight would be 8 weights.
    assert streamed["growth"] < 2.5 * lowered, streamed
    # The control: the same lowering with its weights kept in memory grows by all of them, so the
    # measurement above can tell the two apart.
    held = _growth(path, facts, "-")
    assert held["growth"] > (_LAYERS - 1) * lowered, held


def test_naming_keeps_omitted_optional_outputs_and_names_unnamed_nodes():
    from vlmc.backends.ascend.rules import Graph

    b = _Builder()
    x = b.input("x", [2, 4])
    drop = ir.node("Dropout", [x], num_outputs=2, name="")
    drop.outputs[0].name, drop.outputs[1].name = "d", ""  # the mask output is omitted
    b.nodes.append(drop)
    model = b.model([b.op("Relu", [drop.outputs[0]], "", out="y")], [[2, 4]])
    Graph(model)  # what every rule and strip_past start from
    # onnx-ir's NameFixPass names the unnamed nodes; the omitted output stays omitted (not computed)
    assert [n.name for n in model.graph] == ["Dropout_0", "Relu_1"]
    assert list(ir.to_proto(model).graph.node[0].output) in (["d"], ["d", ""])  # trailing "" may go
