"""The ort backend: the package lowered for onnxruntime (MatMulNBits), runnable with `vlmc run BUILD`."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from vlmc import backends, graphs, manager, recipe
from vlmc.backends import ort as ort_backend
from vlmc.backends.ort import matmul_nbits
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.passes.quantize import weight_only

PROMPT = "Describe the image."


def test_ort_compile_writes_a_runnable_package(tiny_llava, tmp_path):
    from vlmc.runtime import Pipeline

    pkg = Package.load(tiny_llava)
    out = tmp_path / "build"
    summary = backends.get("ort").compile(pkg, out, {"backend": "ort"})
    assert pkg.root == tiny_llava  # the caller's package still points at its own directory
    assert json.loads((out / "compile.json").read_text()) == summary
    assert (out / "vlmc-build.json").is_file() and set(summary["graphs"]) == set(pkg.graph_names)
    assert not any("lowering" in g for g in summary["graphs"].values())  # nothing quantized to lower
    compiled = Package.load(out / "package")
    expected = Pipeline(pkg).generate([PROMPT], [["demo"]], max_new_tokens=4).tokens
    got = Pipeline(compiled).generate([PROMPT], [["demo"]], max_new_tokens=4).tokens
    assert got == expected and len(got[0]) > 0


def test_ort_target_options():
    # Targets are validated (recipe load, `vlmc compile`) before any backend's compile sees them.
    names = ["matmul_nbits", "accuracy_level", "fuse_norms", "fuse_rotary", "fuse_attention", "last_logits"]
    assert [o.name for o in ort_backend.TARGET_OPTIONS] == names
    with pytest.raises(VlmcError, match=r"unknown option 'soc'; valid options: " + ", ".join(names)):
        backends.validate_target({"backend": "ort", "soc": "Ascend910B3"})
    with pytest.raises(VlmcError, match="accuracy_level"):
        backends.validate_target({"backend": "ort", "accuracy_level": 5})
    assert backends.validate_target({"backend": "ort"}) == {
        "backend": "ort",
        "matmul_nbits": True,
        "accuracy_level": 4,
        "fuse_norms": True,
        "fuse_rotary": True,
        "fuse_attention": True,
        "last_logits": True,
    }


@pytest.fixture(scope="module")
def quantized(tiny_llava, tmp_path_factory):
    """quantized("int4" | "int8") -> a tiny LLaVA package whose decoder is weight-only quantized (RTN)."""
    cache = {}

    def get(weights: str):
        if weights not in cache:
            scheme = {"weights": weights, **({"group_size": 32} if weights == "int4" else {})}
            steps = recipe.from_dict(
                {"passes": [{"quantize": {"decoder": scheme, "eval_samples": 0, "eval_tokens": 0}}]}
            ).steps
            out = tmp_path_factory.mktemp(f"ort-{weights}") / "pkg"
            manager.run(Package.load(tiny_llava), steps).save(out)
            cache[weights] = out
        return cache[weights]

    return get


def _ops(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _run(*args) -> dict:
    res = CliRunner().invoke(
        main, [*args, "--prompt", PROMPT, "--image", "demo", "--max-new-tokens", "8", "--json"]
    )
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_weight_only_matmuls_become_matmul_nbits_with_the_same_tokens(quantized, tmp_path, weights):
    src = quantized(weights)
    pkg = Package.load(src)
    facts = pkg.info("decoder")["quantization"]
    out = tmp_path / "build"
    summary = backends.get("ort").compile(pkg, out, {"backend": "ort", "accuracy_level": 1})
    lowering = summary["graphs"]["decoder"]["lowering"]
    assert lowering["nodes_lowered"] == len(facts["nodes_quantized"]) > 0 and lowering["nodes_kept"] == {}
    assert lowering["bits"] == (4 if weights == "int4" else 8)
    build = Package.load(out / "package")
    model = build.model("decoder")
    ops = _ops(model)
    assert ops.get("MatMulNBits") == lowering["nodes_lowered"]
    assert model.opset_imports["com.microsoft"] == 1
    # The dequant chains and the integer weights they read are gone; the package itself is untouched.
    assert not [n for n in model.graph.initializers if n.endswith(("_int8", "_int4_packed", "_scale"))]
    assert "MatMulNBits" not in _ops(Package.load(src).model("decoder"))
    assert build.info("decoder")["precision"] == pkg.info("decoder")["precision"]
    for node in model.graph:
        if node.op_type == "MatMulNBits":
            assert node.domain == "com.microsoft" and node.attributes["accuracy_level"].value == 1
    # float activations: the kernel computes the same products as the package's dequantized MatMul
    for diff in lowering["check"]["outputs"].values():
        assert diff["rms_relative"] <= ort_backend.TOLERANCE["float"]
    assert _run("run", str(out))["tokens"] == _run("run", str(src))["tokens"]


def test_int8_activations_by_default_and_run_against_the_package(quantized, tmp_path):
    src = quantized("int4")
    out = tmp_path / "build"
    summary = backends.get("ort").compile(Package.load(src), out, {"backend": "ort"})
    check = summary["graphs"]["decoder"]["lowering"]["check"]
    assert check["activations"] == "int8" and summary["options"]["accuracy_level"] == 4
    logits = check["outputs"]["logits"]
    assert 0 < logits["rms_relative"] <= ort_backend.TOLERANCE["int8"] and logits["max_abs_diff"] > 0
    got = _run("run", str(out), "--against", str(src))
    assert got["agreement"]["tokens"] == len(got["tokens"][0]) > 0
    assert got["agreement"]["max_logit_diff"] >= 0


def test_executor_is_refused_for_an_ort_build(quantized, tmp_path):
    out = tmp_path / "build"
    backends.get("ort").compile(Package.load(quantized("int8")), out, {"backend": "ort"})
    res = CliRunner().invoke(main, ["run", str(out), "--executor", "reference", "--prompt", PROMPT])
    assert res.exit_code == 2 and "runs on onnxruntime" in res.output


@pytest.mark.parametrize("storage", ["packed", "int8"])
def test_int4_packing_follows_the_matmul_nbits_contract(storage):
    # ContribOperators.md: B (N, k_blocks, block/2), value 2j of a block in the low nibble of byte j,
    # 2j+1 in the high one; dequant (u - 8) * scales[n, block] with the default zero point 8.
    rng = np.random.default_rng(0)
    k, n, g = 128, 24, 32
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, scale = weight_only.quant_int4_group(w, g)
    stored = weight_only.pack_int4(q) if storage == "packed" else q
    b, s, block, kk = matmul_nbits._pack(
        {"group_size": g, "storage": storage}, 4, stored, scale.reshape(k // g, 1, n)
    )
    assert b.shape == (n, k // g, g // 2) and s.shape == (n, k // g) and block == g and kk == k
    lo, hi = (b & 0x0F).astype(np.float32), (b >> 4).astype(np.float32)
    u = np.stack([lo, hi], axis=-1).reshape(n, k // g, g)
    deq = ((u - 8) * s[:, :, None]).reshape(n, k).T
    np.testing.assert_array_equal(deq, weight_only.dequant_int4(q, scale, g))


def test_int8_packing_pads_k_to_whole_blocks():
    rng = np.random.default_rng(1)
    k, n = 200, 8  # not a multiple of the 128-row block
    q, scale = weight_only.quant_int8_channel(rng.standard_normal((k, n)).astype(np.float32))
    b, s, block, kk = matmul_nbits._pack({"group_size": None}, 8, q, scale)
    assert block == 128 and b.shape == (n, 2, 128) and s.shape == (n, 2) and kk == k
    deq = ((b.reshape(n, -1).astype(np.float32) - 128) * np.repeat(s, block, axis=1)).T
    np.testing.assert_array_equal(deq[:k], q.astype(np.float32) * scale)
    assert not deq[k:].any()  # the padding rows add nothing


def test_matmul_nbits_runs_on_onnxruntime_like_the_dequantized_matmul():
    # One INT4 MatMul quantized by the pass's own code, lowered, and run on onnxruntime both ways.
    from vlmc import ortsession
    from vlmc.passes.quantize import scheme as qscheme

    rng = np.random.default_rng(2)
    k, n = 64, 48
    x = ir.Value(name="x", shape=ir.Shape([1, 3, k]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", const_value=ir.tensor(rng.standard_normal((k, n)).astype(np.float32), name="w"))
    y = ir.Value(name="y", shape=ir.Shape([1, 3, n]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.node("MatMul", [x, w], name="mm", outputs=[y])
    graph = ir.Graph([x], [y], nodes=[node], initializers=[w], opset_imports={"": 17})
    model = ir.Model(graph, ir_version=9)
    plan = qscheme.GraphScheme(key="g", weights="int4", group_size=32)
    model, facts = weight_only.quantize_weight_only(model, plan, None)
    feed = {"x": rng.standard_normal((1, 3, k)).astype(np.float32)}
    ref = ortsession.from_model(model).run(None, feed)[0]
    lowered = model.clone()
    out = matmul_nbits.lower(lowered, facts, accuracy_level=1, store=None)
    assert out["nodes_lowered"] == 1 and _ops(lowered) == {"MatMulNBits": 1}
    assert graphs.initializer_bytes(lowered) == k * n // 2 + (k // 32) * n * 4
    got = ortsession.from_model(lowered).run(None, feed)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
