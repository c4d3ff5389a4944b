"""paged_kv's rewrite on small hand-built onnx-ir decoders: structure, numerics on onnxruntime, and no weight read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common
import onnxruntime
import pytest

from vlmc import graphs, interop, tensor_names
from vlmc import manifest as manifest_module
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.package import signature as graph_signature
from vlmc.passes import paged_kv
from vlmc.runtime.paged import write_rows

BLOCK = 16
FLOAT = ir.DataType.FLOAT
INT64 = ir.DataType.INT64


def _decoder(
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 4,
    vocab: int = 16,
    layer_weight_copies: int = 1,
    seed: int = 0,
) -> ir.Model:
    """A decoder with the contiguous KV interface: per layer q/k/v/o projections and one softmax attention.

    IO as the exporters write it: inputs_embeds, attention_mask [batch, past + seq], position_ids,
    past_key_values.{i}.{key,value} [batch, heads, past, head_dim] in; logits and present.{i}.* out.
    Keys get a position-dependent offset (a stand-in for RoPE), so positions must reach the decoder.
    ``layer_weight_copies`` > 1 adds unused-looking but real weight mass: the o projection is the
    sum of that many matrices (for the memory tests, which want many separate weights).
    """
    rng = np.random.default_rng(seed)
    hidden = heads * head_dim
    tape = ir.tape.Tape()

    def weight(name: str, shape: tuple[int, ...]) -> ir.Value:
        array = (0.4 * rng.standard_normal(shape)).astype(np.float32)
        return tape.initializer(ir.tensor(array, name=name))

    def const(name: str, array: np.ndarray) -> ir.Value:
        return tape.initializer(ir.tensor(array, name=name))

    embeds = ir.val("inputs_embeds", FLOAT, ["batch", "sequence", hidden])
    mask = ir.val("attention_mask", INT64, ["batch", "total_sequence"])
    positions = ir.val("position_ids", INT64, ["batch", "sequence"])
    past = {
        (i, kind): ir.val(tensor_names.past(i, kind), FLOAT, ["batch", heads, "past_sequence", head_dim])
        for i in range(layers)
        for kind in tensor_names.KV_KINDS
    }
    split_heads = const("split_heads", np.array([0, 0, heads, head_dim], np.int64))
    merge_heads = const("merge_heads", np.array([0, 0, hidden], np.int64))
    axes_mask = const("axes_mask", np.array([1, 2], np.int64))
    axes_position = const("axes_position", np.array([1, 3], np.int64))
    one = const("one", np.array(1.0, np.float32))
    minus_big = const("minus_big", np.array(-1e4, np.float32))
    position_scale = const("position_scale", np.array(0.1, np.float32))
    scale = const("scale", np.array(head_dim**-0.5, np.float32))

    mask_float = tape.op("Cast", [mask], {"to": FLOAT})
    bias = tape.op("Mul", [tape.op("Sub", [one, mask_float]), minus_big])
    bias = tape.op("Unsqueeze", [bias, axes_mask])  # [B, 1, 1, T]
    shift = tape.op("Cast", [positions], {"to": FLOAT})
    shift = tape.op("Mul", [tape.op("Unsqueeze", [shift, axes_position]), position_scale])  # [B, 1, S, 1]

    def heads_of(x: ir.Value, w: ir.Value) -> ir.Value:
        projected = tape.op("Reshape", [tape.op("MatMul", [x, w]), split_heads])
        return tape.op("Transpose", [projected], {"perm": [0, 2, 1, 3]})  # [B, H, S, D]

    x = embeds
    presents = []
    for i in range(layers):
        q = heads_of(x, weight(f"layers.{i}.q", (hidden, hidden)))
        k = tape.op("Add", [heads_of(x, weight(f"layers.{i}.k", (hidden, hidden))), shift])
        v = heads_of(x, weight(f"layers.{i}.v", (hidden, hidden)))
        present_k = tape.op("Concat", [past[(i, "key")], k], {"axis": 2})
        present_v = tape.op("Concat", [past[(i, "value")], v], {"axis": 2})
        for present, kind in ((present_k, "key"), (present_v, "value")):
            present.name = tensor_names.present(i, kind)
            present.dtype, present.shape = FLOAT, ir.Shape(["batch", heads, "total_sequence", head_dim])
            presents.append(present)
        keys_t = tape.op("Transpose", [present_k], {"perm": [0, 1, 3, 2]})
        scores = tape.op("Add", [tape.op("Mul", [tape.op("MatMul", [q, keys_t]), scale]), bias])
        probs = tape.op("Softmax", [scores], {"axis": -1})
        context = tape.op("Transpose", [tape.op("MatMul", [probs, present_v])], {"perm": [0, 2, 1, 3]})
        context = tape.op("Reshape", [context, merge_heads])
        out = tape.op("MatMul", [context, weight(f"layers.{i}.o", (hidden, hidden))])
        for copy in range(1, layer_weight_copies):
            out = tape.op(
                "Add", [out, tape.op("MatMul", [context, weight(f"layers.{i}.o{copy}", (hidden, hidden))])]
            )
        x = tape.op("Add", [x, out])
    logits = tape.op("MatMul", [x, weight("lm_head", (hidden, vocab))])
    logits.name = "logits"
    logits.dtype, logits.shape = FLOAT, ir.Shape(["batch", "sequence", vocab])
    for node_index, node in enumerate(tape.nodes):
        node.name = f"/decoder/{node.op_type}_{node_index}"
    graph = ir.Graph(
        inputs=[embeds, mask, positions, *past.values()],
        outputs=[logits, *presents],
        nodes=tape.nodes,
        initializers=tape.initializers,
        opset_imports={"": 17},
        name="decoder",
    )
    return ir.Model(graph, ir_version=8)


def _session(model: ir.Model) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(
        interop.session_bytes(model), options, providers=["CPUExecutionProvider"]
    )


def _run(session: onnxruntime.InferenceSession, feeds: dict) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


# ---- structure ----------------------------------------------------------------------------------
def test_rewrite_keeps_the_decoder_and_adds_the_paged_interface():
    model = _decoder(layers=2, heads=2, head_dim=4)
    body = list(model.graph)
    past = {v.name: v for v in model.graph.inputs if tensor_names.is_past(v.name)}
    mask = next(v for v in model.graph.inputs if v.name == "attention_mask")
    present = {v.name: v for v in model.graph.outputs if tensor_names.PRESENT_RE.match(v.name)}
    uses_before = {name: sorted((n.name, i) for n, i in v.uses()) for name, v in past.items()}
    weights = dict(model.graph.initializers)

    assert paged_kv.rewrite(model, BLOCK, None, kv_heads=2, head_dim=4) == [0, 1]
    graph = model.graph

    # IO exactly as docs/paged_kv.md lists it: the other inputs, the pools in layer order, the three
    # paged inputs; logits then each layer's new rows.
    assert [v.name for v in graph.inputs] == [
        "inputs_embeds",
        "position_ids",
        *(tensor_names.cache(i, kind) for i in (0, 1) for kind in tensor_names.KV_KINDS),
        *tensor_names.PAGED_INPUTS,
    ]
    assert [v.name for v in graph.outputs] == [
        "logits",
        *(tensor_names.new_rows(i, kind) for i in (0, 1) for kind in tensor_names.KV_KINDS),
    ]
    signature = graph_signature(model)
    by_name = {e["name"]: e for e in signature["inputs"] + signature["outputs"]}
    assert by_name["key_cache.1"] == {
        "name": "key_cache.1",
        "dtype": "float32",
        "shape": ["num_blocks", BLOCK, 2, 4],
    }
    assert by_name["block_tables"]["shape"] == ["batch", "max_blocks"]
    assert by_name["slot_mapping"] == {
        "name": "slot_mapping",
        "dtype": "int32",
        "shape": ["batch", "sequence"],
    }
    assert by_name["context_lens"] == {"name": "context_lens", "dtype": "int32", "shape": ["batch"]}
    assert by_name["new_value.0"]["shape"] == ["batch", "sequence", 2, 4]

    # The decoder's nodes are the same objects, in the same order, between the prefix and the suffix;
    # the former inputs are the same values, now computed by the prefix, with their uses untouched.
    nodes = list(graph)
    start = nodes.index(body[0])
    assert nodes[start : start + len(body)] == body
    assert all(n.name.startswith(paged_kv.PREFIX) for n in nodes[:start] + nodes[start + len(body) :])
    for name, value in past.items():
        assert not value.is_graph_input() and value.producer().op_type == "Gather"
        assert sorted((n.name, i) for n, i in value.uses()) == uses_before[name]
        reshape = value.producer().inputs[0].producer()
        assert reshape.op_type == "Reshape" and tensor_names.is_cache(reshape.inputs[0].name)
    assert mask.producer().op_type == "Concat" and not mask.is_graph_input()
    for value in present.values():
        assert not value.is_graph_output()
        ((use, index),) = [(n, i) for n, i in value.uses() if n.name.startswith(paged_kv.PREFIX)]
        assert use.op_type == "Slice" and index == 0
        ((transpose, _),) = use.outputs[0].uses()
        assert transpose.op_type == "Transpose" and transpose.outputs[0].is_graph_output()
    # A pool is only read: one Reshape (a view), feeding one Gather as its data.
    for pool in [v for v in graph.inputs if tensor_names.is_cache(v.name)]:
        ((reader, _),) = pool.uses()
        ((gather, index),) = reader.outputs[0].uses()
        assert (reader.op_type, gather.op_type, index) == ("Reshape", "Gather", 0)
    # The decoder's weights are the same values and tensors; the added constants are small.
    for name, value in weights.items():
        assert graph.initializers[name] is value and value.const_value is weights[name].const_value
    added = [v for n, v in graph.initializers.items() if n not in weights]
    assert added and all(
        v.name.startswith(paged_kv.PREFIX) and v.const_value.nbytes <= 8 * BLOCK for v in added
    )
    assert len([n for n in nodes if n.op_type == "Gather"]) == 2 * 2 + 1
    assert "ScatterND" not in {n.op_type for n in nodes}
    interop.check(model, "decoder")  # onnx.checker (full) and strict shape inference
    # Placed in order and nothing left dangling: onnx-ir's own sort and dead-node removal change nothing.
    assert not ir.passes.common.TopologicalSortPass()(model).modified
    assert not ir.passes.common.RemoveUnusedNodesPass()(model).modified
    assert list(model.graph) == nodes


@pytest.mark.parametrize("block_size", [128, 512])
def test_default_and_largest_block_sizes_pass_the_graph_check(block_size):
    # From block_size 128 the block offsets (int64) reach the 1 KiB external-data size; the manager's
    # check (checker + shape inference with data propagation) must still see their values.
    model = _decoder(layers=1)
    paged_kv.rewrite(model, block_size, None, kv_heads=2, head_dim=4)
    assert model.graph.initializers[paged_kv.PREFIX + "offsets"].const_value.nbytes == 8 * block_size
    interop.check(model, "decoder")


def test_fixed_pool_size_and_kv_heads_go_into_the_pool_shape():
    model = _decoder(layers=1, heads=2, head_dim=4)
    paged_kv.rewrite(model, 32, 7, kv_heads=2, head_dim=4)
    pool = next(v for v in model.graph.inputs if v.name == "value_cache.0")
    assert list(pool.shape) == [7, 32, 2, 4] and pool.dtype == FLOAT


@pytest.mark.parametrize(
    "edit, message",
    [
        ("drop_mask", "no attention_mask input"),
        ("drop_present", "do not pair up"),
        ("clash", "already has a tensor named 'block_tables'"),
    ],
)
def test_rewrite_refuses_a_graph_without_the_contiguous_interface(edit, message):
    model = _decoder(layers=1)
    graph = model.graph
    if edit == "drop_mask":
        graph.inputs.remove(next(v for v in graph.inputs if v.name == "attention_mask"))
    elif edit == "drop_present":
        graph.outputs.remove(next(v for v in graph.outputs if v.name == "present.0.value"))
    else:
        next(v for v in graph.inputs if v.name == "position_ids").name = "block_tables"
    state = (list(graph.inputs), list(graph.outputs), list(graph))
    with pytest.raises(VlmcError, match=message):
        paged_kv.rewrite(model, BLOCK, None, kv_heads=2, head_dim=4)
    assert (list(graph.inputs), list(graph.outputs), list(graph)) == state  # refused before any edit


# ---- numerics on onnxruntime ---------------------------------------------------------------------
def _paged_feeds(
    past_k: dict, past_v: dict, past_lens: list[int], seq: int, heads: int, head_dim: int, rng
) -> tuple[dict, np.ndarray]:
    """Pools holding each sequence's past at shuffled, non-contiguous blocks, and the paged inputs."""
    batch = len(past_lens)
    max_blocks = max(-(-(p + seq) // BLOCK) for p in past_lens)
    num_blocks = 2 * batch * max_blocks + 3
    order = rng.permutation(np.arange(1, num_blocks))  # block 0: the runtime's null block
    tables = np.stack([order[b * max_blocks : (b + 1) * max_blocks] for b in range(batch)]).astype(np.int32)
    feeds = {}
    for (i, kind), source in [*((k, v) for k, v in past_k.items()), *((k, v) for k, v in past_v.items())]:
        pool = (50 * rng.standard_normal((num_blocks, BLOCK, heads, head_dim))).astype(np.float32)  # garbage
        for b, length in enumerate(past_lens):
            stored = np.arange(length)
            slots = tables[b][stored // BLOCK] * BLOCK + stored % BLOCK
            # the contiguous past is left padded: sequence b's rows are its last ``length`` positions
            rows = source[b, :, source.shape[2] - length :].transpose(1, 0, 2)[None]
            write_rows(pool, np.ascontiguousarray(rows), slots[None].astype(np.int32))
        feeds[tensor_names.cache(i, kind)] = pool
    slot_mapping = np.zeros((batch, seq), np.int32)
    for b, length in enumerate(past_lens):
        new = np.arange(length, length + seq)
        slot_mapping[b] = tables[b][new // BLOCK] * BLOCK + new % BLOCK
    feeds.update(
        {
            "block_tables": tables,
            "slot_mapping": slot_mapping,
            "context_lens": np.array([p + seq for p in past_lens], np.int32),
        }
    )
    return feeds, slot_mapping


@pytest.mark.parametrize("seq", [1, 3])
def test_paged_graph_matches_the_contiguous_one_on_onnxruntime(seq):
    layers, heads, head_dim = 2, 2, 4
    contiguous = _decoder(layers, heads, head_dim)
    paged = _decoder(layers, heads, head_dim)
    paged_kv.rewrite(paged, BLOCK, None, heads, head_dim)
    rng = np.random.default_rng(1)
    past_lens = [21, 5]  # different lengths; the contiguous batch left-pads the shorter past
    longest = max(past_lens)
    past_k = {
        (i, "key"): rng.standard_normal((2, heads, longest, head_dim)).astype(np.float32)
        for i in range(layers)
    }
    past_v = {
        (i, "value"): rng.standard_normal((2, heads, longest, head_dim)).astype(np.float32)
        for i in range(layers)
    }
    embeds = rng.standard_normal((2, seq, heads * head_dim)).astype(np.float32)
    positions = np.stack([np.arange(p, p + seq) for p in past_lens]).astype(np.int64)
    mask = np.zeros((2, longest + seq), np.int64)
    for b, length in enumerate(past_lens):
        mask[b, longest - length :] = 1
    want = _run(
        _session(contiguous),
        {
            "inputs_embeds": embeds,
            "attention_mask": mask,
            "position_ids": positions,
            **{tensor_names.past(i, k): a for (i, k), a in {**past_k, **past_v}.items()},
        },
    )
    feeds, slots = _paged_feeds(past_k, past_v, past_lens, seq, heads, head_dim, rng)
    pools_before = {n: feeds[n].copy() for n in feeds if tensor_names.is_cache(n)}
    session = _session(paged)
    got = _run(session, {"inputs_embeds": embeds, "position_ids": positions, **feeds})

    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    for i in range(layers):
        for kind in tensor_names.KV_KINDS:
            rows = got[tensor_names.new_rows(i, kind)]
            assert rows.shape == (2, seq, heads, head_dim)
            expected = want[tensor_names.present(i, kind)][:, :, -seq:].transpose(0, 2, 1, 3)
            np.testing.assert_allclose(rows, expected, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(
                feeds[tensor_names.cache(i, kind)], pools_before[tensor_names.cache(i, kind)]
            )

    # A padding position (slot -1, not counted in context_lens) is masked for every query and its row
    # is never stored: sequence 0 gives the same logits as without the padded sequence 1 beside it.
    padded = dict(feeds, slot_mapping=slots.copy(), context_lens=feeds["context_lens"].copy())
    padded["slot_mapping"][1, 0] = -1
    padded["context_lens"][1] -= 1
    got_padded = _run(session, {"inputs_embeds": embeds, "position_ids": positions, **padded})
    np.testing.assert_allclose(got_padded["logits"][0], want["logits"][0], rtol=1e-5, atol=1e-5)
    if seq > 1:  # the padded position is masked for the other queries of its own row
        assert not np.allclose(got_padded["logits"][1, 1:], want["logits"][1, 1:], atol=1e-5)


# ---- no weight is read ---------------------------------------------------------------------------
def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak_rss() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_rss()


def _external(model: ir.Model) -> list[ir.ExternalTensor]:
    return [
        v.const_value
        for v in model.graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor)
    ]


def _mapped(tensors: list[ir.ExternalTensor]) -> list[str]:
    """Names of the file-backed weights whose bytes were mapped in (``raw`` is set when a tensor is read)."""
    return [t.name for t in tensors if t.raw is not None]


@pytest.fixture
def big_decoder(tmp_path) -> tuple[Path, int]:
    """A decoder file whose weights (4 layers x 6 matrices of 1 MiB, 24 MiB) sit in its data file."""
    model = _decoder(layers=4, heads=8, head_dim=64, vocab=512, layer_weight_copies=3)
    path = tmp_path / "decoder.onnx"
    interop.save(model, path)
    weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values())
    return path, weight_bytes


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_rewrite_reads_no_weight_of_a_memory_mapped_decoder(big_decoder):
    path, weight_bytes = big_decoder
    model = graphs.load_ir(path)
    weights = _external(model)
    assert sum(t.nbytes for t in weights) > 0.95 * weight_bytes > 20 * 2**20
    base = _reset_peak_rss()
    paged_kv.rewrite(model, BLOCK, None, kv_heads=8, head_dim=64)
    grew = _peak_rss() - base
    assert _mapped(weights) == []
    assert grew < weight_bytes // 4, f"peak RSS grew by {grew / 2**20:.1f} MiB"
    # The checks see a read: reading the weights into memory maps every one in and grows the peak
    # by their size (copied: mapped file pages alone may be reclaimed on a loaded machine).
    base = _reset_peak_rss()
    copies = [np.array(t.numpy()) for t in weights]
    assert len(_mapped(weights)) == len(weights)
    assert _peak_rss() - base > weight_bytes // 2
    del copies
    interop.release(weights)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_pass_on_a_package_file_keeps_weights_mapped_one_at_a_time(big_decoder):
    """The pass through a Package whose decoder is a file: the result keeps every weight in that file.

    Opening the graph fingerprints it (the manager's change tracking hashes each weight once); that
    read must hold one weight at a time, and the pass itself reads none.
    """
    path, weight_bytes = big_decoder
    pkg = Package(manifest_module.new("unit", "LlamaForCausalLM", "unit", "none"))
    pkg.manifest["kv"] = {"layers": 4, "kv_heads": 8, "head_dim": 64}
    pkg.set_graph_file("decoder", path, role="decoder")
    base = _reset_peak_rss()
    model = pkg.model("decoder")
    opened = _peak_rss() - base
    weights = _external(model)
    assert _mapped(weights) == [], "opening the graph left weights mapped"
    assert opened < weight_bytes // 4, f"opening the graph grew peak RSS by {opened / 2**20:.1f} MiB"

    plan = paged_kv.PagedKV(block_size=BLOCK).check_package(pkg)
    assert plan == paged_kv.Plan(("decoder",))
    base = _reset_peak_rss()
    result = paged_kv.PagedKV(block_size=BLOCK).run(pkg, plan)
    grew = _peak_rss() - base
    assert result.modified and result.report["graphs"]["decoder"]["layers"] == [0, 1, 2, 3]
    assert _mapped(weights) == [] and grew < weight_bytes // 4
    assert _external(pkg.model("decoder")) == weights  # the same file-backed tensors, in the same order
    assert (
        pkg.manifest["kv"]["layout"] == "paged" and pkg.info("decoder")["inputs"][2]["name"] == "key_cache.0"
    )
    again = paged_kv.PagedKV(block_size=BLOCK)
    assert again.check_package(pkg) == paged_kv.Plan((), "already paged")
    assert again.run(pkg).modified is False
