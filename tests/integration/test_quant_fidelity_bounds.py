"""quantize fidelity is bounded: only the feeds a plan needs are recorded, and big graphs are skipped
with one line saying how to force it (vlmc/limits.py), instead of holding FP32 sessions on them."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import limits, ortsession
from vlmc.package import Package
from vlmc.pass_api import get
from vlmc.passes.quantize import scheme, weight_only


def _opened(monkeypatch) -> list[str]:
    """Names of the package graphs an onnxruntime session is opened on (vlmc's own seam, wrapped)."""
    names: list[str] = []
    real = ortsession.for_graph

    def recording(pkg, name, threads=None):
        names.append(name)
        return real(pkg, name, threads)

    monkeypatch.setattr(ortsession, "for_graph", recording)
    return names


def test_vision_int8_static_records_the_image_chain_only(tiny_llava, monkeypatch):
    opened = _opened(monkeypatch)
    pkg = Package.load(tiny_llava)
    res = get("quantize")(
        vision_encoder={"weights": "int8", "activations": "int8", "calibration": {"count": 2}},
        eval_samples=1,
        eval_tokens=0,
    ).run(pkg)
    assert res.modified
    decoders = set(pkg.manifest["pipeline"]["decoder"]) | {pkg.manifest["pipeline"]["embed"]}
    assert not decoders & set(opened), opened  # no decoder/embed session for an image-only plan
    assert "vision_encoder" in opened
    fid = res.report["graphs"]["vision_encoder"]["fidelity"]
    assert fid["image_features"]["cosine"] >= 0.99
    assert "end_to_end" not in res.report


def test_fidelity_above_the_size_limit_is_skipped_and_says_how_to_force(tiny_llava, monkeypatch, caplog):
    opened = _opened(monkeypatch)
    monkeypatch.setattr(limits, "MAX_FIDELITY_BYTES", 1024)  # every graph of the tiny package is above
    pkg = Package.load(tiny_llava)
    decoder = pkg.manifest["pipeline"]["decoder"][0]
    with caplog.at_level("WARNING"):
        res = get("quantize")(decoder={"weights": "int4", "group_size": 32}).run(pkg)
    assert res.modified
    fid = res.report["graphs"][decoder]["fidelity"]
    assert isinstance(fid, str) and fid.startswith("not measured") and "VLMC_MAX_FIDELITY_BYTES" in fid
    e2e = res.report["end_to_end"]
    assert isinstance(e2e, str) and "GiB of FP32 weights" in e2e and "VLMC_MAX_FIDELITY_BYTES" in e2e
    # int4 RTN needs no calibration: with fidelity skipped no FP32 graph is run at all.
    assert opened == [], opened
    lines = [r.getMessage() for r in caplog.records if "fidelity" in r.getMessage()]
    assert len(lines) == 2 and all("\n" not in m for m in lines), lines


def test_token_budget_cuts_greedy_tokens_and_says_so(tiny_llava, monkeypatch):
    monkeypatch.setattr(limits, "MAX_FIDELITY_TOKENS", 3)
    pkg = Package.load(tiny_llava)
    res = get("quantize")(decoder={"weights": "int4", "group_size": 32}, eval_samples=2, eval_tokens=8).run(
        pkg
    )
    e2e = res.report["end_to_end"]
    assert e2e["new_tokens"] == 1 and e2e["samples"] == 2
    assert "cut from 8 to 1" in e2e["note"]
    assert e2e["first_token_logits_cosine"] > 0.9


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_dequantized_session_matches_the_per_call_graph(bits):
    rng = np.random.default_rng(1)
    width = 128
    x = ir.Value(name="x", shape=ir.Shape(["s", width]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 17}, name="chain")
    h = x
    for i in range(3):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        wv = ir.Value(name=f"w{i}", const_value=ir.tensor(w, name=f"w{i}"))
        graph.register_initializer(wv)
        node = ir.node("MatMul", [h, wv], name=f"mm{i}")
        graph.append(node)
        h = node.outputs[0]
        h.name = f"h{i}"
    graph.outputs.append(h)
    model = ir.Model(graph, ir_version=9)
    plan = scheme.parse_graph(
        "d", {"weights": bits, "group_size": 32}, "q", scheme.Calibration(), scheme.KeepFp32()
    )
    model, facts = weight_only.quantize_weight_only(model, plan, None)
    assert len(facts["nodes_quantized"]) == 3
    nodes_before = len(model.graph)
    per_call = ortsession.from_model(model, precision=f"{bits}_weight_only")
    once = ortsession.dequantized(model)
    assert len(model.graph) == nodes_before  # the model itself is not changed
    assert [i.name for i in once.get_inputs()] == ["x"]
    feed = {"x": rng.standard_normal((5, width)).astype(np.float32)}
    (a,) = per_call.run(None, feed)
    (b,) = once.run(None, feed)
    # Same float weights (the same kernels computed them); only the MatMul's accumulation may differ.
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_samples_past_the_fidelity_ones_run_only_what_calibration_needs(tiny_llava, monkeypatch):
    # The vision encoder is calibrated on 4 samples; the decoder is only evaluated (2 fidelity
    # samples). Samples 3 and 4 then record the vision feeds alone and never run the FP32 decoder.
    from vlmc.passes.quantize import calib
    from vlmc.runtime import Pipeline

    pkg = Package.load(tiny_llava)
    decoder = pkg.manifest["pipeline"]["decoder"][0]
    ran: list[str] = []
    real = Pipeline.run_graph

    def counting(self, name, env):
        ran.append(name)
        return real(self, name, env)

    monkeypatch.setattr(Pipeline, "run_graph", counting)
    refs = calib.image_refs(None, 4, 0)
    targets = {"vision_encoder", decoder}
    args = (pkg, targets, refs, ["describe the image"], 2, 1)
    rec = calib.record(*args, every_sample={"vision_encoder"})
    assert [len(rec.feeds["vision_encoder"]), len(rec.feeds[decoder])] == [4, 2]
    assert ran.count(decoder) == 2 and len(rec.generations) == 2, ran
    ran.clear()
    every = calib.record(*args)  # every target on every sample: what was recorded before
    assert ran.count(decoder) == 4 and len(every.feeds[decoder]) == 4
    for got, want in zip(rec.feeds["vision_encoder"], every.feeds["vision_encoder"]):
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
    assert all(
        np.array_equal(a[k], b[k]) for a, b in zip(rec.feeds[decoder], every.feeds[decoder]) for k in a
    )
