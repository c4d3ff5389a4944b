"""A session over file-backed IR weights holds them once: no copy beside the mapped file pages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx_ir as ir

from vlmc import interop

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
    interop.save(ir.Model(graph, ir_version=9), path)
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


_DEQUANT_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from vlmc import graphs, ortsession

    def resident(suffix):  # resident bytes of this process's maps of files named *suffix
        total, mapped = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and ":" not in head[0]:
                    mapped = len(head) > 5 and head[-1].endswith(suffix)
                elif mapped and head[0] == "Rss:":
                    total += int(head[1]) * 1024
        return total

    model = graphs.load_ir(sys.argv[1])
    session = ortsession.dequantized(model)
    created = resident(".onnx.data")  # the integer weights' data file
    (y,) = session.run(None, {"x": np.ones((1, %d), np.float32)})
    np.save(sys.argv[2], y)
    print(created)
    """
)


def test_dequantized_session_drops_the_integer_weight_pages(tmp_path):
    # Each int8 weight is dequantized by a Cast -> Mul chain run once; the chains read the integer
    # weights through maps the session keeps. Their pages used to stay resident for the session's
    # life beside the float weights (the 512 M real-width INT4 decoder: 85 MiB).
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", shape=ir.Shape([1, _WIDTH]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 17}, name="int8_chain")
    h, ref = x, np.ones((1, _WIDTH), np.float64)
    for i in range(_LAYERS):
        q = rng.integers(-127, 128, (_WIDTH, _WIDTH), dtype=np.int8)
        s = np.float32(1 / (64 * np.sqrt(_WIDTH)))
        ref = ref @ (q.astype(np.float64) * np.float64(s))
        qv = ir.Value(name=f"q{i}", const_value=ir.tensor(q, name=f"q{i}"))
        sv = ir.Value(name=f"s{i}", const_value=ir.tensor(np.array(s), name=f"s{i}"))
        graph.register_initializer(qv)
        graph.register_initializer(sv)
        cast = ir.node("Cast", [qv], {"to": ir.DataType.FLOAT}, name=f"cast{i}")
        mul = ir.node("Mul", [cast.outputs[0], sv], name=f"mul{i}")
        mm = ir.node("MatMul", [h, mul.outputs[0]], name=f"mm{i}")
        graph.extend([cast, mul, mm])
        h = mm.outputs[0]
        h.name = f"h{i}"
    graph.outputs.append(h)
    path, out = tmp_path / "int8.onnx", tmp_path / "y.npy"
    interop.save(ir.Model(graph, ir_version=9), path)
    code = _DEQUANT_CHILD % _WIDTH
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(out)], capture_output=True, text=True, check=True
    )
    created = int(done.stdout)
    int8_bytes = _LAYERS * _WIDTH * _WIDTH
    assert created < 0.25 * int8_bytes, (created, int8_bytes)  # before: >= 1x, every integer page
    y = np.load(out)
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
