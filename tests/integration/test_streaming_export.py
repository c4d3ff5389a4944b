"""Streaming export (vlmc/exporters/streaming.py): a two-layer cut traced, the other layers stitched in.

The reference is the export of the whole model loaded by transformers (today's path, itself compared
with torch.onnx.export elsewhere); the streamed package must give the same numbers on onnxruntime
and the same tokens as transformers generate. Sources are saved with save_pretrained, sharded bf16
(the hub's layout, legacy key names) and one fp32 file.
"""

from __future__ import annotations

import json
from pathlib import Path

import _real_tokenizers
import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from vlmc import exporters, ortsession, samples
from vlmc.cli import main
from vlmc.exporters import base, streaming
from vlmc.package import Package

from .test_parity_raw_inputs import Family, _check

TEXT_LAYERS, VISION_LAYERS = 5, 6  # vision feature layer -2: 5 live vision layers
SOURCES = {
    "bf16-shards": {"dtype": torch.bfloat16, "max_shard_size": "300KB"},
    "fp32-one-file": {},
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    return {
        name: _real_tokenizers.llava_dir(
            root / name, text_layers=TEXT_LAYERS, vision_layers=VISION_LAYERS, save_kwargs=kwargs
        )
        for name, kwargs in SOURCES.items()
    }


def _feeds(pkg: Package, name: str, seed: int) -> dict[str, np.ndarray]:
    """The stored sample (seed 0), or it with new random floats (ids, grids and masks kept valid)."""
    feeds = samples.load(pkg, name)
    rng = np.random.default_rng(seed)
    if seed:
        feeds = {
            k: rng.standard_normal(v.shape).astype(v.dtype) if v.dtype.kind == "f" else v
            for k, v in feeds.items()
        }
    return feeds


@pytest.mark.parametrize("kind", list(SOURCES))
def test_streamed_package_equals_the_whole_model_export(sources, kind, tmp_path, capsys):
    src = sources[kind]
    if kind == "bf16-shards":
        assert len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]) > 0
        assert len(list(src.glob("*.safetensors"))) > 2
    lazy = exporters.load_source(str(src), lazy=True)
    assert lazy.streamed
    assert len(lazy.model.model.language_model.layers) == streaming.TRACED_LAYERS
    assert len(lazy.model.model.vision_tower.encoder.layers) == 3  # 1 - (-2): two live layers
    assert lazy.config.text_config.num_hidden_layers == TEXT_LAYERS
    capsys.readouterr()
    exporters.export(lazy).save(tmp_path / "streamed")
    captured = capsys.readouterr()
    assert "loading the whole model" not in " ".join((captured.out + captured.err).split())  # stitched
    whole = exporters.load_source(str(src))
    assert not whole.streamed
    exporters.export(whole).save(tmp_path / "whole")
    a, b = Package.load(tmp_path / "streamed"), Package.load(tmp_path / "whole")
    assert a.manifest == b.manifest
    for name in ("vision_encoder", "embed_tokens", "decoder"):
        ga = onnx.load(str(a.path_of(name)), load_external_data=False).graph
        gb = onnx.load(str(b.path_of(name)), load_external_data=False).graph
        assert [v.name for v in ga.input] == [v.name for v in gb.input]
        assert [v.name for v in ga.output] == [v.name for v in gb.output]
        assert sorted(n.op_type for n in ga.node) == sorted(n.op_type for n in gb.node)
        sa, sb = ortsession.for_graph(a, name), ortsession.for_graph(b, name)
        for seed in (0, 1):
            feeds = _feeds(b, name, seed)
            for x, y in zip(sa.run(None, feeds), sb.run(None, feeds)):
                assert x.shape == y.shape
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
    past = [v.name for v in onnx.load(str(a.path_of("decoder")), load_external_data=False).graph.input]
    assert f"past_key_values.{TEXT_LAYERS - 1}.value" in past
    vision = onnx.load(str(a.path_of("vision_encoder")), load_external_data=False).graph
    assert any(n.name.startswith(f"/vision_tower/encoder/layers.{VISION_LAYERS - 2}/") for n in vision.node)
    assert not any(
        n.name.startswith(f"/vision_tower/encoder/layers.{VISION_LAYERS - 1}/") for n in vision.node
    )


