"""tensor_parallel: the Megatron split into per-rank segments, run as rank processes joined by gloo.

The token-exact checks compare the ranks (separate processes, torch.distributed gloo all-reduce) with the
unsharded package on the same inputs. One group of processes per size serves every package of that size
(``RankGroup.open``), because process start and torch's import cost seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from vlmc import exporters, manager, recipe
from vlmc.cli import main
from vlmc.errors import PassFailed, VlmcError
from vlmc.package import Package
from vlmc.runtime import Pipeline
from vlmc.runtime.ranks import RankDecoder, RankGroup

PROMPTS = ["Describe the image.", "Hi"]  # different lengths: the second row is left-padded
IMAGES = [["demo:1"], []]
TOKENS = 8


def _build(src: Path, out: Path, passes: list[dict]) -> Path:
    pkg = manager.run(Package.load(src), recipe.from_dict({"passes": passes}).steps)
    pkg.save(out)
    return out


@pytest.fixture(scope="module")
def built(tiny_llava, mha, exported, tmp_path_factory):
    """Every package the token-exact checks run: name -> (sharded, unsharded reference)."""
    root = tmp_path_factory.mktemp("tp")
    int4 = {"decoder": {"weights": "int4", "group_size": 32}, "eval_samples": 0, "eval_tokens": 0}
    gqa_int4 = _build(tiny_llava, root / "gqa-int4", [{"quantize": int4}])
    prune = {"prune_visual_tokens": {"keep": 16, "calibration_images": 0, "picture": False}}
    pruned = _build(tiny_llava, root / "pruned", [prune])
    fold, simplify = {"fold_constants": {}}, {"simplify": {}}
    specs = {
        "gqa-tp2": (tiny_llava, [{"tensor_parallel": {"size": 2}}], tiny_llava),
        "mha-tp2": (mha, [{"tensor_parallel": {"size": 2}}], mha),
        "gqa-tp2-paged": (
            tiny_llava,
            [{"tensor_parallel": {"size": 2}}, {"paged_kv": {"block_size": 16}}],
            tiny_llava,
        ),
        "gqa-tp2-int4": (tiny_llava, [{"tensor_parallel": {"size": 2}}, {"quantize": int4}], gqa_int4),
        # prune before and after the split: the vision graph is replicated and left alone
        "gqa-prune-tp2": (tiny_llava, [prune, {"tensor_parallel": {"size": 2}}], pruned),
        "gqa-tp2-prune": (tiny_llava, [{"tensor_parallel": {"size": 2}}, prune], pruned),
        # M-RoPE positions and q/k/v biases (sliced with their heads)
        "qwen2-vl-tp2": (
            exported("tiny-qwen2-vl"),
            [{"tensor_parallel": {"size": 2}}],
            exported("tiny-qwen2-vl"),
        ),
        # fold_constants/simplify first bake the head counts into the attention's target shapes (and
        # leave unk__ dims on the residual stream): KV heads split (tp2) and replicated (tp4)
        "gqa-fold-simplify-tp2-paged": (
            tiny_llava,
            [fold, simplify, {"tensor_parallel": {"size": 2}}, {"paged_kv": {"block_size": 16}}],
            tiny_llava,
        ),
        "gqa-fold-simplify-tp4": (tiny_llava, [fold, simplify, {"tensor_parallel": {"size": 4}}], tiny_llava),
        "qwen2-vl-fold-simplify-tp2": (
            exported("tiny-qwen2-vl"),
            [fold, simplify, {"tensor_parallel": {"size": 2}}],
            exported("tiny-qwen2-vl"),
        ),
        # Qwen-VL's q/k/v carry c_attn's biases: simplify (onnxsim) fuses each MatMul + bias into
        # Reshape [-1, hidden] -> Gemm -> Reshape back to Concat(Shape[:-1], [width]), the whole model's width
        "qwen-vl-fold-simplify-tp2-paged": (
            exported("tiny-qwen-vl"),
            [fold, simplify, {"tensor_parallel": {"size": 2}}, {"paged_kv": {"block_size": 16}}],
            exported("tiny-qwen-vl"),
        ),
        "gqa-tp4": (tiny_llava, [{"tensor_parallel": {"size": 4}}], tiny_llava),
        "mha-tp4": (mha, [{"tensor_parallel": {"size": 4}}], mha),
        "mha-tp4-paged": (
            mha,
            [{"tensor_parallel": {"size": 4}}, {"paged_kv": {"block_size": 16}}],
            mha,
        ),
    }
    return {name: (_build(src, root / name, passes), ref) for name, (src, passes, ref) in specs.items()}


@pytest.fixture(scope="module")
def groups(built):
    """One rank group per size, started lazily and shared by every check of that size."""
    started: dict[int, RankGroup] = {}

    def get(name: str) -> RankGroup:
        path = built[name][0]
        size = Package.load(path).manifest["tensor_parallel"]["size"]
        if size not in started:
            started[size] = RankGroup(path)
        else:
            started[size].open(path)
        return started[size]

    yield get
    for g in started.values():
        g.close()


@pytest.mark.parametrize(
    "name",
    [
        "gqa-tp2",
        "mha-tp2",
        "gqa-tp2-paged",
        "gqa-tp2-int4",
        "gqa-prune-tp2",
        "gqa-tp2-prune",
        "qwen2-vl-tp2",
        "gqa-fold-simplify-tp2-paged",
        "gqa-fold-simplify-tp4",
        "qwen2-vl-fold-simplify-tp2",
        "qwen-vl-fold-simplify-tp2-paged",
        "gqa-tp4",
        "mha-tp4",
        "mha-tp4-paged",
    ],
)
def test_ranks_are_token_exact_with_the_unsharded_package(name, built, groups):
    path, ref = built[name]
    want = Pipeline(Package.load(ref)).generate(PROMPTS, IMAGES, TOKENS)
    group = groups(name)
    before = group.collectives()
    got = group.generate(PROMPTS, IMAGES, TOKENS)  # also checks every rank produced the same tokens
    assert got.tokens == want.tokens
    assert got.texts == want.texts
    np.testing.assert_allclose(got.prefill_logits, want.prefill_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(got.step_logits, want.step_logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # Two all-reduces per layer per decoder step, on every rank.
    layers = Package.load(path).manifest["kv"]["layers"]
    steps = len(got.step_logits)
    assert [a - b for a, b in zip(group.collectives(), before)] == [2 * layers * steps] * group.size


# Every other built-in's decoder (tiny-llava and tiny-qwen2-vl are above): Qwen2.5-VL, Qwen3-VL (deepstack
# rows added to the replicated stream, q/k norms), GLM-4.1V (post norms, partial rotary, fused gate_up),
# Gemma3 (sliding and global layers, pre/post norms), BLIP-2's OPT (biases in Gemms, learned positions,
# LayerNorm, the MLP's flattened residual), InternVL's Qwen2, LLaVA-NeXT's and OneVision's decoders.
FAMILIES = [
    "tiny-qwen2.5-vl",
    "tiny-qwen3-vl",
    "tiny-glm4v",
    "tiny-gemma3",
    "tiny-blip2",
    "tiny-internvl",
    "tiny-llava-next",
    "tiny-llava-onevision",
    "tiny-phi3-v",
]
FAMILY_PROMPTS, FAMILY_IMAGES, FAMILY_TOKENS = ["Describe the image."], [["demo:1"]], 4


@pytest.fixture(scope="module")
def family_run(exported, tmp_path_factory):
    """(family, passes) -> (the ranks' generation, the unsharded package's); one rank group per size."""
    root = tmp_path_factory.mktemp("tp-families")
    started: dict[int, RankGroup] = {}

    def run(family: str, passes: list[dict]):
        src = exported(family)
        out = _build(src, root / f"{family}-{len(list(root.iterdir()))}", passes)
        size = passes[0]["tensor_parallel"]["size"]
        if size not in started:
            started[size] = RankGroup(out)
        else:
            started[size].open(out)
        want = Pipeline(Package.load(src)).generate(FAMILY_PROMPTS, FAMILY_IMAGES, FAMILY_TOKENS)
        return out, started[size].generate(FAMILY_PROMPTS, FAMILY_IMAGES, FAMILY_TOKENS), want

    yield run
    for g in started.values():
        g.close()


def _assert_same_generation(got, want) -> None:
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.prefill_logits, want.prefill_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(got.step_logits, want.step_logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_tp2_paged_is_token_exact(family, family_run):
    out, got, want = family_run(family, [{"tensor_parallel": {"size": 2}}, {"paged_kv": {"block_size": 16}}])
    _assert_same_generation(got, want)
    m = Package.load(out).manifest
    assert (
        m["kv"]["layout"] == "paged"
        and m["tensor_parallel"]["heads_per_rank"] * 2 == m["tensor_parallel"]["heads"]
    )
    reduces = [s for s in m["tensor_parallel"]["plan"] if s["step"] == "all_reduce"]
    assert len(reduces) == 2 * m["kv"]["layers"]


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_contiguous_is_token_exact(family, size, family_run):
    """TP=2 and TP=4 (every tiny decoder has 4 heads and 2 or 4 KV heads) on the contiguous cache."""
    out, got, want = family_run(family, [{"tensor_parallel": {"size": size}}])
    _assert_same_generation(got, want)
    tp = Package.load(out).manifest["tensor_parallel"]
    assert tp["size"] == size and tp["kv"] == ("split" if tp["kv_heads"] % size == 0 else "replicated")


@pytest.mark.slow
def test_gemma3_with_soft_capping_is_token_exact(tmp_path):
    """Gemma-2-style soft-capping on Gemma3: the attention scores' cap is per head (it shards with the
    heads), the logits' cap is in the replicated head segment."""
    import torch

    from vlmc.exporters import gemma3

    torch.manual_seed(0)
    config = gemma3.tiny_gemma3_config(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    model = gemma3.build_tiny(config).eval()
    exporters._eager(model)
    source = exporters.Source(
        name="tiny-gemma3-softcap", model=model, config=model.config, family="gemma3", builtin=True
    )
    src = tmp_path / "pkg"
    exporters.export(source).save(src)
    out = _build(src, tmp_path / "tp2", [{"tensor_parallel": {"size": 2}}])
    want = Pipeline(Package.load(src)).generate(FAMILY_PROMPTS, FAMILY_IMAGES, FAMILY_TOKENS)
    group = RankGroup(out)
    try:
        got = group.generate(FAMILY_PROMPTS, FAMILY_IMAGES, FAMILY_TOKENS)
    finally:
        group.close()
    _assert_same_generation(got, want)
    assert float(np.abs(np.asarray(want.prefill_logits)).max()) <= 3.0  # the cap is in the graph


def test_row_biases_are_added_once(exported):
    """BLIP-2's OPT: column biases are sliced with their columns; a row projection's bias is added once
    (a Gemm's C on rank 0 only, a MatMul's bias Add after the all-reduce, in the next segment). The tiny
    OPT's biases are zeros, so they are made random here first."""
    from vlmc.passes import tensor_parallel

    src = exported("tiny-blip2")
    manifest = Package.load(src).manifest
    rng = np.random.default_rng(0)
    source = ir.load(src / "decoder.onnx")
    biases = {}
    for name, v in source.graph.initializers.items():
        if name.endswith(".bias") and ("fc" in name or "proj" in name):
            biases[name] = rng.standard_normal(tuple(v.shape)).astype(np.float32)
            v.const_value = ir.Tensor(biases[name], name=name)
    for rank in range(2):
        model = source.clone()
        cuts = tensor_parallel._find_cuts(model.graph, "decoder", 2)
        layout = tensor_parallel._layout(cuts, manifest, 2, "decoder")
        tensor_parallel._shard(model.graph, cuts, layout, rank, "decoder")
        mlp = cuts[1]
        (fc1,) = [c.proj for c in mlp.columns]
        assert fc1.node.op_type == mlp.row.node.op_type == "Gemm"
        full = biases[fc1.bias.name.split("/")[0]]
        half = len(full) // 2
        np.testing.assert_array_equal(fc1.bias.const_value.numpy(), full[rank * half : (rank + 1) * half])
        row_bias = mlp.row.node.inputs[2].const_value.numpy()
        want = biases[mlp.row.bias.name.split("/")[0]] if rank == 0 else np.zeros_like(row_bias)
        np.testing.assert_array_equal(row_bias, want)
        # out_proj's bias is a MatMul + Add after the partial sum: the Add reads the reduced value.
        attention = cuts[0]
        assert attention.row.bias_add is not None and attention.partial is attention.row.node.outputs[0]
        assert np.any(attention.row.bias.const_value.numpy())


def test_fused_gate_up_gives_each_rank_its_gate_and_up_slices(exported, tmp_path):
    """GLM-4.1V's gate_up_proj is chunked in two: rank r's weight is [gate_r | up_r]."""
    src = exported("tiny-glm4v")
    full = ir.load(src / "decoder.onnx")
    name = next(k for k in full.graph.initializers if "layers.0.mlp.gate_up_proj" in k)
    w = full.graph.initializers[name].const_value.numpy()
    inter = w.shape[1] // 2
    out = _build(src, tmp_path / "pkg", [{"tensor_parallel": {"size": 2}}])
    m = Package.load(out).manifest
    mlp = next(s for s in m["tensor_parallel"]["plan"] if s["step"] == "segment" and s["kind"] == "mlp")
    for rank, graph in enumerate(mlp["graphs"]):
        got = ir.load(out / m["graphs"][graph]["file"]).graph.initializers[name].const_value.numpy()
        half = inter // 2
        cols = [
            *range(rank * half, (rank + 1) * half),
            *range(inter + rank * half, inter + (rank + 1) * half),
        ]
        np.testing.assert_array_equal(got, w[:, cols])


def test_segments_after_fold_and_simplify_have_only_named_dims(built):
    """Every segment input and output dim is a number or a name the backends size (no unk__N)."""
    for name in ("gqa-fold-simplify-tp2-paged", "gqa-fold-simplify-tp4", "qwen-vl-fold-simplify-tp2-paged"):
        m = Package.load(built[name][0]).manifest
        dims = {
            d
            for g, info in m["graphs"].items()
            if ".rank" in g
            for io in info["inputs"] + info["outputs"]
            for d in io["shape"]
            if isinstance(d, str)
        }
        assert dims and not any(d.startswith("unk__") for d in dims), sorted(dims)


def test_fused_gemm_views_take_the_ranks_width(built):
    """After simplify, Qwen-VL's biased q/k/v are Gemms on the flattened stream, viewed back to
    [batch, sequence, width] by a Concat whose last entry is a constant: each rank's view reads its own
    projection's width (half the model's), not the whole model's."""
    path = built["qwen-vl-fold-simplify-tp2-paged"][0]
    m = Package.load(path).manifest
    tp = m["tensor_parallel"]
    rank_width = tp["heads_per_rank"] * m["kv"]["head_dim"]  # MHA: q, k and v alike
    checked = 0
    for name, info in m["graphs"].items():
        if ".rank" not in name:
            continue
        graph = ir.load(path / info["file"]).graph
        for gemm in (n for n in graph if n.op_type == "Gemm"):
            width = int(gemm.inputs[1].shape[0 if gemm.attributes.get_int("transB", 0) else 1])
            for view, i in gemm.outputs[0].uses():
                if view.op_type != "Reshape" or i != 0:
                    continue
                concat = view.inputs[1].producer()
                assert concat is not None and concat.op_type == "Concat"
                last = ir.convenience.get_const_tensor(concat.inputs[-1]).numpy().reshape(-1)
                assert int(last[0]) == width == rank_width, (name, gemm.name, int(last[0]), width)
                checked += 1
    assert checked >= 2 * 3 * m["kv"]["layers"]  # q, k and v of every layer on both ranks


def _weights(path: Path, graph: str) -> int:
    model = ir.load(path / f"{graph}.onnx")
    return sum(int(v.const_value.nbytes) for v in model.graph.initializers.values())


@pytest.mark.parametrize("name", ["gqa-tp2", "mha-tp4"])
def test_each_rank_holds_its_share_of_the_layer_weights(name, built):
    path, ref = built[name]
    m = Package.load(path).manifest
    tp, n = m["tensor_parallel"], m["tensor_parallel"]["size"]
    assert tp["kv"] == "split"
    plan = [s for s in tp["plan"] if s["step"] == "segment"]
    head = plan[-1]["graphs"]
    assert plan[-1]["kind"] == "head"
    full = _weights(ref, "decoder") - _weights(path, head[0])  # the layers: all but final norm + lm_head
    for r in range(n):
        layers = sum(_weights(path, s["graphs"][r]) for s in plan[:-1])
        # 1/N of every projection; only the RMSNorm weights (a few hundred bytes) are replicated.
        assert abs(layers / (full / n) - 1) < 0.03, (r, layers, full)
        assert _weights(path, head[r]) == _weights(path, head[0])  # lm_head replicated


def test_manifest_records_ranks_kv_share_and_host_plan(built):
    m = Package.load(built["gqa-tp2"][0]).manifest
    tp = m["tensor_parallel"]
    layers = m["kv"]["layers"]
    assert (tp["size"], tp["heads"], tp["heads_per_rank"], tp["kv_heads"], tp["kv_heads_per_rank"]) == (
        2,
        4,
        2,
        2,
        1,
    )
    assert tp["kv"] == "split" and tp["kv_heads_of_rank"] == [[0], [1]]
    steps = [s["step"] for s in tp["plan"]]
    assert steps == ["segment", "all_reduce"] * (2 * layers) + ["segment"]
    reduces = [s for s in tp["plan"] if s["step"] == "all_reduce"]
    assert [s["after"] for s in reduces] == ["attention output projection", "MLP down projection"] * layers
    assert all(s["op"] == "sum" for s in reduces)
    ranked = {n: g for n, g in m["graphs"].items() if "rank" in g}
    assert len(ranked) == 2 * (2 * layers + 1)
    for s in tp["plan"]:
        if s["step"] == "segment":
            assert [m["graphs"][g]["rank"] for g in s["graphs"]] == [0, 1]
    # Each rank's KV interface holds its share of the heads; the reduced tensors flow between segments.
    seg0 = m["graphs"][tp["plan"][0]["graphs"][1]]
    kv_in = [i for i in seg0["inputs"] if i["name"].startswith("past_key_values.")]
    assert kv_in and all(i["shape"][1] == 1 for i in kv_in)
    assert {o["name"] for o in seg0["outputs"]} == {
        "tp_partial.0",
        "tp_residual.0",
        "present.0.key",
        "present.0.value",
    }
    seg1 = m["graphs"][tp["plan"][2]["graphs"][0]]
    assert [i["name"] for i in seg1["inputs"]] == ["tp_residual.0", "tp_reduced.0"]
    for n in ranked:  # every segment is a valid ONNX model
        onnx.checker.check_model(str(built["gqa-tp2"][0] / m["graphs"][n]["file"]), full_check=True)
    # Where the size exceeds the KV heads, they are replicated and the manifest says which rank has which.
    tp4 = Package.load(built["gqa-tp4"][0]).manifest["tensor_parallel"]
    assert (tp4["kv"], tp4["kv_heads_per_rank"], tp4["kv_heads_of_rank"]) == (
        "replicated",
        1,
        [[0], [0], [1], [1]],
    )
    paged = Package.load(built["gqa-tp2-paged"][0]).manifest
    pool = next(i for i in paged["graphs"]["decoder.rank1.0"]["inputs"] if i["name"] == "key_cache.0")
    assert pool["shape"][2] == 1  # each rank's pool holds its KV heads


def _optimize(src: Path, out: Path, passes: list[dict]):
    rec = out.parent / f"{out.name}.yaml"
    rec.write_text(json.dumps({"passes": passes}))
    return CliRunner().invoke(main, ["optimize", str(src), "-r", str(rec), "-o", str(out)])


def test_size_that_does_not_divide_the_heads_is_refused_in_one_line(tiny_llava, tmp_path):
    res = _optimize(tiny_llava, tmp_path / "out", [{"tensor_parallel": {"size": 8}}])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert (
        lines[-1].startswith("vlmc: error:") and "size 8 does not divide the 4 attention heads" in lines[-1]
    )
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()
    res = _optimize(tiny_llava, tmp_path / "out", [{"tensor_parallel": {"size": 3}}])
    assert res.exit_code == 2 and "size=3 is not one of 2, 4, 8" in res.output


@pytest.mark.parametrize(
    "passes, message",
    [
        (
            [{"paged_kv": {"block_size": 16}}, {"tensor_parallel": {"size": 2}}],
            "run tensor_parallel before paged_kv",
        ),
        (
            [
                {"quantize": {"decoder": {"weights": "int4", "group_size": 32}, "eval_tokens": 0}},
                {"tensor_parallel": {"size": 2}},
            ],
            "run tensor_parallel before quantize",
        ),
        ([{"split": {"decoder_ranges": 2}}, {"tensor_parallel": {"size": 2}}], "split into 2 layer ranges"),
        ([{"merge": {}}, {"tensor_parallel": {"size": 2}}], "cannot run on a merged package"),
        ([{"tensor_parallel": {"size": 2}}, {"merge": {}}], "merge cannot run on a tensor-parallel package"),
        (
            [{"tensor_parallel": {"size": 2}}, {"split": {"decoder_ranges": 2}}],
            "split cannot run on a tensor-parallel package",
        ),
        ([{"tensor_parallel": {"size": 2}}, {"tensor_parallel": {"size": 2}}], "already split over 2 ranks"),
    ],
)
def test_orders_that_make_no_sense_are_refused(tiny_llava, passes, message):
    with pytest.raises(PassFailed, match=message):
        manager.run(Package.load(tiny_llava), recipe.from_dict({"passes": passes}).steps)


def test_a_decoder_without_residual_projections_is_refused():
    """A decoder whose layers are not residual blocks of projections is refused in one line."""
    from vlmc.passes.tensor_parallel import _find_cuts

    x = ir.Value(
        name="inputs_embeds", shape=ir.Shape(["batch", "sequence", 8]), type=ir.TensorType(ir.DataType.FLOAT)
    )
    w = ir.Value(name="w", const_value=ir.Tensor(np.ones((8, 8), np.float32)))
    w.shape = ir.Shape([8, 8])
    matmul = ir.node("MatMul", [x, w], name="proj")
    graph = ir.Graph([x], matmul.outputs, nodes=[matmul], initializers=[w], opset_imports={"": 17})
    with pytest.raises(VlmcError, match="found 0 residual projections") as err:
        _find_cuts(graph, "decoder", 1)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


def test_single_process_runtime_refuses_a_sharded_package(built):
    pkg = Package.load(built["gqa-tp2"][0])
    with pytest.raises(VlmcError, match="split over 2 ranks"):
        Pipeline(pkg).generate(PROMPTS, IMAGES, 2)
    with pytest.raises(VlmcError, match="not tensor-parallel"):
        RankDecoder({"kv": {}}, 0, None)


def test_missing_torch_is_one_line(built, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "torch", None
    )  # what an install without torch gives (found, not imported)
    res = CliRunner().invoke(
        main, ["run", str(built["gqa-tp2"][0]), "--prompt", "Hi", "--max-new-tokens", "2"]
    )
    assert res.exit_code == 2
    assert "needs torch (torch.distributed with the gloo backend" in res.output.strip().splitlines()[-1]


def test_ascend_compile_writes_per_rank_builds_host_plan_and_rank_table(built, tmp_path):
    out = tmp_path / "build"
    res = CliRunner().invoke(
        main, ["compile", str(built["gqa-tp2"][0]), "--soc", "Ascend910B4", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    c = json.loads((out / "compile.json").read_text())
    m = Package.load(built["gqa-tp2"][0]).manifest
    ranked = [b for b in c["builds"] if "rank" in b]
    assert {b["rank"] for b in ranked} == {0, 1}
    for b in c["builds"]:  # every rank-local graph's builds carry its rank; replicated ones carry none
        assert b.get("rank") == m["graphs"][b["graph"]].get("rank")
    tp = c["tensor_parallel"]
    assert tp["size"] == 2 and set(tp["replicated_builds"]) == {"embed_tokens", "vision_encoder"}
    assert sorted(tp["ranks"]["0"] + tp["ranks"]["1"]) == sorted(b["name"] for b in ranked)
    seg0 = tp["plan"][0]
    assert seg0["builds"][1] == {"prefill": "decoder.rank1.0_prefill", "decode": "decoder.rank1.0_decode"}
    assert tp["plan"][1]["call"].startswith("HcclAllReduce(sendBuf=tp_partial.0, recvBuf=tp_reduced.0")
    assert all("atc" in b["command"] and "--cluster_config" not in b["command"] for b in c["builds"])
    table = json.loads((out / tp["rank_table"]).read_text())
    assert table["server_list"][0]["device"] == [
        {"device_id": "0", "rank_id": "0"},
        {"device_id": "1", "rank_id": "1"},
    ]


def test_plan_tp_gives_one_cards_memory(tiny_llava):
    res = CliRunner().invoke(
        main, ["plan", str(tiny_llava), "--device-memory", "1GiB", "--tp", "4", "--json"]
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    t = d["tensor_parallel"]
    assert d["cards"] == 4 and t["size"] == 4
    # tiny-llava has 2 KV heads: at TP=4 each card keeps one, so per-card KV is half the model's.
    assert (t["kv"], t["kv_heads_per_card"]) == ("replicated", 1)
    assert t["kv_bytes_per_token"] * 2 == d["kv_bytes_per_token"]
    assert t["weight_bytes"] == t["replicated_bytes"] + t["sharded_bytes"] < d["weight_bytes"]
    res = CliRunner().invoke(main, ["plan", str(tiny_llava), "--device-memory", "1GiB", "--tp", "8"])
    assert res.exit_code == 2 and "--tp 8 does not divide the model's 4 attention heads" in res.output


def test_verify_runs_the_ranks_against_transformers(built, tmp_path):
    """Ground truth from outside vlmc: the source model in transformers against the gloo-joined ranks."""
    import shutil

    pkg_dir = tmp_path / "pkg"
    shutil.copytree(built["gqa-tp4"][0], pkg_dir)
    res = CliRunner().invoke(main, ["verify", str(pkg_dir), "--max-new-tokens", "6"])
    assert res.exit_code == 0, res.output
    v = json.loads((pkg_dir / "verify.json").read_text())
    assert v["passed"] and v["exact_package"] and v["token_agreement"] == 1.0
    assert v["prefill_logits_max_abs_diff"] <= 1e-4
