"""Phi-3-vision (native rebuild of Phi-3-vision-128k-instruct's remote code): a hub-directory copy exported and run
token for token against transformers-native decoding of the same weights, the processor's per-chunk token ids,
verify against the processor's own layout, long rope past original_max_position_embeddings, paged KV.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _phi3_v_hub import CHAT_TEMPLATE, PHI_TOKENS, tokenizer, write_hub_copy

from vlmc import exporters, manager
from vlmc.errors import VlmcError
from vlmc.exporters import phi3_v
from vlmc.package import Package
from vlmc.recipe import Step
from vlmc.runtime import Pipeline


@pytest.fixture(scope="module")
def hub_copy(tmp_path_factory):
    return write_hub_copy(tmp_path_factory.mktemp("phi3_v_hub") / "Phi-3-vision-128k-instruct")


@pytest.fixture(scope="module")
def hub_package(hub_copy, tmp_path_factory):
    # --trust-remote-code is accepted but not needed: nothing of the repository's code exists here, or runs
    source = exporters.load_source(str(hub_copy), trust_remote_code=True)
    out = tmp_path_factory.mktemp("phi3_v_pkg") / "pkg"
    exporters.export(source).save(out)
    return Package.load(out), source


def _native_tokens(source, inp, new: int, eos) -> list[int]:
    feeds = {
        k: torch.from_numpy(v)
        for k, v in {"input_ids": inp.input_ids, "attention_mask": inp.attention_mask, **inp.vision}.items()
    }
    want = source.model.generate(**feeds, max_new_tokens=new, eos_token_id=eos)
    return want[0, inp.input_ids.shape[1] :].tolist()


def test_hub_copy_is_the_phi3_v_family(hub_package):
    pkg, source = hub_package
    m = pkg.manifest
    assert m["model"]["family"] == "phi3_v" and type(source.model).__name__ == "Phi3VForConditionalGeneration"
    assert m["vision"]["preprocess"]["kind"] == "hd_crops" and m["vision"]["preprocess"]["num_crops"] == 4
    assert m["vision"]["image_token_id"] == 0 and m["text"]["tokenizer"] == "source"
    assert m["text"]["max_positions"] == 131072
    # the decoder is transformers' Phi3 with the hub's long rope, su read as longrope
    rope = source.model.language_model.config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 4096


def test_hub_copy_loads_into_the_native_model(hub_copy, hub_package):
    from safetensors.torch import load_file

    _, source = hub_package
    hub = load_file(str(hub_copy / "model.safetensors"))
    model = source.model
    assert torch.equal(model.vision_embed_tokens.glb_GN, hub["model.vision_embed_tokens.glb_GN"])
    attn = model.language_model.model.layers[1].self_attn
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(qkv, hub["model.layers.1.self_attn.qkv_proj.weight"])  # split in rows q | k | v
    mlp = model.language_model.model.layers[0].mlp
    assert torch.equal(
        torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), hub["model.layers.0.mlp.gate_up_proj.weight"]
    )
    # layer_idx -2: the tower is cut before its last layer, which nothing reads
    assert len(model.vision_embed_tokens.img_processor.encoder.layers) == 2
    assert "model.vision_embed_tokens.img_processor.vision_model.encoder.layers.2.mlp.fc1.weight" in hub


def test_decoder_is_transformers_phi3(hub_copy, hub_package):
    """The Llama form of the decoder gives transformers' Phi3ForCausalLM's logits on the hub's fused weights."""
    from safetensors.torch import load_file
    from transformers import Phi3ForCausalLM

    _, source = hub_package
    phi3 = Phi3ForCausalLM(phi3_v.phi3_config(source.config)).eval()
    hub = load_file(str(hub_copy / "model.safetensors"))
    phi3.load_state_dict({k: v for k, v in hub.items() if not k.startswith("model.vision_embed_tokens.")})
    ids = torch.randint(3, 400, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = phi3(input_ids=ids).logits
        got = source.model.language_model(input_ids=ids).logits
    assert float((want - got).abs().max()) < 1e-5


@pytest.mark.parametrize(
    ("prompt", "images"),
    [
        ("Describe the image.", [(300, 500)]),
        (
            "<|user|>\n<|image_1|>\nCompare <|image_2|> with it.<|end|>\n<|assistant|>\n",
            [(600, 200), (336, 336)],
        ),
    ],
)
def test_prompt_ids_are_the_processors(hub_package, prompt, images):
    pkg, source = hub_package
    rng = np.random.default_rng(0)
    pics = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in images]
    inp = Pipeline(pkg).prepare([prompt], [pics])
    from PIL import Image

    ref = phi3_v.reference_inputs(
        source.directory, pkg.manifest, [prompt], [[Image.fromarray(p) for p in pics]]
    )
    got, want = inp.input_ids[0].tolist(), ref["input_ids"][0].tolist()
    # the processor's image rows hold -N (image N), vlmc's the image token; every other id is the same
    assert len(got) == len(want)
    assert [g for g, w in zip(got, want) if w < 0] == [0] * sum(1 for w in want if w < 0)
    assert [g for g, w in zip(got, want) if w >= 0] == [w for w in want if w >= 0]
    # and the pixels bit for bit, the crop grids the same
    assert np.array_equal(inp.vision["pixel_values"], ref["pixel_values"].numpy())
    assert np.array_equal(inp.vision["image_sizes"], ref["image_sizes"].numpy())


