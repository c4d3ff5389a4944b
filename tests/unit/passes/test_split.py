"""split on a small hand-built decoder (onnx_ir): layer-range cuts, numerics on onnxruntime, no weight reads."""

from __future__ import annotations

import numpy as np
import pytest

from vlmc import interop, tensor_names
from vlmc.errors import VlmcError
from vlmc.pass_api import get

from .._compose_builders import decoder_feeds, external_tensors, package, run, weight_reads

LAYERS = 3


@pytest.fixture()
def pkg(tmp_path):
    return package(tmp_path / "pkg", layers=LAYERS)


def _chain(pkg, names, feeds):
    """Run decoder ranges one after another, each fed the previous one's hidden states."""
    outs: dict[str, np.ndarray] = {}
    state = dict(feeds)
    for name in names:
        got = run(pkg.model(name), state)
        outs.update(got)
        state.update(got)
    return outs


@pytest.mark.parametrize("boundaries", [[1], [1, 2], [2]])
def test_ranges_compute_what_the_whole_decoder_computes(pkg, boundaries):
    whole = pkg.model("decoder")
    feeds = decoder_feeds(LAYERS)
    want = run(whole, feeds)
    result = get("split")(boundaries=boundaries).run(pkg)
    names = [f"decoder.{k}" for k in range(len(boundaries) + 1)]
    assert result.modified and pkg.manifest["pipeline"]["decoder"] == names
    assert "decoder" not in pkg.manifest["graphs"]
    spans = list(zip([0, *boundaries], [*boundaries, LAYERS]))
    for name, (a, z) in zip(names, spans):
        info = pkg.info(name)
        assert info["kv_layers"] == [a, z]
        ins = [i["name"] for i in info["inputs"]]
        outs = [o["name"] for o in info["outputs"]]
        first = tensor_names.INPUTS_EMBEDS if a == 0 else tensor_names.hidden_states(a)
        last = tensor_names.LOGITS if z == LAYERS else tensor_names.hidden_states(z)
        past, present = tensor_names.kv_names(LAYERS)
        assert ins == [first, "attention_mask", *past[2 * a : 2 * z]]
        assert outs == [last, *present[2 * a : 2 * z]]
        # the hidden state between ranges has the residual stream's type
        if a:
            assert info["inputs"][0]["dtype"] == "float32" and info["inputs"][0]["shape"][-1] == 16
        interop.check(pkg.model(name), name)
    got = _chain(pkg, names, feeds)
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


def test_split_shares_the_weight_tensors_and_reads_none(pkg):
    whole = pkg.model("decoder")
    before = external_tensors(whole)
    before_fp = interop.fingerprint(whole)
    with weight_reads(pkg) as reads:
        get("split")(decoder_ranges=3).run(pkg)
    assert reads == [], f"split read weights: {reads[:4]}"
    shared = {}
    for name in pkg.manifest["pipeline"]["decoder"]:
        shared.update({id(t): t for t in external_tensors(pkg.model(name)).values()})
    # every weight of every range is one of the decoder's own ExternalTensor objects (same file region)
    assert set(shared) <= {id(t) for t in before.values()}
    assert len(shared) == len(before)  # and every decoder weight went to a range
    assert interop.fingerprint(whole) == before_fp  # the input graph was not edited


def test_the_mask_shape_input_of_a_later_range_is_its_own_past(pkg):
    # Every layer reads the past length from the *shape* of layer 0's past key; range 1 does not own
    # that input, so it reads the same shape from its own first past key instead.
    get("split")(boundaries=[1]).run(pkg)
    info = pkg.info("decoder.1")
    assert tensor_names.past(0, "key") not in [i["name"] for i in info["inputs"]]
    shape_nodes = [n for n in pkg.model("decoder.1").graph if n.op_type == "Shape"]
    assert [n.inputs[0].name for n in shape_nodes] == [tensor_names.past(1, "key")]


def test_a_decoder_without_a_residual_cut_is_refused(tmp_path):
    pkg = package(tmp_path / "pkg", layers=2, skip_from_embeds=True)
    with pytest.raises(VlmcError, match="found no residual-stream tensor between layers 0 and 1"):
        get("split")(decoder_ranges=2).run(pkg)
    assert pkg.manifest["pipeline"]["decoder"] == ["decoder"]


def test_a_range_that_needs_another_ranges_values_is_refused(tmp_path):
    pkg = package(tmp_path / "pkg", layers=2, past_values_in_layer=1)
    with pytest.raises(VlmcError, match="needs the values of 'past_key_values.0.value'"):
        get("split")(decoder_ranges=2).run(pkg)
