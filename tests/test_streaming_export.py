"""Streaming export (vlmc/exporters/streaming.py): a two-layer cut traced, the other layers stitched in.

The reference is the export of the whole model loaded by transformers (today's path, itself compared
with torch.onnx.export elsewhere); the streamed package must give the same numbers on onnxruntime
and the same tokens as transformers generate. Sources are saved with save_pretrained, sharded bf16
(the hub's layout, legacy key names) and one fp32 file.
"""

from __future__ import annotations

import json

import _real_tokenizers as R
import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from test_parity_raw_inputs import Family, _check

from vlmc import exporters, ortsession, samples
from vlmc.cli import main
from vlmc.exporters import base, streaming
from vlmc.package import Package

TEXT_LAYERS, VISION_LAYERS = 5, 6  # vision feature layer -2: 5 live vision layers
SOURCES = {
    "bf16-shards": {"dtype": torch.bfloat16, "max_shard_size": "300KB"},
    "fp32-one-file": {},
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    return {
        name: R.llava_dir(
            root / name, text_layers=TEXT_LAYERS, vision_layers=VISION_LAYERS, save_kwargs=kwargs
        )
        for name, kwargs in SOURCES.items()
    }


def _feeds(pkg: Package, name: str, seed: int) -> dict[str, np.ndarray]:
    return samples.load(pkg, name) if seed == 0 else samples.generate(pkg, name, seed=seed)


@pytest.mark.parametrize("kind", list(SOURCES))
def test_streamed_package_equals_the_whole_model_export(sources, kind, tmp_path):
    src = sources[kind]
    if kind == "bf16-shards":
        assert len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]) > 0
        assert len(list(src.glob("*.safetensors"))) > 2
    lazy = exporters.load_source(str(src), lazy=True)
    assert lazy.streamed
    assert len(lazy.model.model.language_model.layers) == streaming.TRACED_LAYERS
    assert len(lazy.model.model.vision_tower.encoder.layers) == 3  # 1 - (-2): two live layers
    assert lazy.config.text_config.num_hidden_layers == TEXT_LAYERS
    exporters.export(lazy).save(tmp_path / "streamed")
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
        from vlmc.exporters import processor as P

        self.pkg = Package.load(self.pkg_dir)
        self.proc = P.load(src)
        self.model = exporters.load_source(str(src)).model
        assert len(self.model.model.language_model.layers) == TEXT_LAYERS
        self.marker = self.pkg.manifest["text"]["image_marker"]


def test_streamed_export_generates_the_tokens_transformers_does(sources, tmp_path):
    pictures = [
        R.save_image(tmp_path / f"{i}.png", h, w, i) for i, (h, w) in enumerate([(120, 90), (64, 160)])
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
    src = R.llava_dir(tmp_path / "shallow")  # 2 decoder layers; 3 vision layers, feature layer -2
    lazy = exporters.load_source(str(src), lazy=True)
    assert not lazy.streamed
    assert len(lazy.model.model.language_model.layers) == 2


# ---- stitch() on hand-built graphs -----------------------------------------------------------

H = 4


def _chain(traced: int, skip_from: int | None = None) -> onnx.ModelProto:
    """x -> [layers.i: relu(h @ W_i + b_i) + h] * traced -> head (Mul by 2) -> y, named as torch names
    them (weights are graph inputs ``layers.i.w``; nodes are scoped ``/layers.i/``). ``skip_from``:
    the last layer also adds layer ``skip_from``'s output (a skip across layers)."""
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
            helper.make_node("Relu", [f"{s}Add_output_0"], [f"{s}Relu_output_0"], name=f"{s}Relu"),
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


def _stack(tmp_path, weights, depth) -> streaming.Stack:
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / "model.safetensors"))
    ckpt = streaming.Checkpoint(tmp_path, {k: ("model.safetensors", k) for k in weights})
    return streaming.Stack(prefix="layers", depth=depth, checkpoint=ckpt)


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
