"""quantize fidelity computes the decoders' LM head on the last prompt position only, on both sides."""

from __future__ import annotations

import numpy as np

from vlmc import ortsession, samples
from vlmc.package import Package
from vlmc.pass_api import get
from vlmc.passes.quantize import fidelity


def test_last_position_decoder_matches_the_whole_graph_at_the_last_position(tiny_llava):
    pkg = Package.load(tiny_llava)
    name = pkg.manifest["pipeline"]["decoder"][0]
    sliced = fidelity.last_position(pkg.model(name))
    assert sliced is not None
    feeds = samples.inputs_for(pkg, name)
    assert feeds["inputs_embeds"].shape[1] > 1  # a prefill: more than one position to leave out
    full_sess = ortsession.for_graph(pkg, name)
    names = [o.name for o in full_sess.get_outputs()]
    full = dict(zip(names, full_sess.run(None, feeds)))
    sess = ortsession.from_model(sliced)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    assert set(got) == set(full)
    assert got["logits"].shape == (full["logits"].shape[0], 1, full["logits"].shape[2])
    np.testing.assert_allclose(got["logits"], full["logits"][:, -1:], rtol=1e-5, atol=1e-5)
    for k in names:
        if k != "logits":  # the KV outputs are the whole graph's
            np.testing.assert_array_equal(got[k], full[k])
    # the package's graph is not changed
    assert [o.name for o in pkg.model(name).graph.outputs] == names
    assert "vlmc_last_position" not in {n.name for n in pkg.model(name).graph}


def test_decoder_fidelity_compares_last_position_logits_and_generation_is_the_same(tiny_llava):
    pkg = Package.load(tiny_llava)
    name = pkg.manifest["pipeline"]["decoder"][0]
    res = get("quantize")(decoder={"weights": "int4", "group_size": 32}, eval_samples=1, eval_tokens=3).run(
        pkg
    )
    fid = res.report["graphs"][name]["fidelity"]
    assert fid["logits"]["positions"] == "last"
    assert 0.5 < fid["logits"]["cosine"] <= 1.0 + 1e-6
    e2e = res.report["end_to_end"]
    assert e2e["samples"] == 1 and e2e["new_tokens"] == 3
    # the FP32 reference generation through the last-position executor is the whole graph's
    from vlmc.runtime import Pipeline

    fp32 = Package.load(tiny_llava)
    whole = Pipeline(fp32)
    executor = fidelity.LastPosition(fp32)
    last = Pipeline(fp32, executor=executor)
    inp = whole.prepare(["Describe the image."], [["demo:0"]])
    a, b = whole.generate_from(inp, max_new_tokens=3), last.generate_from(inp, max_new_tokens=3)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.prefill_logits, b.prefill_logits, rtol=1e-5, atol=1e-5)
    assert executor.sliced == {name}
