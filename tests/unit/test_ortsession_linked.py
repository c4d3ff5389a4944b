"""ortsession.from_model on an IR graph whose weights live in files: nothing but the proto is written."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx_ir as ir

from vlmc import graphs, interop, ortsession


def _chain(n: int, width: int, rng) -> tuple[ir.Model, list[np.ndarray]]:
    x = ir.Value(name="x", shape=ir.Shape([1, width]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 17}, name="chain")
    weights, h = [], x
    for i in range(n):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        weights.append(w)
        wv = ir.Value(name=f"w{i}", const_value=ir.tensor(w, name=f"w{i}"))
        graph.register_initializer(wv)
        node = ir.node("MatMul", [h, wv], name=f"mm{i}")
        graph.append(node)
        h = node.outputs[0]
        h.name = f"h{i}"
    graph.outputs.append(h)
    return ir.Model(graph, ir_version=9), weights


def _disk_bytes(directory: str) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for f in files:
            st = os.lstat(os.path.join(root, f))  # a link's own blocks, not its target's
            total += st.st_blocks * 512
    return total


def test_session_on_file_backed_graph_writes_only_the_proto(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    model, weights = _chain(4, 512, rng)  # 4 x 1 MiB of weights
    path = tmp_path / "pkg" / "chain.onnx"
    path.parent.mkdir()
    interop.save(model, path)
    loaded = graphs.load_ir(path)  # weights are ExternalTensors in chain.onnx.data
    # A change in memory (as a pass makes): one more small in-memory weight and a new output.
    extra = (rng.standard_normal((512, 512)) / 16).astype(np.float32)
    ev = ir.Value(name="w_new", const_value=ir.tensor(extra, name="w_new"))
    loaded.graph.register_initializer(ev)
    node = ir.node("MatMul", [loaded.graph.outputs[0], ev], name="mm_new")
    loaded.graph.append(node)
    node.outputs[0].name = "y"
    loaded.graph.outputs[0] = node.outputs[0]
    weight_bytes = graphs.initializer_bytes(loaded)
    assert weight_bytes >= 5 * 512 * 512 * 4

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.setattr(ortsession, "STREAM_FROM_FILE_BYTES", 1 << 20)  # take the large-graph path
    before = _disk_bytes(str(tmp_path))
    written: list[int] = []  # temp-dir bytes at the moment a session would open from a file
    real = ortsession.from_path

    def measuring(p, threads=None, precision=None):
        written.append(_disk_bytes(str(scratch)))
        return real(p, threads, precision)

    monkeypatch.setattr(ortsession, "from_path", measuring)
    sess = ortsession.from_model(loaded)
    assert all(n < 64 << 10 for n in written), written
    # Nothing was written: not the 4 MiB in the package's file, not the 1 MiB held in memory.
    assert _disk_bytes(str(tmp_path)) - before < 64 << 10
    assert not list(scratch.iterdir())
    x = rng.standard_normal((1, 512)).astype(np.float32)
    ref = x
    for w in [*weights, extra]:
        ref = ref @ w
    (got,) = sess.run(["y"], {"x": x})
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    # The package's data file is untouched and still readable by onnx-ir (no hard links were made).
    assert os.stat(str(path) + ".data").st_nlink == 1
    assert graphs.load_ir(path).graph.initializers["w0"].const_value.numpy().shape == (512, 512)