def test_one_pass_tokenization_rule_gives_the_same_ids(hub_package):
    # The observation: replacing each <|image_N|> with <unk> x count + <s> and tokenizing once gives the
    # per-chunk ids, for this tokenizer.json format (a Prepend('▁') normalizer applied after every special token).
    pkg, _ = hub_package
    tok = tokenizer()
    pipe = Pipeline(pkg)
    text = "<|user|>\n<|image_1|>\nWhat is shown here?<|end|>\n<|assistant|>\n"
    inp = pipe.prepare([text], [["demo:2"]])
    n = int((inp.input_ids == 0).sum())
    once = tok.encode(text.replace("<|image_1|>", "<unk>" * n + "<s>"), add_special_tokens=True).ids
    assert inp.input_ids[0].tolist() == once
    assert tok.token_to_id("<|end|>") in once and all(tok.token_to_id(t) is not None for t in PHI_TOKENS)


def test_plain_prompt_layout_is_the_chat_templates_one_turn(hub_package):
    # the hub's chat template rendered for one user turn with string content (the model card's "<|image_1|>\n" +
    # question) is the package's prompt_template with its images placed
    from vlmc.runtime import chat

    pkg, _ = hub_package
    content = "<|image_1|>\n<|image_2|>\nWhat differs?"
    want = chat.render(CHAT_TEMPLATE, [{"role": "user", "content": content}], 2)
    text, add_bos = Pipeline(pkg).render("What differs?", 2)
    assert text == want and add_bos


def test_markers_must_run_from_one_in_order(hub_package):
    pkg, _ = hub_package
    pipe = Pipeline(pkg)
    with pytest.raises(VlmcError, match="in order"):
        pipe.prepare(["<|image_2|> then <|image_1|>"], [["demo:0", "demo:1"]])
    with pytest.raises(VlmcError, match="2 image"):
        pipe.prepare(["just <|image_1|>"], [["demo:0", "demo:1"]])


def test_hub_copy_runs_like_the_native_model(hub_package):
    pkg, source = hub_package
    pipe = Pipeline(pkg)
    eos = pkg.manifest["text"]["eos_token_id"]
    inp = pipe.prepare(["What is in the picture?"], [[np.full((400, 250, 3), 90, np.uint8)]])
    assert list(pipe.generate_from(inp, 8).tokens[0]) == _native_tokens(source, inp, 8, eos)
    two = pipe.prepare(["<|image_1|>\n<|image_2|>\nSame?"], [["demo:0", "demo:3"]])
    assert list(pipe.generate_from(two, 6).tokens[0]) == _native_tokens(source, two, 6, eos)


def test_verify_against_the_processor_layout(hub_package):
    from vlmc import verify

    pkg, _ = hub_package
    res = verify.verify(pkg, max_new_tokens=4, prompts=["What is this?"], images=[["demo:0"]])
    # the processor writes -1 in the image rows: only those ids are not compared; the pixels are equal bit for bit
    assert res.inputs["ids_equal"] is True and res.inputs["passed"] is True
    assert res.inputs["pixel_max_abs_diff"] == 0.0
    assert res.passed and res.token_agreement == 1.0


@pytest.fixture(scope="module")
def short_rope(tmp_path_factory):
    """The tiny model with original_max_position_embeddings 64 (256 positions): prompts cross the long-rope switch."""
    cfg = phi3_v.tiny_phi3_v_config(max_position_embeddings=256, original_max_position_embeddings=64)
    torch.manual_seed(0)
    model = phi3_v.build_tiny(cfg)
    source = exporters.Source(
        name="tiny-phi3-v-short", model=model, config=cfg, family="phi3_v", builtin=True
    )
    out = tmp_path_factory.mktemp("phi3_v_short") / "pkg"
    exporters.export(source).save(out)
    return Package.load(out), source


def test_long_rope_switches_in_the_graph(short_rope):
    pkg, source = short_rope
    pipe = Pipeline(pkg)
    eos = pkg.manifest["text"]["eos_token_id"]
    # the one-turn layout and 20 bytes are 54 tokens, which cross 64 while decoding; 94 are past it at prefill
    # (transformers switches to long_factor there)
    for prompt, new in (("a" * 20, 16), ("abc " * 15, 6)):
        inp = pipe.prepare([prompt], [[]])
        got = list(pipe.generate_from(inp, new).tokens[0])
        assert got == _native_tokens(source, inp, new, eos), prompt
    # the switch changes the numbers: with the short factors alone the prefill logits differ
    inp = pipe.prepare(["abc " * 15], [[]])
    lm = source.model.language_model
    ids = torch.from_numpy(inp.input_ids)
    with torch.no_grad():
        long_logits = lm(input_ids=ids).logits[0, -1]
        rotary = lm.model.rotary_emb
        saved = rotary.rope_type, rotary.inv_freq
        # "default": transformers' forward then keeps the inv_freq it has, here the short one
        rotary.rope_type, rotary.inv_freq = "default", rotary.original_inv_freq
        short_logits = lm(input_ids=ids).logits[0, -1]
        rotary.rope_type, rotary.inv_freq = saved
    assert float((long_logits - short_logits).abs().max()) > 1e-3
    assert np.allclose(pipe.generate_from(inp, 1).prefill_logits[0], long_logits.numpy(), atol=1e-4)