class Streamed(Family):
    """The parity family of test_parity_raw_inputs, exported with `vlmc export` (which streams)."""

    def __init__(self, src, root) -> None:
        self.src = src
        self.pkg_dir = root / "pkg"
        res = CliRunner().invoke(main, ["-q", "export", str(src), "-o", str(self.pkg_dir)])
        assert res.exit_code == 0, res.output
        from vlmc.exporters import processor

        self.pkg = Package.load(self.pkg_dir)
        self.proc = processor.load(src)
        self.model = exporters.load_source(str(src)).model
        assert len(self.model.model.language_model.layers) == TEXT_LAYERS
        self.marker = self.pkg.manifest["text"]["image_marker"]


def test_streamed_export_generates_the_tokens_transformers_does(sources, tmp_path):
    pictures = [
        _real_tokenizers.save_image(tmp_path / f"{i}.png", h, w, i)
        for i, (h, w) in enumerate([(120, 90), (64, 160)])
    ]
    fam = Streamed(sources["bf16-shards"], tmp_path)
    _check(
        fam, ["Describe the image in detail.", "What colour is the circle?"], [[pictures[0]], [pictures[1]]]
    )


def test_a_graph_that_cannot_be_stitched_falls_back_to_the_whole_model(sources, monkeypatch, capsys):
    def refuse(model, path, stack, traced):
        raise streaming.StitchError(f"{path}: refused by the test")

    monkeypatch.setattr(streaming, "stitch", refuse)
    src = exporters.load_source(str(sources["fp32-one-file"]), lazy=True)
    assert src.streamed
    pkg = exporters.export(src)
    captured = capsys.readouterr()
    assert "loading the whole model" in " ".join((captured.out + captured.err).split())
    graph = onnx.load(str(pkg.path_of("decoder")), load_external_data=False).graph
    assert f"past_key_values.{TEXT_LAYERS - 1}.key" in [v.name for v in graph.input]


def test_stacks_no_deeper_than_the_trace_are_not_cut(tmp_path):
    src = _real_tokenizers.llava_dir(
        tmp_path / "shallow"
    )  # 2 decoder layers; 3 vision layers, feature layer -2
    lazy = exporters.load_source(str(src), lazy=True)
    assert not lazy.streamed
    assert len(lazy.model.model.language_model.layers) == 2


# ---- every family that streams: the streamed package is the whole model's -------------------------


def _qwen2_vl():
    from vlmc.exporters import qwen2_vl

    cfg = qwen2_vl.tiny_qwen2_vl_config({"depth": 4}, num_hidden_layers=4)
    return qwen2_vl.model_class(cfg)(cfg)


def _qwen2_5_vl():
    from vlmc.exporters import qwen2_vl

    # blocks 1 and 3 full attention, 0, 2 and 4 windowed: blocks 1 and 2 are the templates
    cfg = qwen2_vl.tiny_qwen2_5_vl_config({"depth": 5, "fullatt_block_indexes": [1, 3]}, num_hidden_layers=4)
    return qwen2_vl.model_class(cfg)(cfg)


def _qwen3_vl():
    # deepstack into decoder layers 0 and 1: those two are traced as they are, then two plain layers
    from vlmc.exporters import qwen3_vl

    cfg = qwen3_vl.tiny_qwen3_vl_config(num_hidden_layers=6)
    return qwen3_vl.model_class(cfg)(cfg)


def _glm4v():
    from vlmc.exporters import glm4v

    cfg = glm4v.tiny_glm4v_config({"depth": 4}, num_hidden_layers=4)
    return glm4v.model_class(cfg)(cfg)


