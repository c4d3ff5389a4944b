"""report.py's weight accounting on hand-built onnx-ir graphs: bytes per dtype and stored copies,
from dtypes, shapes and file locations only (memory-mapped weights are never read)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from vlmc import graphs, interop, report


def _model(weights: dict[str, np.ndarray]) -> ir.Model:
    x = ir.val("x", ir.DataType.FLOAT, [4])
    values = [ir.Value(name=n, const_value=ir.tensor(a, name=n)) for n, a in weights.items()]
    nodes, last = [], x
    for v in values:  # y = x + sum(w) for every weight w
        cast = ir.node("CastLike", [v, x])
        total = ir.node("ReduceSum", [cast.outputs[0]], {"keepdims": 0})
        add = ir.node("Add", [last, total.outputs[0]])
        nodes += [cast, total, add]
        last = add.outputs[0]
    last.name = "y"
    const = ir.node("Constant", [], {"value": ir.tensor(np.arange(3, dtype=np.int32))})
    nodes.append(const)
    graph = ir.Graph([x], [last], nodes=nodes, initializers=values, opset_imports={"": 17})
    return ir.Model(graph, ir_version=10)


WEIGHTS = {
    "big": np.ones((16, 64), np.float32),  # 4 KiB: stored in the data file
    "half": np.ones((8, 128), np.float16),  # 2 KiB: stored in the data file
    "small": np.ones(3, np.int64),  # 24 B: stays inside the .onnx file
}


def test_weight_dtypes_and_regions_read_no_weight(tmp_path):
    interop.save(_model(WEIGHTS), tmp_path / "g.onnx")
    model = graphs.load_ir(tmp_path / "g.onnx")
    external = [
        v.const_value
        for v in model.graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor)
    ]
    assert len(external) == 2

    assert report.weight_dtypes(model) == {"float16": 2048, "float32": 4096, "int64": 24}
    regions = report.weight_regions(model)
    # two file regions, the inline int64 weight and the Constant's 3 x int32, keyed by content
    assert sorted(regions.values()) == [12, 24, 2048, 4096]
    data = str((tmp_path / "g.onnx.data").resolve())
    assert sum(1 for key in regions if key.startswith(data + "@")) == 2
    assert all(t.raw is None for t in external)  # no data file was mapped


def test_a_weight_two_graphs_share_is_one_stored_copy(tmp_path):
    first, second = _model(WEIGHTS), _model({"big": WEIGHTS["big"]})
    interop.save_shared({tmp_path / "a.onnx": first, tmp_path / "b.onnx": second}, tmp_path / "shared.data")
    a, b = graphs.load_ir(tmp_path / "a.onnx"), graphs.load_ir(tmp_path / "b.onnx")
    stored = {**report.weight_regions(a), **report.weight_regions(b)}
    assert graphs.initializer_bytes(a) == 4096 + 2048 + 24 + 12 and graphs.initializer_bytes(b) == 4096 + 12
    # b's big weight (one region of the shared file) and its Constant are the same stored copies as a's
    assert sum(stored.values()) == graphs.initializer_bytes(a)
