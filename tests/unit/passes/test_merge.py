"""merge (and split back) on small hand-built stage graphs (onnx_ir): structure, numerics, no weight reads."""

from __future__ import annotations

import numpy as np
import pytest

from vlmc import graphs, interop, tensor_names
from vlmc.package import Package
from vlmc.pass_api import get

from .._compose_builders import (
    DEEPSTACK,
    HIDDEN,
    IMAGE_TOKEN,
    PATCH_DIM,
    PATCHES,
    VOCAB,
    decoder_feeds,
    external_tensors,
    package,
    run,
    weight_reads,
)

LAYERS = 2


@pytest.fixture()
def pkg(tmp_path):
    return package(tmp_path / "pkg", layers=LAYERS)


def _feeds(images: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = decoder_feeds(LAYERS, seed=seed, batch=2, seq=6)
    del feeds["inputs_embeds"]
    ids = rng.integers(3, VOCAB - 1, size=(2, 6)).astype(np.int64)
    # placeholders over the flattened batch: row 0 holds image 0's, row 1 image 1's (in order)
    ids[0, 1 : 1 + PATCHES] = IMAGE_TOKEN
    ids[1, 2 : 2 + PATCHES] = IMAGE_TOKEN
    feeds["input_ids"] = ids
    feeds["pixel_values"] = rng.standard_normal((images, PATCHES, PATCH_DIM)).astype(np.float32)
    return feeds


def _stagewise(pkg: Package, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The unmerged package's answer: vision, embedding, placeholder rows replaced in numpy, decoder."""
    vision = run(pkg.model("vision_encoder"), feeds)
    feats = vision["image_features"]
    embeds = run(pkg.model("embed_tokens"), feeds)["inputs_embeds"].copy()
    flat = embeds.reshape(-1, HIDDEN)
    is_image = feeds["input_ids"] == IMAGE_TOKEN
    slots = np.flatnonzero(is_image.reshape(-1))
    assert len(slots) == len(feats)
    flat[slots] = feats
    dec = {**feeds, "inputs_embeds": flat.reshape(embeds.shape)}
    if "deepstack" in pkg.manifest["text"]:  # what the runtime feeds the decoder of a deepstack package
        dec[DEEPSTACK["mask_input"]] = is_image.astype(np.int64)
        dec[DEEPSTACK["embeds_input"]] = vision[DEEPSTACK["vision_output"]]
    return run(pkg.model("decoder"), dec)


def test_merged_graph_computes_the_stages(pkg):
    feeds = _feeds()
    want = _stagewise(pkg, feeds)
    result = get("merge")().run(pkg)
    assert result.modified and result.report["stages"] == ["vision_encoder", "embed_tokens", "decoder"]
    assert pkg.manifest["pipeline"] == {"vlm": "vlm", "embed": "embed_tokens", "decoder": ["decoder"]}
    assert "vision_encoder" not in pkg.manifest["graphs"]
    info = pkg.info("vlm")
    past, present = tensor_names.kv_names(LAYERS)
    assert [i["name"] for i in info["inputs"]] == ["pixel_values", "input_ids", "attention_mask", *past]
    assert [o["name"] for o in info["outputs"]] == ["logits", *present]
    assert [s["name"] for s in info["stages"]] == ["vision_encoder", "embed_tokens", "decoder"]
    vlm = pkg.model("vlm")
    interop.check(vlm, "vlm")
    hist = graphs.op_histogram(vlm)
    for op in ("Equal", "CumSum", "Max", "Gather", "Where"):
        assert hist.get(op, 0) >= 1, op
    # stage internals are prefixed, interfaces are not; every name is unique
    names = [v.name for n in vlm.graph for v in n.outputs]
    assert len(names) == len(set(names))
    assert "decoder/layers.0.residual" in names and "vision_encoder/vision.h" in names
    assert set(vlm.graph.initializers) >= {
        "decoder/lm_head",
        "embed_tokens/embed.weight",
        "vision_encoder/vision.proj",
    }
    got = run(vlm, feeds)
    assert got.keys() == want.keys()
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


def test_merge_shares_the_weight_tensors_and_reads_none(pkg):
    stages = {s: pkg.model(s) for s in ("vision_encoder", "embed_tokens", "decoder")}
    tensors = {id(t) for m in stages.values() for t in external_tensors(m).values()}
    prints = {s: interop.fingerprint(m) for s, m in stages.items()}
    with weight_reads(pkg) as reads:
        get("merge")().run(pkg)
    assert reads == [], f"merge read weights: {reads[:4]}"
    merged = external_tensors(pkg.model("vlm"))
    # the merged graph's weights are the stage graphs' own ExternalTensor objects, all of them
    assert {id(t) for t in merged.values()} == tensors
    # and the stage graphs are as they were (the text-only decode path keeps using them)
    assert {s: interop.fingerprint(m) for s, m in stages.items()} == prints
    assert pkg.model("decoder") is stages["decoder"]


def test_saved_merged_package_stores_each_weight_once_and_splits_back(pkg, tmp_path):
    feeds = _feeds(seed=1)
    want = _stagewise(pkg, feeds)
    weights = sum(t.nbytes for m in map(pkg.model, pkg.graph_names) for t in external_tensors(m).values())
    get("merge")().run(pkg)
    merged = Package.load(pkg.save(tmp_path / "merged"))
    data = tmp_path / "merged" / "weights.onnx.data"
    assert sorted(p.name for p in (tmp_path / "merged").glob("*.data")) == ["weights.onnx.data"]
    assert data.stat().st_size < weights + 64 * 16  # each weight once (plus 64-byte alignment)
    got = run(merged.model("vlm"), feeds)
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)

    get("split")().run(merged)
    assert merged.manifest["pipeline"] == {
        "image": ["vision_encoder"],
        "embed": "embed_tokens",
        "decoder": ["decoder"],
    }
    assert "vlm" not in merged.manifest["graphs"]
    assert not any("weights_file" in e for e in merged.manifest["graphs"].values())
    vision = merged.model("vision_encoder")
    assert [v.name for v in vision.graph.inputs] == ["pixel_values"]
    assert [v.name for v in vision.graph.outputs] == ["image_features"]
    assert merged.info("vision_encoder")["outputs"] == pkg.info("vlm")["stages"][0]["outputs"]
    restored = Package.load(merged.save(tmp_path / "restored"))
    np.testing.assert_array_equal(
        run(restored.model("vision_encoder"), feeds)["image_features"],
        run(Package.load(tmp_path / "pkg").model("vision_encoder"), feeds)["image_features"],
    )
    assert (tmp_path / "restored" / "vision_encoder.onnx.data").is_file()


def test_merge_of_decoder_ranges_joins_the_hidden_states(pkg):
    feeds = _feeds(seed=2)
    want = _stagewise(pkg, feeds)
    get("split")(boundaries=[1]).run(pkg)
    get("merge")().run(pkg)
    info = pkg.info("vlm")
    assert not any(i["name"].startswith(tensor_names.HIDDEN_PREFIX) for i in info["inputs"] + info["outputs"])
    got = run(pkg.model("vlm"), feeds)
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


def test_merged_deepstack_package_computes_the_deepstack_inputs(tmp_path):
    pkg = package(tmp_path / "pkg", layers=LAYERS, deepstack=True)
    feeds = _feeds(seed=3)
    want = _stagewise(pkg, feeds)
    get("merge")().run(pkg)
    ins = [i["name"] for i in pkg.info("vlm")["inputs"]]
    assert DEEPSTACK["mask_input"] not in ins and DEEPSTACK["embeds_input"] not in ins
    # the kept decode path still takes them
    dec = [i["name"] for i in pkg.info("decoder")["inputs"]]
    assert DEEPSTACK["mask_input"] in dec and DEEPSTACK["embeds_input"] in dec
    got = run(pkg.model("vlm"), feeds)
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)
