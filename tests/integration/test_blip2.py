"""BLIP-2 export: the vision -> fusion -> LLM stage chain, OPT positions, and verify against transformers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from vlmc import exporters, ortsession, verify
from vlmc.errors import VlmcError
from vlmc.exporters import base, blip2, zoo
from vlmc.package import Package
from vlmc.runtime import Pipeline, preprocess

PROMPTS = ["Describe the image.", "What is in the top left corner of this picture?"]


@pytest.fixture(scope="module")
def tiny_blip2(exported):
    return exported("tiny-blip2")


@pytest.fixture(scope="module")
def reference():
    return exporters.load_source("tiny-blip2").model


def test_tiny_blip2_manifest_describes_the_stage_chain(tiny_blip2):
    pkg = Package.load(tiny_blip2)
    m = pkg.manifest
    assert m["model"]["family"] == "blip2"
    assert m["model"]["architecture"] == "Blip2ForConditionalGeneration"
    assert m["pipeline"] == {
        "image": ["vision_encoder", "fusion"],
        "embed": "embed_tokens",
        "decoder": ["decoder"],
    }
    assert {n: pkg.info(n)["role"] for n in pkg.graph_names} == {
        "vision_encoder": "vision",
        "fusion": "fusion",
        "embed_tokens": "embed",
        "decoder": "decoder",
    }
    vision, fusion = pkg.info("vision_encoder"), pkg.info("fusion")
    assert [i["name"] for i in vision["inputs"]] == ["pixel_values"]
    # the fusion graph consumes the vision graph's output by name: that is how the runtime chains them
    assert (
        [o["name"] for o in vision["outputs"]]
        == [i["name"] for i in fusion["inputs"]]
        == ["vision_hidden_states"]
    )
    n_query = m["vision"]["tokens_per_image"]
    assert n_query == m["vision"]["num_query_tokens"] == 8
    assert fusion["outputs"][0]["name"] == "image_features"
    assert fusion["outputs"][0]["shape"] == ["images", n_query, m["text"]["hidden_size"]]
    assert m["vision"]["preprocess"]["kind"] == "resize" and m["text"]["image_tokens_first"] is True
    layers = m["kv"]["layers"]
    past, present = base.kv_names(layers)
    dec = pkg.info("decoder")
    assert [i["name"] for i in dec["inputs"]] == ["inputs_embeds", "attention_mask", "position_ids", *past]
    assert [o["name"] for o in dec["outputs"]] == ["logits", *present]
    for name in pkg.graph_names:
        path = str(tiny_blip2 / pkg.info(name)["file"])
        model = onnx.load(path)
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 17
        onnx.checker.check_model(path, full_check=True)


@pytest.mark.parametrize("images", [1, 3])
def test_stage_chain_matches_transformers_image_features(tiny_blip2, reference, images):
    pipe = Pipeline(Package.load(tiny_blip2))
    pixels = np.random.default_rng(images).standard_normal((images, 3, 32, 32)).astype(np.float32)
    got = pipe.run_chain(pipe.m["pipeline"]["image"], {"pixel_values": pixels})
    with torch.no_grad():
        want = reference.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    assert got["image_features"].shape == want.shape == (images, 8, 64)
    np.testing.assert_allclose(got["image_features"], want, rtol=1e-5, atol=1e-5)
    # the intermediate stage output is the vision tower's last hidden state
    with torch.no_grad():
        hidden = reference.vision_model(torch.from_numpy(pixels)).last_hidden_state.numpy()
    np.testing.assert_allclose(got["vision_hidden_states"], hidden, rtol=1e-5, atol=1e-5)


def test_image_features_depend_on_the_image(tiny_blip2):
    # Guards against a degenerate fusion (transformers initializes the query tokens to zeros).
    pipe = Pipeline(Package.load(tiny_blip2))
    a, b = (pipe.image_features(pipe.prepare(["x"], [[f"demo:{s}"]]).vision) for s in (1, 2))
    assert np.abs(a - b).max() > 1e-2


def test_prompt_layout_puts_query_placeholders_before_bos(tiny_blip2):
    pipe = Pipeline(Package.load(tiny_blip2))
    inp = pipe.prepare(["hi"], [["demo"]])
    assert inp.input_ids.tolist() == [[zoo.TINY_IMAGE_TOKEN] * 8 + [1, 3 + ord("h"), 3 + ord("i")]]
    assert inp.vision["pixel_values"].shape == (1, 3, 32, 32)
    text_only = pipe.prepare(["hi"], [[]])
    assert text_only.input_ids.tolist() == [[1, 3 + ord("h"), 3 + ord("i")]]


def test_resize_preprocessing_matches_blip_image_processor():
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    proc = BlipImageProcessorPil(size={"height": 32, "width": 48})
    img = preprocess.demo_image(96, seed=3)[:, :70]  # not square: the resize must not keep the aspect
    want = proc(images=[img], return_tensors="np")["pixel_values"]
    facts = {
        "kind": "resize",
        "size": [32, 48],
        "mean": proc.image_mean,
        "std": proc.image_std,
        "rescale_factor": proc.rescale_factor,
        "resample": "bicubic",
    }
    got = preprocess.preprocess([img], facts)["pixel_values"]
    assert got.shape == want.shape == (1, 3, 32, 48)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_decoder_takes_zero_based_positions_like_opt(tiny_blip2, reference):
    """The graph adds OPT's position offset itself: feeding 0-based positions equals OPT's own default."""
    pipe = Pipeline(Package.load(tiny_blip2))
    m = pipe.m
    rng = np.random.default_rng(4)
    emb = rng.standard_normal((2, 6, m["text"]["hidden_size"])).astype(np.float32)
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int64)
    kv = m["kv"]
    empty = {
        n: np.zeros((2, kv["kv_heads"], 0, kv["head_dim"]), np.float32)
        for n in base.kv_names(kv["layers"])[0]
    }
    pos = np.where(mask == 0, 1, np.cumsum(mask, -1) - 1)
    got = pipe.run_graph(
        "decoder", {"inputs_embeds": emb, "attention_mask": mask, "position_ids": pos, **empty}
    )
    with torch.no_grad():
        want = reference.language_model(
            inputs_embeds=torch.from_numpy(emb), attention_mask=torch.from_numpy(mask)
        ).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(got["logits"][real], want[real], rtol=1e-4, atol=1e-4)


def test_verify_tiny_blip2_token_exact(tiny_blip2):
    res = verify.verify(Package.load(tiny_blip2), max_new_tokens=20)
    assert res.passed, res
    assert res.token_agreement == 1.0 and res.prefill_logits_max_abs_diff <= 1e-4
    assert len(res.tokens_reference[0]) == 20 and res.tokens_package == res.tokens_reference


def _save_local(root, name, processor_size=None, **over):
    torch.manual_seed(1)
    model = blip2.build_tiny(blip2.tiny_blip2_config(**over))
    path = root / name
    model.save_pretrained(path)
    if processor_size is not None:
        from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

        BlipImageProcessorPil(size={"height": processor_size, "width": processor_size}).save_pretrained(path)
    return path


LOCAL_CONFIGS = {
    # fewer queries and a one-layer Q-Former
    "queries4_qformer1": {"num_query_tokens": 4, "qformer_layers": 1},
    # deeper, wider OPT and a larger image, with the source's own preprocessor_config.json
    "opt3_wide_img48": {"text_layers": 3, "text_hidden": 96, "image_size": 48, "processor_size": 48},
}


@pytest.fixture(scope="module")
def local_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("blip2_local")
    return {name: _save_local(root, name, **over) for name, over in LOCAL_CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(LOCAL_CONFIGS))
def test_verify_local_configs_batch_of_two(local_dirs, tmp_path, name):
    src = exporters.load_source(str(local_dirs[name]))
    assert src.family == "blip2" and not src.builtin
    exporters.export(src).save(tmp_path / "pkg")
    pkg = Package.load(tmp_path / "pkg")
    over = LOCAL_CONFIGS[name]
    assert pkg.manifest["vision"]["tokens_per_image"] == over.get("num_query_tokens", 8)
    if "processor_size" in over:
        assert pkg.manifest["vision"]["processor"] == "source"
        assert pkg.manifest["vision"]["preprocess"]["size"] == [over["processor_size"]] * 2
    # prompts of different lengths, so the shorter one is left padded
    res = verify.verify(pkg, max_new_tokens=20, prompts=PROMPTS, images=[["demo:3"], ["demo:4"]])
    assert res.passed, res
    assert res.prompts == 2 and res.tokens_package == res.tokens_reference
    assert res.token_agreement == 1.0 and res.prefill_logits_max_abs_diff <= 1e-4
    assert all(len(t) >= 1 for t in res.tokens_reference)


def test_fusion_graph_serves_any_image_count(local_dirs, tmp_path):
    pkg = exporters.export(exporters.load_source(str(local_dirs["queries4_qformer1"])))
    pkg.save(tmp_path / "pkg")
    pkg = Package.load(tmp_path / "pkg")
    sess = ortsession.for_graph(pkg, "fusion")
    hidden = np.random.default_rng(0).standard_normal((5, 17, 48)).astype(np.float32)
    assert sess.run(None, {"vision_hidden_states": hidden})[0].shape == (5, 4, 64)


def test_blip2_with_an_encoder_decoder_language_model_is_rejected(tmp_path):
    from transformers import Blip2Config, Blip2ForConditionalGeneration, T5Config

    base_cfg = blip2.tiny_blip2_config()
    t5 = T5Config(
        vocab_size=zoo.TINY_VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
    )
    cfg = Blip2Config(
        vision_config=base_cfg.vision_config,
        qformer_config=base_cfg.qformer_config,
        text_config=t5,
        num_query_tokens=4,
        image_token_index=zoo.TINY_IMAGE_TOKEN,
    )
    Blip2ForConditionalGeneration(cfg).save_pretrained(tmp_path / "t5")
    src = exporters.load_source(str(tmp_path / "t5"))
    with pytest.raises(VlmcError, match=r"BLIP-2 with a t5 language model is not supported") as err:
        exporters.export(src)
    assert "\n" not in str(err.value)


def test_blip2_without_an_image_token_id_is_rejected(tmp_path):
    cfg = blip2.tiny_blip2_config()
    cfg.image_token_index = None
    blip2.build_tiny(cfg).save_pretrained(tmp_path / "noimg")
    src = exporters.load_source(str(tmp_path / "noimg"))
    with pytest.raises(VlmcError, match=r"no image_token_index") as err:
        exporters.export(src)
    assert "\n" not in str(err.value)
