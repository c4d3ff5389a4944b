"""quantize's streamed per-graph fidelity on an exported package equals the whole-graph fidelity.

Above VLMC_MAX_FIDELITY_BYTES a graph is measured segment by segment (option streamed_fidelity),
FP32 and quantized alike, without a session on either whole graph; where both paths can run, the
numbers must be the same.
"""

from __future__ import annotations

import pytest

from vlmc import limits
from vlmc.package import Package
from vlmc.pass_api import get
from vlmc.passes.quantize import stream_fidelity

from .test_quant_fidelity_bounds import _opened

_PLAN = {
    "vision_encoder": {"weights": "int8", "activations": "int8", "calibration": {"count": 2}},
    "decoder": {"weights": "int4", "group_size": 32},
    "eval_samples": 2,
    "eval_tokens": 0,
}


@pytest.fixture(scope="module")
def whole(tiny_llava):
    res = get("quantize")(**_PLAN).run(Package.load(tiny_llava))
    return res.report["graphs"]


def test_streamed_fidelity_equals_whole_graph_fidelity(tiny_llava, whole, monkeypatch):
    monkeypatch.setattr(limits, "MAX_FIDELITY_BYTES", 1024)  # every graph is above: all streamed
    monkeypatch.setattr(stream_fidelity, "SEGMENT_BYTES", 16 << 10)  # several segments per graph
    opened = _opened(monkeypatch)
    pkg = Package.load(tiny_llava)
    decoder = pkg.manifest["pipeline"]["decoder"][0]
    res = get("quantize")(**_PLAN, streamed_fidelity=True).run(pkg)
    graphs = res.report["graphs"]
    # The vision encoder calibrates on its own session (int8 static needs it); the decoder, which
    # only fidelity runs, never has a session on its whole FP32 or quantized graph.
    assert decoder not in opened, opened
    for name in ("vision_encoder", decoder):
        got, want = graphs[name]["fidelity"], whole[name]["fidelity"]
        assert isinstance(want, dict) and want and set(got) == set(want), (name, got, want)
        assert graphs[name]["fidelity_streamed"]["segments"] > 1, (name, graphs[name]["fidelity_streamed"])
        for out in want:
            assert abs(got[out]["cosine"] - want[out]["cosine"]) < 1e-5, (name, out)
            assert abs(got[out]["max_abs_diff"] - want[out]["max_abs_diff"]) <= 1e-4 * max(
                1.0, want[out]["max_abs_diff"]
            ), (name, out)
        assert "fidelity_streamed" not in whole[name]
    assert any(v["cosine"] < 0.99999 for v in graphs[decoder]["fidelity"].values())  # int4 moved it


def test_above_the_limit_without_the_option_says_how_to_turn_it_on(tiny_llava, monkeypatch):
    monkeypatch.setattr(limits, "MAX_FIDELITY_BYTES", 1024)
    pkg = Package.load(tiny_llava)
    decoder = pkg.manifest["pipeline"]["decoder"][0]
    res = get("quantize")(decoder={"weights": "int4", "group_size": 32}, eval_tokens=0).run(pkg)
    fid = res.report["graphs"][decoder]["fidelity"]
    assert fid.startswith("not measured") and "streamed_fidelity: true" in fid, fid