def _internvl():
    # InternVL's export reads the saved processor's tile settings: the test helper's directory, deeper
    import tempfile

    from _tokenizers_internvl import internvl_dir
    from transformers import AutoConfig, InternVLForConditionalGeneration

    with tempfile.TemporaryDirectory() as tmp:
        internvl_dir(Path(tmp))
        cfg = AutoConfig.from_pretrained(tmp)
        files = {f.name: f.read_bytes() for f in Path(tmp).iterdir() if f.suffix != ".safetensors"}
    cfg.text_config.num_hidden_layers = cfg.vision_config.num_hidden_layers = 4
    cfg.text_config.layer_types = ["full_attention"] * 4
    model = InternVLForConditionalGeneration(cfg)
    model._vlmc_test_files = {k: v for k, v in files.items() if k != "config.json"}
    return model


def _llava_next():
    from transformers import LlavaNextForConditionalGeneration

    from vlmc.exporters import llava_next

    cfg = llava_next.tiny_llava_next_config(num_hidden_layers=4)
    cfg.vision_config.num_hidden_layers = 5  # feature layer -2: three traced, two live
    return LlavaNextForConditionalGeneration(cfg)


def _llava_onevision():
    from transformers import LlavaOnevisionForConditionalGeneration

    from vlmc.exporters import llava_onevision

    cfg = llava_onevision.tiny_llava_onevision_config(num_hidden_layers=4)
    cfg.vision_config.num_hidden_layers = 4
    return LlavaOnevisionForConditionalGeneration(cfg)


def _gemma3():
    from vlmc.exporters import gemma3

    kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    cfg = gemma3.tiny_gemma3_config(num_hidden_layers=6, layer_types=kinds)
    cfg.vision_config.num_hidden_layers = 4
    return gemma3.build_tiny(cfg)


def _blip2():
    # Q-Former layers 0, 2, 4 cross-attend to the image, 1 and 3 do not
    from vlmc.exporters import blip2

    cfg = blip2.tiny_blip2_config(qformer_layers=5, text_layers=4)
    cfg.qformer_config.cross_attention_frequency = 2
    cfg.vision_config.num_hidden_layers = 4
    return blip2.build_tiny(cfg)


# family -> (model builder, {cut stack: traced layers})
FAMILIES = {
    "qwen2_vl": (_qwen2_vl, {"model.language_model.layers": 2, "model.visual.blocks": 2}),
    "qwen2_5_vl": (_qwen2_5_vl, {"model.language_model.layers": 2, "model.visual.blocks": 3}),
    "qwen3_vl": (_qwen3_vl, {"model.language_model.layers": 4}),
    "glm4v": (_glm4v, {"model.language_model.layers": 2, "model.visual.blocks": 2}),
    "internvl": (_internvl, {"model.language_model.layers": 2, "model.vision_tower.encoder.layer": 2}),
    "llava_next": (
        _llava_next,
        {"model.language_model.layers": 2, "model.vision_tower.encoder.layers": 3},
    ),
    "llava_onevision": (
        _llava_onevision,
        {"model.language_model.layers": 2, "model.vision_tower.encoder.layers": 2},
    ),
    "gemma3": (
        _gemma3,
        {"model.vision_tower.encoder.layers": 2},  # the decoder is not cut (see Gemma3.stream_depths)
    ),
    "blip2": (
        _blip2,
        {
            "language_model.model.decoder.layers": 2,
            "vision_model.encoder.layers": 2,
            "qformer.encoder.layer": 3,
        },
    ),
}


# Shape arithmetic torch's tracer shares between layers differently at different depths (BLIP-2's
# cross-attention layers reuse layer 0's Unsqueeze of the image tokens' length in the stitched graph).
SHAPE_OPS = {"Constant", "Shape", "Gather", "Unsqueeze", "Concat"}


