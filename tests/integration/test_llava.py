"""LLaVA export: graph interfaces, dynamic axes, and verify against transformers on several configs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from vlmc import exporters, ortsession, verify
from vlmc.exporters import zoo
from vlmc.package import Package
from vlmc.runtime import Pipeline


def test_tiny_llava_graphs_follow_the_interfaces(tiny_llava):
    pkg = Package.load(tiny_llava)
    m = pkg.manifest
    assert m["pipeline"] == {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}
    dec = pkg.info("decoder")
    layers = m["kv"]["layers"]
    assert [i["name"] for i in dec["inputs"]] == ["inputs_embeds", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")
    ]
    assert [o["name"] for o in dec["outputs"]] == ["logits"] + [
        f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")
    ]
    assert dec["inputs"][0]["shape"][:2] == ["batch", "sequence"]
    assert dec["inputs"][3]["shape"][2] == "past_sequence"
    assert pkg.info("vision_encoder")["outputs"][0]["name"] == "image_features"
    for name in pkg.graph_names:
        model = onnx.load(str(tiny_llava / pkg.info(name)["file"]))
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 17
        onnx.checker.check_model(str(tiny_llava / pkg.info(name)["file"]), full_check=True)
    # weights live in external data next to the graph
    assert (tiny_llava / "decoder.onnx.data").stat().st_size > (tiny_llava / "decoder.onnx").stat().st_size


@pytest.mark.parametrize("images", [1, 3])
def test_vision_graph_takes_any_image_count(tiny_llava, images):
    pkg = Package.load(tiny_llava)
    sess = ortsession.for_graph(pkg, "vision_encoder")
    size = pkg.manifest["vision"]["image_size"]
    out = sess.run(
        None,
        {"pixel_values": np.random.default_rng(0).standard_normal((images, 3, *size)).astype(np.float32)},
    )[0]
    assert out.shape == (
        images,
        pkg.manifest["vision"]["tokens_per_image"],
        pkg.manifest["text"]["hidden_size"],
    )


def test_decoder_prefill_then_decode_matches_one_pass(tiny_llava):
    """KV cache correctness inside the graph: prefill 5 + decode 1 equals a single 6-token pass."""
    pkg = Package.load(tiny_llava)
    pipe = Pipeline(pkg)
    rng = np.random.default_rng(1)
    hidden, layers = pkg.manifest["text"]["hidden_size"], pkg.manifest["kv"]["layers"]
    kvh, hd = pkg.manifest["kv"]["kv_heads"], pkg.manifest["kv"]["head_dim"]
    emb = rng.standard_normal((1, 6, hidden)).astype(np.float32)
    empty = {
        f"past_key_values.{i}.{k}": np.zeros((1, kvh, 0, hd), np.float32)
        for i in range(layers)
        for k in ("key", "value")
    }
    full = pipe.run_graph(
        "decoder",
        {
            "inputs_embeds": emb,
            "attention_mask": np.ones((1, 6), np.int64),
            "position_ids": np.arange(6)[None],
            **empty,
        },
    )
    first = pipe.run_graph(
        "decoder",
        {
            "inputs_embeds": emb[:, :5],
            "attention_mask": np.ones((1, 5), np.int64),
            "position_ids": np.arange(5)[None],
            **empty,
        },
    )
    past = {
        f"past_key_values.{i}.{k}": first[f"present.{i}.{k}"] for i in range(layers) for k in ("key", "value")
    }
    step = pipe.run_graph(
        "decoder",
        {
            "inputs_embeds": emb[:, 5:],
            "attention_mask": np.ones((1, 6), np.int64),
            "position_ids": np.array([[5]]),
            **past,
        },
    )
    np.testing.assert_allclose(step["logits"][:, -1], full["logits"][:, -1], rtol=1e-5, atol=1e-5)


def _save_local(tmp_path, name, **over):
    import torch
    from transformers import LlavaForConditionalGeneration

    cfg = zoo.tiny_llava_config(**over.pop("text", {}))
    for k, v in over.items():
        setattr(cfg, k, v)  # set before construction: a layer list widens the projector input
    torch.manual_seed(1)
    model = LlavaForConditionalGeneration(cfg)
    path = tmp_path / name
    model.save_pretrained(path)
    return path


LOCAL_CONFIGS = {
    "gqa": {"text": {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64}},
    "full_strategy": {"vision_feature_select_strategy": "full"},
    "layer_list": {"vision_feature_layer": [-3, -1]},
}


@pytest.fixture(scope="module")
def local_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_local")
    return {
        name: _save_local(root, name, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in over.items()})
        for name, over in LOCAL_CONFIGS.items()
    }


@pytest.mark.parametrize("name", sorted(LOCAL_CONFIGS))
def test_verify_local_configs_token_exact(local_dirs, tmp_path, name):
    src = exporters.load_source(str(local_dirs[name]))
    pkg = exporters.export(src)
    pkg.save(tmp_path / "pkg")
    pkg = Package.load(tmp_path / "pkg")
    res = verify.verify(pkg, max_new_tokens=20)
    assert res.passed, res
    assert res.token_agreement == 1.0 and res.prefill_logits_max_abs_diff <= 1e-4
    assert len(res.tokens_package[0]) >= 1


def test_layer_list_config_concatenates_hidden_states(local_dirs):
    src = exporters.load_source(str(local_dirs["layer_list"]))
    proj = src.model.model.multi_modal_projector.linear_1
    assert proj.in_features == 2 * src.config.vision_config.hidden_size


def test_verify_builtin_batch_of_two_images_with_different_prompts(tiny_llava):
    pkg = Package.load(tiny_llava)
    res = verify.verify(
        pkg,
        max_new_tokens=20,
        prompts=["Describe the image.", "What colour is the large circle here?"],
        images=[["demo:3"], ["demo:4"]],
    )
    assert res.passed and res.prompts == 2
    assert res.tokens_package == res.tokens_reference
    assert res.prefill_logits_max_abs_diff <= 1e-4
