"""prune_visual_tokens' rewrite on small hand-built onnx-ir graphs: structure, numerics on onnxruntime,
and the unpruned model left as it was (the pass's fidelity report compares against it)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from vlmc import graphs, interop
from vlmc.errors import VlmcError
from vlmc.passes import prune_visual_tokens
from vlmc.passes.prune_visual_tokens import measure

IMAGES, HEADS, TOKENS, HIDDEN, OUT = 2, 2, 6, 3, 4
KEYS = TOKENS + 1  # a CLS key in front of the patch tokens
SCALE = 0.5
FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64


def _model(graph: ir.Graph) -> ir.Model:
    return ir.Model(graph, ir_version=10)


def _batched_model(opset: int = 17, out: int = OUT) -> ir.Model:
    """A CLS-style encoder tail: probs = Softmax(Q·Kᵀ·scale); image_features = patch tokens · W.

    Inputs q [images, heads, keys, 2], kt [images, heads, 2, keys], hidden [images, keys, HIDDEN].
    """
    q = ir.val("q", FLOAT, [IMAGES, HEADS, KEYS, 2])
    kt = ir.val("kt", FLOAT, [IMAGES, HEADS, 2, KEYS])
    hidden = ir.val("hidden", FLOAT, ["images", KEYS, HIDDEN])
    weight = ir.Value(
        name="proj.weight",
        const_value=ir.tensor(np.random.default_rng(0).standard_normal((HIDDEN, out)).astype(np.float32)),
    )
    scale = ir.Value(name="scale", const_value=ir.tensor(np.float32(SCALE)))
    bounds = [
        ir.Value(name=n, const_value=ir.tensor(np.array(v, np.int64)))
        for n, v in (("start", [1]), ("end", [KEYS]), ("axis", [1]))
    ]
    logits = ir.node("MatMul", [q, kt], name="layer/qk", outputs=[ir.Value(name="layer/logits")])
    scaled = ir.node("Mul", [logits.outputs[0], scale], outputs=[ir.Value(name="layer/scaled")])
    probs = ir.node("Softmax", [scaled.outputs[0]], {"axis": -1}, outputs=[ir.Value(name="layer/probs")])
    patches = ir.node("Slice", [hidden, *bounds], outputs=[ir.Value(name="patches")])
    feats = ir.node(
        "MatMul",
        [patches.outputs[0], weight],
        name="proj",
        outputs=[ir.val("image_features", FLOAT, ["images", TOKENS, out])],
    )
    graph = ir.Graph(
        [q, kt, hidden],
        [feats.outputs[0]],
        nodes=[logits, scaled, probs, patches, feats],
        initializers=[weight, scale, *bounds],
        opset_imports={"": opset},
        name="vision_encoder",
    )
    return _model(graph)


ATTENTION = {
    "graph": "vision_encoder",
    "probs": "layer/probs",
    "query": "q",
    "key_t": "kt",
    "scale": SCALE,
    "query_index": 0,
    "keys_per_image": KEYS,
    "token_offset": 1,
}


def _packed_model() -> ir.Model:
    """A packed encoder tail: features [all tokens, OUT] = Relu(x); a deepstack output aligned with it."""
    x = ir.val("x", FLOAT, ["tokens", OUT])
    grid = ir.val("image_grid_thw", INT64, ["images", 3])
    probs = ir.val("probs", FLOAT, [HEADS, "patches", "patches"])
    feats = ir.node("Relu", [x], outputs=[ir.val("image_features", FLOAT, ["tokens", OUT])])
    deep = ir.node("Neg", [x], outputs=[ir.val("deepstack_0", FLOAT, ["tokens", OUT])])
    graph = ir.Graph(
        [x, grid, probs],
        [feats.outputs[0], deep.outputs[0]],
        nodes=[feats, deep],
        opset_imports={"": 17},
        name="vision_encoder",
    )
    return _model(graph)


def _structure(model: ir.Model) -> list:
    """Everything a rewrite could change in place: IO, nodes with their wiring, initializers."""
    g = model.graph
    return [
        [(v.name, v.dtype, str(v.shape)) for v in g.inputs],
        [(v.name, v.dtype, str(v.shape)) for v in g.outputs],
        [
            (
                n.op_type,
                n.name,
                [i.name if i else None for i in n.inputs],
                [o.name for o in n.outputs],
                sorted(n.attributes),
            )
            for n in g
        ],
        sorted(g.initializers),
        dict(g.opset_imports),
    ]


def _run(model: ir.Model, feeds: dict) -> dict:
    sess = ort.InferenceSession(interop.session_bytes(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _check(model: ir.Model) -> None:
    with interop.as_proto(model, weight_limit=None) as seam:
        onnx.checker.check_model(seam.proto, full_check=True)


def _topk_sorted(scores: np.ndarray, k: int) -> np.ndarray:
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    kth = np.take_along_axis(scores, order[..., -1:], -1)
    rest = np.where(np.isin(np.arange(scores.shape[-1]), order), -np.inf, scores).max(-1, keepdims=True)
    assert np.all(kth - rest > 1e-6), "near-tie at the k-th score: the comparison would be meaningless"
    return np.sort(order, axis=-1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture
def batched_feeds() -> dict:
    rng = np.random.default_rng(1)
    return {
        "q": rng.standard_normal((IMAGES, HEADS, KEYS, 2)).astype(np.float32),
        "kt": rng.standard_normal((IMAGES, HEADS, 2, KEYS)).astype(np.float32),
        "hidden": rng.standard_normal((IMAGES, KEYS, HIDDEN)).astype(np.float32),
    }


# ---- batched layout --------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("method", ["cls_attention", "attention_received"])
@pytest.mark.parametrize("recompute", [False, True])
def test_attention_topk_matches_numpy(batched_feeds, method, recompute, opset):
    model = _batched_model(opset)
    before = _structure(model)
    keep = 3
    new, info = prune_visual_tokens.rewrite(model, method, keep, TOKENS, ATTENTION, recompute=recompute)
    assert info["score_source"] == ("recomputed" if recompute else "graph")
    assert _structure(model) == before  # the unpruned model is left as it was

    probs = _softmax(batched_feeds["q"] @ batched_feeds["kt"] * SCALE)  # [images, heads, keys, keys]
    attention = probs[:, :, 0, :] if method == "cls_attention" else probs.mean(2)
    expected = _topk_sorted(attention.mean(1)[:, 1:], keep)
    feats = batched_feeds["hidden"][:, 1:] @ model.graph.initializers["proj.weight"].const_value.numpy()
    got = _run(new, batched_feeds)
    np.testing.assert_array_equal(got[measure.INDICES_OUTPUT], expected)
    np.testing.assert_allclose(
        got["image_features"], np.take_along_axis(feats, expected[..., None], 1), rtol=1e-5, atol=1e-5
    )
    # the original still runs and still outputs every token
    np.testing.assert_allclose(_run(model, batched_feeds)["image_features"], feats, rtol=1e-5, atol=1e-5)


def test_batched_rewrite_structure():
    model = _batched_model()
    new, info = prune_visual_tokens.rewrite(model, "cls_attention", 3, TOKENS, ATTENTION)
    _check(new)
    g = new.graph
    assert [o.name for o in g.outputs] == ["image_features", measure.INDICES_OUTPUT]
    kept, indices = g.outputs
    assert kept.producer().op_type == "GatherElements"
    assert kept.producer().inputs[0].name == "image_features_unpruned"
    assert kept.producer().inputs[0].producer().name == "proj"  # the projector's output, renamed
    assert [str(d) for d in kept.shape] == ["images", "3", str(OUT)]
    assert indices.dtype == INT64 and [str(d) for d in indices.shape] == ["images", "3"]
    assert info["ops_added"] == sorted(
        {
            "Gather",
            "ReduceMean",
            "Reshape",
            "Slice",
            "TopK",
            "Cast",
            "Unsqueeze",
            "Shape",
            "Concat",
            "Expand",
            "GatherElements",
        }
    )
    # the rewrite reads the exposed probabilities: the Q·Kᵀ branch is shared, nothing recomputed
    assert [n.op_type for n in g].count("Softmax") == 1
    # the second TopK sorts the kept indices in int32 (Ascend's TopK takes int32)
    topks = [n for n in g if n.op_type == "TopK"]
    assert [n.attributes["largest"].value for n in topks] == [1, 0]
    assert topks[1].inputs[0].producer().attributes["to"].value == int(ir.DataType.INT32)
    # the original's weight is shared with the rewrite, not copied
    assert g.initializers["proj.weight"].const_value is model.graph.initializers["proj.weight"].const_value


def test_memory_mapped_weights_are_not_read(tmp_path):
    # 3 x 256 float32 = 3 KiB: above interop.EXTERNAL_DATA_THRESHOLD, so saved to the data file
    interop.save(_batched_model(out=256), tmp_path / "v.onnx")
    model = graphs.load_ir(tmp_path / "v.onnx")
    weight = model.graph.initializers["proj.weight"].const_value
    assert isinstance(weight, ir.ExternalTensor) and weight.raw is None
    new, _ = prune_visual_tokens.rewrite(model, "uniform", 2, TOKENS)
    assert new.graph.initializers["proj.weight"].const_value is weight
    assert weight.raw is None  # the data file was never mapped


@pytest.mark.parametrize("method", ["uniform", "random"])
def test_batched_baselines(batched_feeds, method):
    model = _batched_model()
    before = _structure(model)
    keep, seed = 4, 5
    new, info = prune_visual_tokens.rewrite(model, method, keep, TOKENS, seed=seed)
    _check(new)
    assert info["score_source"] == "constant"
    assert "TopK" not in info["ops_added"]
    assert _structure(model) == before
    expected = (
        prune_visual_tokens.uniform_indices(TOKENS, keep)
        if method == "uniform"
        else np.sort(np.argsort(-np.random.default_rng(seed).random(TOKENS).astype(np.float32))[:keep])
    )
    got = _run(new, batched_feeds)
    np.testing.assert_array_equal(got[measure.INDICES_OUTPUT], np.broadcast_to(expected, (IMAGES, keep)))
    full = _run(model, batched_feeds)["image_features"]
    np.testing.assert_array_equal(got["image_features"], full[:, expected])
    # the attention branch feeds no output any more and is removed
    assert "Softmax" not in {n.op_type for n in new.graph}
    assert "Softmax" in {n.op_type for n in model.graph}


# ---- packed layout (dynamic resolution) with a token-aligned output -------------------------------
PACKED = {"grid_input": "image_grid_thw", "group": 4, "max_tokens": 64}
GRID = np.array([[1, 4, 4], [1, 4, 6]], np.int64)  # 4 and 6 tokens after a 2x2 merge


@pytest.mark.parametrize("method", ["uniform", "random", "attention_received"])
def test_packed_per_image_topk_and_aligned_output(method):
    model = _packed_model()
    before = _structure(model)
    keep, seed = 3, 2
    sizes = [int(np.prod(g)) // 4 for g in GRID]
    rng = np.random.default_rng(3)
    feeds = {
        "x": rng.standard_normal((sum(sizes), OUT)).astype(np.float32),
        "image_grid_thw": GRID,
        "probs": rng.random((HEADS, 4 * sum(sizes), 4 * sum(sizes))).astype(np.float32),
    }
    att = {"graph": "vision_encoder", "probs": "probs", "merge_group": 4}
    new, info = prune_visual_tokens.rewrite(
        model, method, keep, None, att, seed=seed, packed=PACKED, aligned={"deepstack_0": 0}
    )
    _check(new)
    assert _structure(model) == before
    assert [o.name for o in new.graph.outputs] == ["image_features", "deepstack_0", measure.INDICES_OUTPUT]
    assert new.graph.outputs[1].producer().op_type == "Gather"
    # both outputs are gathered with the one flat index
    assert new.graph.outputs[1].producer().inputs[1] is new.graph.outputs[0].producer().inputs[1]

    token_scores = feeds["probs"].mean(1).mean(0).reshape(-1, 4).mean(1)
    got = _run(new, feeds)
    start = 0
    for i, n in enumerate(sizes):
        if method == "uniform":
            expected = prune_visual_tokens.uniform_indices(n, keep)
        elif method == "random":
            expected = prune_visual_tokens.random_indices(n, keep, seed)
        else:
            expected = _topk_sorted(token_scores[start : start + n][None], keep)[0]
        np.testing.assert_array_equal(got[measure.INDICES_OUTPUT][i], expected)
        rows = slice(i * keep, (i + 1) * keep)
        np.testing.assert_array_equal(
            got["image_features"][rows], np.maximum(feeds["x"][start + expected], 0)
        )
        np.testing.assert_array_equal(got["deepstack_0"][rows], -feeds["x"][start + expected])
        start += n


# ---- refusals ---------------------------------------------------------------------------------------
def test_missing_features_output_is_refused_and_model_untouched():
    model = _packed_model()
    model.graph.outputs[0].name = "features"
    before = _structure(model)
    with pytest.raises(VlmcError, match="no 'image_features' output"):
        prune_visual_tokens.rewrite(model, "uniform", 2, 4)
    assert _structure(model) == before


def test_missing_aligned_output_is_refused_and_model_untouched():
    model = _packed_model()
    before = _structure(model)
    with pytest.raises(VlmcError, match="no 'deepstack_9' output"):
        prune_visual_tokens.rewrite(model, "uniform", 2, None, packed=PACKED, aligned={"deepstack_9": 0})
    assert _structure(model) == before


def test_masked_attention_is_not_recomputed():
    with pytest.raises(VlmcError, match="masked"):
        prune_visual_tokens.rewrite(
            _batched_model(), "attention_received", 2, TOKENS, dict(ATTENTION, masked=True), recompute=True
        )