def test_paged_kv_gives_the_same_tokens(exported):
    pkg = Package.load(exported("tiny-phi3-v"))
    paged = manager.run(Package.load(exported("tiny-phi3-v")), [Step("paged_kv", {"block_size": 16}, 1)])
    assert paged.manifest["kv"]["layout"] == "paged"
    prompts, images = ["Describe the image.", "What colour?"], [["demo:0"], ["demo:4"]]
    want = Pipeline(pkg).generate(prompts, images, 6).tokens
    assert Pipeline(paged).generate(prompts, images, 6).tokens == want


def test_tiny_builtin_verifies(exported):
    from vlmc import verify

    pkg = Package.load(exported("tiny-phi3-v"))
    assert pkg.manifest["vision"]["tokens_per_image"] is None
    res = verify.verify(pkg, max_new_tokens=4, prompts=["Describe the image."], images=[["demo:0"]])
    assert res.passed and res.token_agreement == 1.0


def test_unsupported_configs_are_refused():
    cfg = phi3_v.tiny_phi3_v_config()
    cfg.embd_layer["hd_transform_order"] = "glb_sub"
    with pytest.raises(VlmcError, match="sub_glb only"):
        phi3_v.check_supported(cfg, "x")
    cfg = phi3_v.tiny_phi3_v_config(rope_scaling={"type": "yarn", "factor": 2.0})
    with pytest.raises(VlmcError, match="rope_scaling type"):
        phi3_v.check_supported(cfg, "x")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        # layer 2 of 3: a stitched layer when streamed (two are traced)
        ("drop", "the checkpoint has no weights for model.layers.2.self_attn.qkv_proj.weight (1 missing)"),
        ("int16", "weight model.norm.weight is I16, not a float"),
        (
            "narrow",
            "weight model.layers.2.mlp.gate_up_proj.weight has shape [100, 64], the config implies [256, 64]",
        ),
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_damaged_checkpoints_are_refused_in_one_line(tmp_path, damage, message, streamed):
    """The whole load and the streamed one (phi3_v.load_reduced) check the same map of the hub's names."""
    import re

    from safetensors.torch import load_file, save_file

    src = write_hub_copy(tmp_path / "copy", num_hidden_layers=3, vision_layers=4)
    state = load_file(str(src / "model.safetensors"))
    if damage == "drop":
        del state["model.layers.2.self_attn.qkv_proj.weight"]
    elif damage == "int16":
        state["model.norm.weight"] = state["model.norm.weight"].to(torch.int16)
    else:
        state["model.layers.2.mlp.gate_up_proj.weight"] = state["model.layers.2.mlp.gate_up_proj.weight"][
            :100
        ].clone()
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(VlmcError, match=re.escape(message)):
        exporters.load_source(str(src), lazy=streamed)


def test_streamed_load_reads_only_the_traced_layers(tmp_path):
    """The cut model holds two decoder layers and two tower layers, and its stitched layers' q/k/v and gate/up are
    the checkpoint's rows: read through the map they equal the slices of the fused tensors."""
    from safetensors.torch import load_file

    from vlmc.exporters import streaming

    src = write_hub_copy(tmp_path / "copy", num_hidden_layers=4, vision_layers=5)
    lazy = exporters.load_source(str(src), lazy=True)
    assert lazy.streamed and len(lazy.model.language_model.model.layers) == 2
    assert len(lazy.model.vision_embed_tokens.img_processor.encoder.layers) == 2
    stack = streaming.stack_of(lazy.model.vision_embed_tokens.img_processor.encoder.layers)
    assert stack.depth == 4  # 5 layers, the last past layer_idx -2 unused
    state = load_file(str(src / "model.safetensors"))
    ckpt = streaming.stack_of(lazy.model.language_model.model.layers).checkpoint
    qkv, gate_up = (
        state["model.layers.3.self_attn.qkv_proj.weight"],
        state["model.layers.3.mlp.gate_up_proj.weight"],
    )
    for part, rows in zip("qkv", qkv.split(64)):
        assert torch.equal(ckpt.tensor(f"language_model.model.layers.3.self_attn.{part}_proj.weight"), rows)
    gate, up = gate_up.chunk(2)
    assert torch.equal(ckpt.tensor("language_model.model.layers.3.mlp.gate_proj.weight"), gate)
    assert torch.equal(ckpt.tensor("language_model.model.layers.3.mlp.up_proj.weight"), up)
    # the traced layers' weights are loaded as the whole model has them
    whole = exporters.load_source(str(src))
    cut, full = lazy.model.state_dict(), whole.model.state_dict()
    for key, value in cut.items():
        assert torch.equal(value, full[key]), key
