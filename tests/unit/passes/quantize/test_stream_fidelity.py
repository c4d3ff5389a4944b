"""Streamed per-graph fidelity (passes/quantize/stream_fidelity.py) on small hand-built IR graphs.

The graph is run segment by segment; its outputs must be the whole graph's, FP32 and weight-only
alike, and the peak RSS one segment's weights, not the graph's.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx_ir as ir

from vlmc import graphs, interop, ortsession
from vlmc.passes.quantize import fidelity, scheme, stream_fidelity, weight_only

from ..._child import peak_growth


def _init(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    v = ir.Value(name=name, const_value=ir.tensor(arr, name=name))
    v.shape, v.dtype = v.const_value.shape, v.const_value.dtype
    graph.register_initializer(v)
    return v


def _decoder_like(layers: int, width: int, seed: int = 0) -> ir.Model:
    """x[s, w], bias[w] -> per layer i: h = (x + bias) @ W_i; x = x + relu(h) @ V_i; present_i = h;
    then y = (x + bias / 2) @ W_out. ``bias`` is read by every layer (like a mask or rotary table: it crosses every
    cut) and each layer makes a graph output of its own (like a decoder's present KV)."""
    rng = np.random.default_rng(seed)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["s", width]))
    bias_in = ir.Value(name="bias", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([width]))
    graph = ir.Graph([x, bias_in], [], nodes=[], opset_imports={"": 17}, name="g")
    scaled = ir.node("Mul", [bias_in, _init(graph, "half", np.array(0.5, np.float32))], name="bias_scale")
    scaled.outputs[0].name = "bias_scaled"
    graph.append(scaled)
    cur = x
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        v = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        nodes = [ir.node("Add", [cur, scaled.outputs[0]], name=f"l{i}/add_bias")]
        nodes.append(ir.node("MatMul", [nodes[-1].outputs[0], _init(graph, f"l{i}.w", w)], name=f"l{i}/w"))
        h = nodes[-1].outputs[0]
        nodes.append(ir.node("Relu", [h], name=f"l{i}/relu"))
        nodes.append(ir.node("MatMul", [nodes[-1].outputs[0], _init(graph, f"l{i}.v", v)], name=f"l{i}/v"))
        nodes.append(ir.node("Add", [cur, nodes[-1].outputs[0]], name=f"l{i}/residual"))
        for n in nodes:
            n.outputs[0].name = f"{n.name}_out"
            graph.append(n)
        graph.outputs.append(h)
        cur = nodes[-1].outputs[0]
    wo = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    last = ir.node("Add", [cur, scaled.outputs[0]], name="final_bias")
    last.outputs[0].name = "final_bias_out"
    graph.append(last)
    head = ir.node("MatMul", [last.outputs[0], _init(graph, "w_out", wo)], name="head")
    head.outputs[0].name = "y"
    graph.append(head)
    graph.outputs.append(head.outputs[0])
    return ir.Model(graph, ir_version=8)


def _feeds(width: int, n: int = 3) -> list[dict]:
    rng = np.random.default_rng(7)
    return [
        {
            "x": rng.standard_normal((4 + s, width)).astype(np.float32),
            "bias": rng.standard_normal(width).astype(np.float32),
        }
        for s in range(n)
    ]


def _whole(session, feeds: list[dict]) -> list[dict]:
    names = [o.name for o in session.get_outputs()]
    return [dict(zip(names, session.run(None, f))) for f in feeds]


def test_streamed_outputs_equal_the_whole_graph(tmp_path):
    width, layers = 64, 4
    model = graphs.load_ir(_saved(_decoder_like(layers, width), tmp_path / "g.onnx"))
    feeds = _feeds(width)
    layer_bytes = 2 * width * width * 4
    got, facts = stream_fidelity.run(model, feeds, ortsession.from_model, segment_bytes=layer_bytes)
    assert facts["segments"] >= layers  # one layer's weights per segment at most
    assert facts["largest_segment_weight_bytes"] <= layer_bytes
    want = _whole(ortsession.from_model(model), feeds)
    for g, w in zip(got, want):
        assert set(g) == set(w) == {f"l{i}/w_out" for i in range(layers)} | {"y"}
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-5)


def test_cuts_fall_where_fewest_values_cross():
    width, layers = 16, 3
    model = _decoder_like(layers, width)
    nodes = stream_fidelity.order(model.graph)
    positions = stream_fidelity.cuts(nodes, segment_bytes=2 * width * width * 4 + 64)  # a layer
    # Each cut but the last comes right after a layer's residual Add (x and bias_scaled cross there);
    # inside a layer the residual stream crosses beside the layer's own values.
    assert positions[-1] == len(nodes)
    # (After the last layer, once the final Add read the bias, only its output crosses.)
    assert [nodes[p - 1].name for p in positions[:-1]] == [f"l{i}/residual" for i in range(2)] + [
        "final_bias"
    ]