def _compare_graphs(streamed: Package, whole: Package) -> None:
    """Same manifest; every graph: same interface, same weights (names and shapes), the same ops but
    for shared shape arithmetic, and the same outputs on onnxruntime (atol 1e-5)."""
    from collections import Counter

    assert streamed.manifest == whole.manifest
    for name in whole.manifest["graphs"]:
        graph_a = onnx.load(str(streamed.path_of(name)), load_external_data=False).graph
        graph_b = onnx.load(str(whole.path_of(name)), load_external_data=False).graph
        assert [v.name for v in graph_a.input] == [v.name for v in graph_b.input], name
        assert [v.name for v in graph_a.output] == [v.name for v in graph_b.output], name
        weights_a, weights_b = (
            {t.name: tuple(t.dims) for t in g.initializer if not t.name.startswith(("onnx::", "/"))}
            for g in (graph_a, graph_b)
        )
        assert weights_a == weights_b, name
        ops_a, ops_b = Counter(n.op_type for n in graph_a.node), Counter(n.op_type for n in graph_b.node)
        assert set((ops_a - ops_b) + (ops_b - ops_a)) <= SHAPE_OPS, name
        session_a, session_b = ortsession.for_graph(streamed, name), ortsession.for_graph(whole, name)
        for seed in (0, 1):
            feeds = _feeds(whole, name, seed)
            for x, y in zip(session_a.run(None, feeds), session_b.run(None, feeds)):
                assert x.shape == y.shape, name
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_streams_the_graphs_of_its_whole_export(family, tmp_path, capsys):
    build, cut = FAMILIES[family]
    torch.manual_seed(0)
    src = tmp_path / "src"
    model = build()
    model.to(torch.bfloat16).save_pretrained(src, max_shard_size="200KB")
    for name, data in getattr(model, "_vlmc_test_files", {}).items():  # processor files, if any
        (src / name).write_bytes(data)
    assert len(list(src.glob("*.safetensors"))) > 2
    lazy = exporters.load_source(str(src), lazy=True)
    assert lazy.streamed
    stacks = {name: len(m) for name, m in lazy.model.named_modules() if streaming.stack_of(m) is not None}
    assert stacks == cut
    streamed_pkg, whole_pkg = _export_streamed_and_whole(lazy, src, tmp_path, capsys)
    # the stitched decoder has every layer's KV interface
    layers = whole_pkg.manifest["kv"]["layers"]
    decoder = onnx.load(str(streamed_pkg.path_of("decoder")), load_external_data=False).graph
    assert f"past_key_values.{layers - 1}.value" in [v.name for v in decoder.input]
    # token-exact greedy generation through the runtime, an image and a text-only prompt
    marker = whole_pkg.manifest["text"]["image_marker"]
    assert _generate(streamed_pkg, marker) == _generate(whole_pkg, marker)


def _export_streamed_and_whole(
    lazy, src, tmp_path, capsys, lm_layers: int | None = None
) -> tuple[Package, Package]:
    """``lazy`` (a streamed source of ``src``) exported stitched, never loading the whole model, and ``src``
    loaded whole (with ``lm_layers`` decoder layers, where given) and exported; both packages, their graphs
    compared."""
    capsys.readouterr()
    exporters.export(lazy).save(tmp_path / "streamed")
    captured = capsys.readouterr()
    assert "loading the whole model" not in " ".join((captured.out + captured.err).split())  # stitched
    whole = exporters.load_source(str(src))
    assert not whole.streamed
    assert lm_layers is None or len(whole.model.language_model.model.layers) == lm_layers
    exporters.export(whole).save(tmp_path / "whole")
    streamed_pkg, whole_pkg = Package.load(tmp_path / "streamed"), Package.load(tmp_path / "whole")
    _compare_graphs(streamed_pkg, whole_pkg)
    return streamed_pkg, whole_pkg


def _generate(pkg: Package, marker: str) -> list:
    """Greedy tokens of a two-prompt batch, one with an image behind ``marker``, one text only."""
    from vlmc.runtime.pipeline import Pipeline

    prompts, images = [f"{marker}What is this?", "Say something."], [[_real_tokenizers.image(64, 96, 3)], []]
    pipeline = Pipeline(pkg)
    try:
        return pipeline.generate(prompts, images, max_new_tokens=6).tokens
    finally:
        pipeline.close()


