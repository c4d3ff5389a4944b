"""A session over file-backed IR weights holds them once: no copy beside the mapped file pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx_ir as ir

from vlmc import graphs

_WIDTH, _LAYERS = 2048, 8  # 8 x 16 MiB of FP32 weights

_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from vlmc import graphs, ortsession

    def status(key):
        with open("/proc/self/status") as f:
            return int(f.read().split(key + ":")[1].split()[0]) * 1024

    model = graphs.load_ir(sys.argv[1])  # weights are memory-mapped ExternalTensors, none read yet
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = status("VmRSS")
    session = ortsession.{factory}(model)
    created = status("VmHWM") - before
    x = np.ones((1, {width}), np.float32)
    (y,) = session.run(None, {{"x": x}})
    ran = status("VmHWM") - before
    np.save(sys.argv[2], y)
    print(created, ran)
    """
)


def _chain(path) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", shape=ir.Shape([1, _WIDTH]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 17}, name="chain")
    h, ref = x, np.ones((1, _WIDTH), np.float64)
    for i in range(_LAYERS):
        w = (rng.standard_normal((_WIDTH, _WIDTH)) / np.sqrt(_WIDTH)).astype(np.float32)
        ref = ref @ w
        wv = ir.Value(name=f"w{i}", const_value=ir.tensor(w, name=f"w{i}"))
        graph.register_initializer(wv)
        node = ir.node("MatMul", [h, wv], name=f"mm{i}")
        graph.append(node)
        h = node.outputs[0]
        h.name = f"h{i}"
    graph.outputs.append(h)
    graphs.save(ir.Model(graph, ir_version=9), path)
    return ref


def _measure(tmp_path, factory: str) -> tuple[int, int, np.ndarray, np.ndarray]:
    path = tmp_path / "chain.onnx"
    ref = _chain(path)
    out = tmp_path / "y.npy"
    code = _CHILD.format(factory=factory, width=_WIDTH)
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(out)], capture_output=True, text=True, check=True
    )
    created, ran = (int(v) for v in done.stdout.split())
    return created, ran, np.load(out), ref


def test_linked_session_holds_file_weights_once(tmp_path):
    weights = _LAYERS * _WIDTH * _WIDTH * 4
    created, ran, y, ref = _measure(tmp_path, "from_model")
    # Before: onnxruntime copied every weight while the mapped pages it read from were resident
    # (creation alone +2.0x the weights). Now it computes from the maps: pages count once, when read.
    assert created < 0.3 * weights, (created, weights)
    assert ran < 1.2 * weights, (ran, weights)
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