def test_order_puts_each_constant_chain_before_its_reader():
    width = 8
    model = _decoder_like(2, width)
    graph = model.graph
    # A dequantization-like chain on a weight, placed first in the graph (as a quantizer may put it).
    w8 = _init(graph, "l1.w_int8", np.ones((width, width), np.int8))
    cast = ir.node("Cast", [w8], {"to": ir.DataType.FLOAT}, name="dq/cast")
    mul = ir.node("Mul", [cast.outputs[0], _init(graph, "s", np.array(0.1, np.float32))], name="dq/mul")
    graph.insert_before(graph.node(0), [cast, mul])
    reader = next(n for n in graph if n.name == "l1/w")
    reader.replace_input_with(1, mul.outputs[0])
    names = [n.name for n in stream_fidelity.order(graph)]
    assert names.index("dq/mul") == names.index("l1/w") - 1
    assert names.index("dq/cast") == names.index("l1/w") - 2
    assert sorted(names) == sorted(n.name for n in graph)


def test_weight_only_fidelity_equals_the_whole_graph_fidelity(tmp_path):
    width, layers = 64, 3
    fp32 = graphs.load_ir(_saved(_decoder_like(layers, width), tmp_path / "g.onnx"))
    feeds = _feeds(width)
    refs = _whole(ortsession.from_model(fp32), feeds)
    streamed_refs, _ = stream_fidelity.run(fp32, feeds, ortsession.from_model, segment_bytes=1)
    plan = scheme.GraphScheme(key="g", weights="int4", group_size=32)
    quant, _ = weight_only.quantize_weight_only(fp32, plan, None)
    whole: dict = {}
    for ref, got in zip(refs, _whole(ortsession.dequantized(quant), feeds)):
        fidelity.accumulate(whole, ref, got)
    fid, facts = stream_fidelity.graph_fidelity(
        quant, "int4_weight_only", feeds, streamed_refs, segment_bytes=1
    )
    assert facts["segments"] > layers
    assert set(fid) == set(whole) and whole
    for k in whole:
        assert abs(fid[k]["cosine"] - whole[k]["cosine"]) < 1e-6, k
        assert abs(fid[k]["max_abs_diff"] - whole[k]["max_abs_diff"]) < 1e-5, k
        assert fid[k]["cosine"] < 1.0  # int4 moved the output: the comparison is not of a graph with itself


def _saved(model: ir.Model, path: Path) -> Path:
    interop.save(model, path)
    return path


_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from vlmc import graphs, ortsession
    from vlmc.passes.quantize import stream_fidelity

    def status(key):
        with open("/proc/self/status") as f:
            return int(f.read().split(key + ":")[1].split()[0]) * 1024

    path, mode, segment = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # A real segment (a 7B decoder layer, 0.8 GB) is above this, so its session computes from the
    # mapped data file; the small layers here take that path too.
    ortsession.STREAM_FROM_FILE_BYTES = 0
    model = graphs.load_ir(path)  # weights memory-mapped, none read yet
    rng = np.random.default_rng(0)
    width = model.graph.inputs[0].shape[1]
    feeds = [{"x": rng.standard_normal((8, width)).astype(np.float32),
              "bias": rng.standard_normal(width).astype(np.float32)}]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    if mode == "streamed":
        stream_fidelity.run(model, feeds, ortsession.from_model, segment_bytes=segment)
    else:
        sess = ortsession.from_model(model)
        sess.run(None, feeds[0])
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
    """
)


def _peak(path: Path, mode: str, segment: int) -> int:
    return peak_growth(_CHILD, str(path), mode, str(segment))


def test_streamed_peak_is_one_segment_not_the_graph(tmp_path):
    """10 layers of 2 x 4 MiB memory-mapped FP32 weights (84 MiB with the head); segments of one layer.

    The bound is a third of the graph's weights: the streamed run stays under it, and the whole-graph
    session on the same graph (the path above VLMC_MAX_FIDELITY_BYTES would otherwise take) does not,
    so the probe tells the two apart.
    """
    width, layers = 1024, 10
    layer_bytes = 2 * width * width * 4
    path = _saved(_decoder_like(layers, width), tmp_path / "g.onnx")
    total = layers * layer_bytes + width * width * 4
    streamed = _peak(path, "streamed", layer_bytes)
    whole = _peak(path, "whole", layer_bytes)
    assert streamed < total / 3, (streamed, total)
    assert whole > total / 3, (whole, total)