def test_qwen_vl_streams_the_graphs_of_its_whole_export(tmp_path, capsys):
    """The native Qwen-VL rebuild (its own loader, the hub's names: q/k/v are row blocks of c_attn) streams like
    the transformers families: both stacks cut to two layers, the others read from the bf16 shards."""
    from _qwen_vl_hub import write_hub_copy

    src = write_hub_copy(tmp_path / "src", layers=5, vision_layers=4, dtype=torch.bfloat16, shards=3)
    lazy = exporters.load_source(str(src), lazy=True)
    assert lazy.streamed
    stacks = {name: len(m) for name, m in lazy.model.named_modules() if streaming.stack_of(m) is not None}
    assert stacks == {"visual.transformer.resblocks": 2, "language_model.model.layers": 2}
    assert lazy.config.num_hidden_layers == 5 and lazy.config.visual["layers"] == 4
    # only the traced layers' weights were read: q/k/v of a stitched layer are rows of its c_attn
    ckpt = streaming.stack_of(lazy.model.language_model.model.layers).checkpoint
    assert ckpt.rows["language_model.model.layers.4.self_attn.v_proj.weight"] == (512, 768)
    streamed_pkg, whole_pkg = _export_streamed_and_whole(lazy, src, tmp_path, capsys, lm_layers=5)
    vision = onnx.load(str(streamed_pkg.path_of("vision_encoder")), load_external_data=False).graph
    assert any(n.name.startswith("/visual/transformer/resblocks.3/") for n in vision.node)
    marker = whole_pkg.manifest["text"]["image_marker"]
    assert _generate(streamed_pkg, marker) == _generate(whole_pkg, marker)


def test_phi3_v_streams_the_graphs_of_its_whole_export(tmp_path, capsys):
    """The native Phi-3-vision rebuild (its own loader, the hub's names: q/k/v and gate/up are row blocks of
    qkv_proj / gate_up_proj) streams like the transformers families: the decoder and the CLIP tower (the layers up
    to layer_idx -2) cut to two layers, the others read from the bf16 shards."""
    from _phi3_v_hub import write_hub_copy

    src = write_hub_copy(
        tmp_path / "src", num_hidden_layers=5, vision_layers=6, dtype=torch.bfloat16, shards=3
    )
    lazy = exporters.load_source(str(src), lazy=True)
    assert lazy.streamed
    stacks = {name: len(m) for name, m in lazy.model.named_modules() if streaming.stack_of(m) is not None}
    assert stacks == {"vision_embed_tokens.img_processor.encoder.layers": 2, "language_model.model.layers": 2}
    assert lazy.config.num_hidden_layers == 5
    # only the traced layers' weights were read: a stitched layer's projections are rows of the fused ones
    ckpt = streaming.stack_of(lazy.model.language_model.model.layers).checkpoint
    assert ckpt.rows["language_model.model.layers.4.self_attn.v_proj.weight"] == (128, 192)
    assert ckpt.rows["language_model.model.layers.4.mlp.up_proj.weight"] == (128, 256)
    streamed_pkg, whole_pkg = _export_streamed_and_whole(lazy, src, tmp_path, capsys, lm_layers=5)
    assert streamed_pkg.manifest["kv"] == whole_pkg.manifest["kv"]
    # the pruning facts name the stitched tower's last layer, as the whole export's do
    assert streamed_pkg.manifest["vision"]["attention"]["layer"] == 4
    assert streamed_pkg.manifest["vision"]["attention"] == whole_pkg.manifest["vision"]["attention"]
    vision = onnx.load(str(streamed_pkg.path_of("vision_encoder")), load_external_data=False).graph
    assert any("/layers.4/" in n.name for n in vision.node)  # the 5 layers up to layer_idx -2
    assert not any("/layers.5/" in n.name for n in vision.node)
    decoder = onnx.load(str(streamed_pkg.path_of("decoder")), load_external_data=False).graph
    assert "past_key_values.4.value" in [v.name for v in decoder.input]
    marker = whole_pkg.manifest["text"]["image_marker"].replace("{n}", "1")
    assert _generate(streamed_pkg, marker) == _generate(whole_pkg, marker)


