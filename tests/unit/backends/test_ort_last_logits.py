"""vlmc.backends.ort.last_logits: the LM head for the last position only, on onnxruntime and through compile."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import backends, ortsession, samples
from vlmc.backends.ort import last_logits
from vlmc.package import Package

FLOAT = ir.DataType.FLOAT
SEQ, HIDDEN, VOCAB = 5, 8, 11


def _head(weight_from_input: bool = False) -> ir.Model:
    """inputs_embeds -> Mul(gain) -> MatMul(lm_head) -> logits (the weight an initializer or a graph input)."""
    rng = np.random.default_rng(0)
    tape = ir.tape.Tape()
    x = ir.val("inputs_embeds", FLOAT, [1, SEQ, HIDDEN])
    inputs = [x]
    gain = tape.initializer(ir.tensor(rng.standard_normal(HIDDEN).astype(np.float32), name="gain"))
    if weight_from_input:
        w = ir.val("lm_head", FLOAT, [HIDDEN, VOCAB])
        inputs.append(w)
    else:
        w = tape.initializer(
            ir.tensor(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), name="lm_head")
        )
    h = tape.op("Mul", [x, gain])
    logits = tape.op("MatMul", [h, w])
    logits.name, logits.shape, logits.type = "logits", ir.Shape([1, SEQ, VOCAB]), ir.TensorType(FLOAT)
    h.shape, h.type = ir.Shape([1, SEQ, HIDDEN]), ir.TensorType(FLOAT)
    graph = ir.Graph(
        inputs, [logits], nodes=tape.nodes, initializers=tape.initializers, opset_imports={"": 17}
    )
    return ir.Model(graph, ir_version=8)


def _run(model: ir.Model, feeds: dict) -> np.ndarray:
    return ortsession.from_model(model).run(["logits"], feeds)[0]


def test_the_head_reads_the_last_position_and_gives_its_logits():
    model = _head()
    x = np.random.default_rng(1).standard_normal((1, SEQ, HIDDEN)).astype(np.float32)
    full = _run(model, {"inputs_embeds": x})
    facts = last_logits.lower(model)
    assert facts == {"sliced": 1, "head": "MatMul"}
    ops = [n.op_type for n in model.graph]
    assert ops == ["Mul", "Slice", "MatMul"]  # the Slice sits between the hidden states and the head
    assert [o.name for o in model.graph.outputs] == ["logits"] and list(model.graph.outputs[0].shape) == [
        1,
        1,
        VOCAB,
    ]
    got = _run(model, {"inputs_embeds": x})
    assert got.shape == (1, 1, VOCAB)
    np.testing.assert_array_equal(got, full[:, -1:, :])


@pytest.mark.parametrize("weight_from_input", [True, False])
def test_a_head_it_cannot_slice_is_left_as_it_is(weight_from_input):
    model = _head(weight_from_input)
    if not weight_from_input:
        model.graph.outputs[0].name = "hidden"  # no `logits` output at all
    facts = last_logits.lower(model)
    assert facts["sliced"] == 0 and facts["skipped"]
    assert [n.op_type for n in model.graph] == ["Mul", "MatMul"]


@pytest.mark.parametrize("enabled", [True, False])
def test_compile_slices_the_decoder_head_and_checks_the_last_position(tiny_llava, tmp_path, enabled):
    from vlmc.runtime import Pipeline

    pkg = Package.load(tiny_llava)
    out = tmp_path / "build"
    summary = backends.get("ort").compile(pkg, out, {"backend": "ort", "last_logits": enabled})
    assert json.loads((out / "compile.json").read_text()) == summary
    entry = summary["graphs"]["decoder"]
    assert entry.get("last_logits", {"sliced": 0})["sliced"] == int(enabled), entry.get("last_logits")
    build = Package.load(out / "package")
    model = build.model("decoder")
    head = model.graph.outputs[[o.name for o in model.graph.outputs].index("logits")].producer()
    assert (head.inputs[0].producer().op_type == "Slice") is enabled
    assert bool((build.info("decoder").get("ort") or {}).get("last_logits")) is enabled
    feeds = samples.inputs_for(pkg, "decoder")
    ref = ortsession.for_graph(pkg, "decoder").run(["logits"], feeds)[0]
    got = ortsession.for_graph(build, "decoder").run(["logits"], feeds)[0]
    if enabled:
        assert entry["check"]["logits_positions"] == "last" and got.shape[1] == 1 < ref.shape[1]
        np.testing.assert_allclose(got, ref[:, -1:, :], rtol=1e-4, atol=1e-5)
    else:
        assert got.shape == ref.shape
    # the vision graphs have no logits: untouched by this option
    assert all("last_logits" not in g for n, g in summary["graphs"].items() if n != "decoder")
    expected = Pipeline(pkg).generate(["Describe the image."], [["demo"]], max_new_tokens=4).tokens
    assert Pipeline(build).generate(["Describe the image."], [["demo"]], max_new_tokens=4).tokens == expected
