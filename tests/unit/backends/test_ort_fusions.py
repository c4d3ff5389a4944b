"""vlmc.backends.ort.fusions on a small hand-built decoder layer (eager forms, as the exporters write them).

Each fusion is run on onnxruntime against the unfused graph; the graph's inputs and outputs stay.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import ortsession
from vlmc.backends.ort import fusions

FLOAT = ir.DataType.FLOAT
HEADS, HEAD_DIM, SEQ, PAST, POSITIONS = 2, 8, 3, 4, 32
HIDDEN = HEADS * HEAD_DIM


def _layer(kv_heads: int = HEADS, div_norm: bool = False) -> ir.Model:
    """x -> RMSNorm -> q/k/v -> rotary -> Concat(past) -> eager attention -> o -> residual -> RMSNorm."""
    rng = np.random.default_rng(0)
    tape = ir.tape.Tape()
    x = ir.val("inputs_embeds", FLOAT, [1, SEQ, HIDDEN])
    pos = ir.val("position_ids", ir.DataType.INT64, [1, SEQ])
    bias = ir.val("bias", FLOAT, [1, 1, SEQ, "total"])
    past_k = ir.val("past_key_values.0.key", FLOAT, [1, kv_heads, "past", HEAD_DIM])
    past_v = ir.val("past_key_values.0.value", FLOAT, [1, kv_heads, "past", HEAD_DIM])

    def init(name, arr):
        return tape.initializer(ir.tensor(np.asarray(arr, np.float32), name=name))

    def const_i64(name, arr):
        return tape.initializer(ir.tensor(np.asarray(arr, np.int64), name=name))

    two, eps = init("two", 2.0), init("eps", 1e-6)

    def rms(h, gname):
        ms = tape.op("ReduceMean", [tape.op("Pow", [h, two])], {"axes": [-1], "keepdims": 1})
        root = tape.op("Sqrt", [tape.op("Add", [ms, eps])])
        normed = tape.op("Div", [h, root]) if div_norm else tape.op("Mul", [h, tape.op("Reciprocal", [root])])
        return tape.op("Mul", [init(gname, 1 + 0.1 * rng.standard_normal(HIDDEN)), normed])

    # cos/sin from position_ids, as HF's rotary module traces: inv_freq x positions, cat(freqs, freqs)
    inv_freq = 1.0 / (10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    p = tape.op("Cast", [tape.op("Unsqueeze", [pos, const_i64("ax1", [1])])], {"to": FLOAT})  # [1,1,S]
    freqs = tape.op(
        "Transpose",
        [tape.op("MatMul", [init("inv_freq", inv_freq.reshape(1, -1, 1)), p])],
        {"perm": [0, 2, 1]},
    )
    emb = tape.op("Concat", [freqs, freqs], {"axis": -1})
    cos = tape.op("Unsqueeze", [tape.op("Cos", [emb]), const_i64("ax1b", [1])])
    sin = tape.op("Unsqueeze", [tape.op("Sin", [emb]), const_i64("ax1c", [1])])
    half = HEAD_DIM // 2

    def rotary(t):
        a = tape.op(
            "Slice",
            [
                t,
                const_i64(f"s{len(tape.nodes)}", [0]),
                const_i64(f"e{len(tape.nodes)}", [half]),
                const_i64(f"a{len(tape.nodes)}", [-1]),
            ],
        )
        b = tape.op(
            "Slice",
            [
                t,
                const_i64(f"s{len(tape.nodes)}", [half]),
                const_i64(f"e{len(tape.nodes)}", [HEAD_DIM]),
                const_i64(f"a{len(tape.nodes)}", [-1]),
            ],
        )
        rot = tape.op("Concat", [tape.op("Neg", [b]), a], {"axis": -1})
        return tape.op("Add", [tape.op("Mul", [t, cos]), tape.op("Mul", [rot, sin])])

    def heads(t, n, name):
        r = tape.op("Reshape", [t, const_i64(f"shape_{name}", [1, SEQ, n, HEAD_DIM])])
        r.shape = ir.Shape([1, SEQ, n, HEAD_DIM])
        return tape.op("Transpose", [r], {"perm": [0, 2, 1, 3]})

    h = rms(x, "input_norm")
    kvd = kv_heads * HEAD_DIM
    q = rotary(
        heads(tape.op("MatMul", [h, init("wq", rng.standard_normal((HIDDEN, HIDDEN)) * 0.3)]), HEADS, "q")
    )
    k = rotary(
        heads(tape.op("MatMul", [h, init("wk", rng.standard_normal((HIDDEN, kvd)) * 0.3)]), kv_heads, "k")
    )
    v = heads(tape.op("MatMul", [h, init("wv", rng.standard_normal((HIDDEN, kvd)) * 0.3)]), kv_heads, "v")
    k_all = tape.op("Concat", [past_k, k], {"axis": 2})
    v_all = tape.op("Concat", [past_v, v], {"axis": 2})
    k_all.name, v_all.name = "present.0.key", "present.0.value"
    k_use, v_use = k_all, v_all
    if kv_heads != HEADS:  # repeat_kv
        rep = HEADS // kv_heads
        k_use = tape.op(
            "Reshape",
            [
                tape.op(
                    "Expand",
                    [
                        tape.op("Unsqueeze", [k_all, const_i64("u2", [2])]),
                        const_i64("ex", [1, kv_heads, rep, 1, 1]),
                    ],
                ),
                const_i64("rs", [1, HEADS, -1, HEAD_DIM]),
            ],
        )
        v_use = tape.op(
            "Reshape",
            [
                tape.op(
                    "Expand",
                    [
                        tape.op("Unsqueeze", [v_all, const_i64("u2v", [2])]),
                        const_i64("exv", [1, kv_heads, rep, 1, 1]),
                    ],
                ),
                const_i64("rsv", [1, HEADS, -1, HEAD_DIM]),
            ],
        )
    scores = tape.op("MatMul", [q, tape.op("Transpose", [k_use], {"perm": [0, 1, 3, 2]})])
    scores = tape.op("Add", [tape.op("Mul", [scores, init("scale", HEAD_DIM**-0.5)]), bias])
    probs = tape.op("Softmax", [scores], {"axis": -1})
    ctx = tape.op("Transpose", [tape.op("MatMul", [probs, v_use])], {"perm": [0, 2, 1, 3]})
    ctx = tape.op("Reshape", [ctx, const_i64("merge", [1, SEQ, HIDDEN])])
    ctx.shape = ir.Shape([1, SEQ, HIDDEN])
    o = tape.op("MatMul", [ctx, init("wo", rng.standard_normal((HIDDEN, HIDDEN)) * 0.3)])
    resid = tape.op("Add", [x, o])
    resid.shape = ir.Shape([1, SEQ, HIDDEN])
    x.shape = ir.Shape([1, SEQ, HIDDEN])
    o.shape = ir.Shape([1, SEQ, HIDDEN])
    y = rms(resid, "post_norm")
    y.name = "logits"
    graph = ir.Graph(
        [x, pos, bias, past_k, past_v],
        [y, k_all, v_all],
        nodes=tape.nodes,
        initializers=tape.initializers,
        opset_imports={"": 17},
    )
    return ir.Model(graph, ir_version=8)


def _feeds(kv_heads: int = HEADS) -> dict:
    rng = np.random.default_rng(1)
    mask = np.zeros((1, 1, SEQ, PAST + SEQ), np.float32)
    mask[0, 0][np.triu_indices(SEQ, 1)[0], PAST + np.triu_indices(SEQ, 1)[1]] = np.finfo(np.float32).min
    return {
        "inputs_embeds": rng.standard_normal((1, SEQ, HIDDEN)).astype(np.float32),
        "position_ids": np.arange(PAST, PAST + SEQ, dtype=np.int64)[None],
        "bias": mask,
        "past_key_values.0.key": rng.standard_normal((1, kv_heads, PAST, HEAD_DIM)).astype(np.float32),
        "past_key_values.0.value": rng.standard_normal((1, kv_heads, PAST, HEAD_DIM)).astype(np.float32),
    }


def _run(model: ir.Model, feeds: dict) -> dict:
    sess = ortsession.from_model(model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _ops(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _signature(model: ir.Model) -> tuple:
    return [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]


def _close(got: dict, ref: dict, tol: float = 1e-5) -> None:
    assert set(got) == set(ref)
    for name, r in ref.items():
        np.testing.assert_allclose(got[name], r, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("div_norm", [False, True])
def test_rms_norms_become_simplified_and_skip_simplified(div_norm):
    model = _layer(div_norm=div_norm)
    ref = _run(model, _feeds())
    fused = model.clone()
    facts = fusions.fuse_rms_norms(fused)
    # the first norm reads the graph input; the second the residual Add, which the Skip form takes in
    assert facts["simplified"] == 1 and facts["skip_simplified"] == 1
    ops = _ops(fused)
    assert ops["SimplifiedLayerNormalization"] == 1 and ops["SkipSimplifiedLayerNormalization"] == 1
    assert "ReduceMean" not in ops and "Pow" not in ops and "Sqrt" not in ops
    assert _signature(fused) == _signature(model)
    _close(_run(fused, _feeds()), ref)


def test_rotary_becomes_rotary_embedding_with_caches_from_the_graph():
    model = _layer()
    ref = _run(model, _feeds())
    fused = model.clone()
    facts = fusions.fuse_rotary(fused, POSITIONS)
    assert facts["fused"] == 2 and "skipped" not in facts  # q and k
    ops = _ops(fused)
    assert ops["RotaryEmbedding"] == 2 and "Cos" not in ops and "Neg" not in ops
    cos = fused.graph.initializers["rotary_cos_cache_0"].const_value.numpy()
    inv_freq = 1.0 / (10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    np.testing.assert_allclose(cos, np.cos(np.arange(POSITIONS)[:, None] * inv_freq), rtol=1e-5, atol=1e-6)
    assert _signature(fused) == _signature(model)
    _close(_run(fused, _feeds()), ref)


def test_rotary_needs_a_2d_position_ids_input():
    model = _layer()
    model.graph.inputs[1].name = "pos"  # no input called position_ids
    facts = fusions.fuse_rotary(model, POSITIONS)
    assert facts["fused"] == 0 and "position_ids" in facts["skipped"]


def test_attention_becomes_multi_head_attention_over_the_past():
    model = _layer()
    feeds = _feeds()
    ref = _run(model, feeds)
    fused = model.clone()
    fusions.fuse_rms_norms(fused)
    fusions.fuse_rotary(fused, POSITIONS)
    facts = fusions.fuse_attention(fused)
    assert facts["fused"] == 1 and facts["kept"] == {}
    ops = _ops(fused)
    assert ops["MultiHeadAttention"] == 1 and "Softmax" not in ops and "Concat" not in ops
    node = next(n for n in fused.graph if n.op_type == "MultiHeadAttention")
    assert node.attributes["num_heads"].value == HEADS
    assert node.attributes["scale"].value == pytest.approx(HEAD_DIM**-0.5)
    assert _signature(fused) == _signature(model)  # present.0.key / value are still the graph's outputs
    _close(_run(fused, feeds), ref)
    # an empty past (the first prefill) too
    empty = dict(feeds, **{k: v[:, :, :0] for k, v in feeds.items() if k.startswith("past")})
    empty["bias"] = feeds["bias"][..., PAST:]
    empty["position_ids"] = np.arange(SEQ, dtype=np.int64)[None]
    _close(_run(fused, empty), _run(model, empty))


def _empty_past(feeds: dict) -> dict:
    """The first prefill: no cached positions."""
    empty = dict(feeds, **{k: v[:, :, :0] for k, v in feeds.items() if k.startswith("past")})
    empty["bias"] = feeds["bias"][..., PAST:]
    empty["position_ids"] = np.arange(SEQ, dtype=np.int64)[None]
    return empty


def test_attention_reads_an_unfused_rotary_through_transpose_and_reshape():
    """M-RoPE's rotary stays unfused (its positions are [3, batch, seq]); attention still fuses, the rotary's
    BNSH output put back to [batch, seq, hidden] by Transpose + Reshape (a copy)."""
    model = _layer()
    feeds = _feeds()
    ref = _run(model, feeds)
    fused = model.clone()
    facts = fusions.fuse_attention(fused)  # no rotary fusion before it
    assert facts["fused"] == 1 and facts["kept"] == {}
    ops = _ops(fused)
    assert ops["MultiHeadAttention"] == 1 and "Softmax" not in ops and "RotaryEmbedding" not in ops
    assert "Neg" in ops  # the rotary, as the graph wrote it
    node = next(n for n in fused.graph if n.op_type == "MultiHeadAttention")
    for i in (0, 1):  # query and key: Reshape(Transpose(rotary output))
        rs = node.inputs[i].producer()
        assert rs.op_type == "Reshape" and rs.inputs[0].producer().op_type == "Transpose"
        assert rs.inputs[0].producer().inputs[0].producer().op_type == "Add"
    assert node.inputs[2].producer().op_type == "MatMul"  # value: the projection itself
    assert _signature(fused) == _signature(model)
    _close(_run(fused, feeds), ref)
    _close(_run(fused, _empty_past(feeds)), _run(model, _empty_past(feeds)))


@pytest.mark.parametrize("rotary", [True, False], ids=["rotary-fused", "rotary-unfused"])
def test_attention_with_fewer_kv_heads_is_kept_with_the_reason(rotary):
    model = _layer(kv_heads=1)  # 2 query heads over 1 KV head: repeat_kv after the cache Concat
    feeds = _feeds(kv_heads=1)
    ref = _run(model, feeds)
    if rotary:
        fusions.fuse_rotary(model, POSITIONS)
    facts = fusions.fuse_attention(model)
    assert facts["fused"] == 0 and len(facts["kept"]) == 1
    why = next(iter(facts["kept"].values()))
    assert why == fusions.GROUPED and "GroupQueryAttention" in why and "batch > 1 over a past" in why
    assert "Softmax" in _ops(model) and "MultiHeadAttention" not in _ops(model)
    _close(_run(model, feeds), ref)


def test_attention_that_matches_nothing_leaves_the_graph_as_it_is():
    model = _layer()
    # the scale is no scalar: the score path is not the eager form the rule takes
    scale = next(n for n in model.graph if n.op_type == "Mul" and n.inputs[1].name == "scale")
    scale.inputs[1].const_value = ir.tensor(np.full((1, 1, 1, 1 + PAST + SEQ - 1), 0.3, np.float32))
    before = [(n.op_type, [i.name if i is not None else None for i in n.inputs]) for n in model.graph]
    facts = fusions.fuse_attention(model)
    assert facts["fused"] == 0 and facts["kept"] == {}
    assert [(n.op_type, [i.name if i is not None else None for i in n.inputs]) for n in model.graph] == before
    assert "com.microsoft" not in model.opset_imports