# ---- stitch() on hand-built graphs -----------------------------------------------------------

H = 4


def _chain(traced: int, skip_from: int | None = None, kinds=None) -> onnx.ModelProto:
    """x -> [layers.i: relu(h @ W_i + b_i) + h] * traced -> head (Mul by 2) -> y, named as torch names
    them (weights are graph inputs ``layers.i.w``; nodes are scoped ``/layers.i/``). ``skip_from``:
    the last layer also adds layer ``skip_from``'s output (a skip across layers). ``kinds``: layers
    of kind "sig" squash with Sigmoid instead of Relu."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    nodes, inputs = [], [helper.make_tensor_value_info("x", f, ["batch", H])]
    h = "x"
    outs = []
    for i in range(traced):
        s = f"/layers.{i}/"
        inputs += [
            helper.make_tensor_value_info(f"layers.{i}.w", f, [H, H]),
            helper.make_tensor_value_info(f"layers.{i}.b", f, [H]),
        ]
        nodes += [
            helper.make_node("MatMul", [h, f"layers.{i}.w"], [f"{s}MatMul_output_0"], name=f"{s}MatMul"),
            helper.make_node(
                "Add", [f"{s}MatMul_output_0", f"layers.{i}.b"], [f"{s}Add_output_0"], name=f"{s}Add"
            ),
            helper.make_node(
                "Sigmoid" if kinds is not None and kinds[i] == "sig" else "Relu",
                [f"{s}Add_output_0"],
                [f"{s}Relu_output_0"],
                name=f"{s}Relu",
            ),
            helper.make_node("Add", [f"{s}Relu_output_0", h], [f"{s}Add_1_output_0"], name=f"{s}Add_1"),
        ]
        if skip_from is not None and i == traced - 1:
            nodes.append(
                helper.make_node(
                    "Add", [f"{s}Add_1_output_0", outs[skip_from]], [f"{s}Add_2_output_0"], name=f"{s}Add_2"
                )
            )
            h = f"{s}Add_2_output_0"
        else:
            h = f"{s}Add_1_output_0"
        outs.append(h)
    nodes.append(helper.make_node("Mul", [h, "two"], ["y"], name="/head/Mul"))
    graph = helper.make_graph(
        nodes,
        "chain",
        inputs,
        [helper.make_tensor_value_info("y", f, ["batch", H])],
        initializer=[helper.make_tensor("two", f, [], [2.0])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _weights(depth: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for i in range(depth):
        out[f"layers.{i}.w"] = torch.randn(H, H, generator=g)
        out[f"layers.{i}.b"] = torch.randn(H, generator=g)
    return out


def _stack(tmp_path, weights, depth, kinds=None) -> streaming.Stack:
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / "model.safetensors"))
    ckpt = streaming.Checkpoint(tmp_path, {k: ("model.safetensors", k) for k in weights})
    return streaming.Stack(prefix="layers", depth=depth, checkpoint=ckpt, kinds=kinds)


def test_stitch_grows_a_chain_to_full_depth(tmp_path):
    import onnxruntime as ort

    depth = 5
    weights = _weights(depth)
    model = _chain(2)
    copies = streaming.stitch(model, "layers", _stack(tmp_path, weights, depth), traced=2)
    assert [c.name for c in copies] == [f"layers.{j}.{k}" for j in range(2, depth) for k in ("w", "b")]
    large = {k: v for k, v in weights.items() if k.startswith(("layers.0.", "layers.1."))}
    base._write_with_weights(model, large, tmp_path / "g.onnx", copies)
    onnx.checker.check_model(str(tmp_path / "g.onnx"))
    x = np.random.default_rng(0).standard_normal((3, H)).astype(np.float32)
    (y,) = ort.InferenceSession(str(tmp_path / "g.onnx")).run(None, {"x": x})
    h = torch.from_numpy(x)
    for i in range(depth):
        h = torch.relu(h @ weights[f"layers.{i}.w"] + weights[f"layers.{i}.b"]) + h
    np.testing.assert_allclose(y, (2 * h).numpy(), rtol=1e-6, atol=1e-6)
    names = [n.name for n in onnx.load(str(tmp_path / "g.onnx")).graph.node]
    assert f"/layers.{depth - 1}/Relu" in names and len(names) == len(set(names))


def test_stitch_refuses_a_skip_across_layers(tmp_path):
    weights = _weights(4)
    model = _chain(3, skip_from=0)
    with pytest.raises(streaming.StitchError, match="depends on other layers' weights"):
        streaming.stitch(model, "layers", _stack(tmp_path, weights, 4), traced=3)


def test_stitch_copies_each_layer_from_the_template_of_its_kind(tmp_path):
    import onnxruntime as ort

    kinds = ("relu", "relu", "sig") * 2  # traced: layers 0..2; templates: 1 (relu) and 2 (sig)
    depth = len(kinds)
    traced = streaming.traced_depth(kinds, streaming.TRACED_LAYERS)
    assert traced == 3
    weights = _weights(depth)
    model = _chain(traced, kinds=kinds)
    copies = streaming.stitch(model, "layers", _stack(tmp_path, weights, depth, kinds), traced=traced)
    assert [c.template for c in copies] == [f"layers.{t}.{k}" for t in (1, 1, 2) for k in ("w", "b")]
    large = {k: v for k, v in weights.items() if int(k.split(".")[1]) < traced}
    base._write_with_weights(model, large, tmp_path / "g.onnx", copies)
    x = np.random.default_rng(0).standard_normal((3, H)).astype(np.float32)
    (y,) = ort.InferenceSession(str(tmp_path / "g.onnx")).run(None, {"x": x})
    h = torch.from_numpy(x)
    for i in range(depth):
        squash = torch.sigmoid if kinds[i] == "sig" else torch.relu
        h = squash(h @ weights[f"layers.{i}.w"] + weights[f"layers.{i}.b"]) + h
    np.testing.assert_allclose(y, (2 * h).numpy(), rtol=1e-6, atol=1e-6)


def test_stitch_refuses_a_kind_it_has_no_template_for(tmp_path):
    kinds = ("relu", "relu", "relu", "sig")  # cut at 3: no traced "sig" layer
    weights = _weights(4)
    with pytest.raises(streaming.StitchError, match="no traced layer of kind"):
        streaming.stitch(_chain(3, kinds=kinds), "layers", _stack(tmp_path, weights, 4, kinds), traced=3)


@pytest.mark.parametrize(
    ("kinds", "fixed", "depth"),
    [
        (["sliding"] * 5 + ["full"], 0, 6),  # Gemma3's 5 : 1 pattern, 36 layers: layers 0..5
        ((["window"] * 7 + ["full"]) * 4, 0, 8),  # Qwen2.5-VL's ViT: full attention every 8th of 32
        (["cross", "self"] * 6, 0, 3),  # BLIP-2's Q-Former at cross_attention_frequency 2
        (["layer"] * 36, 3, 5),  # Qwen3-VL: deepstack into layers 0..2, then two plain layers
    ],
)
def test_traced_depth_holds_one_template_per_kind(kinds, fixed, depth):
    kinds = kinds * 6 if len(kinds) == 6 else kinds
    assert streaming.traced_depth(tuple(kinds), streaming.TRACED_LAYERS, fixed) == depth
    assert streaming.traced_depth(tuple(kinds[:depth]), streaming.TRACED_LAYERS, fixed) is None
