"""paged_kv pass, the block allocator and paged generation: exact against the contiguous package on every built-in."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import exporters, graphs, interop, manager, ortsession, pass_api, tensor_names
from vlmc.errors import PassFailed, VlmcError
from vlmc.exporters import zoo
from vlmc.package import Package
from vlmc.recipe import Step
from vlmc.runtime import Pipeline, deepstack
from vlmc.runtime import kv as kvmod
from vlmc.runtime.paged import NULL_BLOCK, BlockAllocator, OutOfBlocks, PagedKV, write_rows

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16
exporters.families()  # family modules register their built-ins on import
BUILTINS = sorted(zoo.BUILTINS)
PROMPTS = ["Describe the image.", "Hi", "Tell me everything about this picture, in great detail please."]
IMAGES = [["demo:1"], [], ["demo:2"]]


def _paged(path: Path, **opts) -> tuple[Package, pass_api.PassResult]:
    pkg = Package.load(path)
    result = pass_api.get("paged_kv")(block_size=BLOCK, **opts).run(pkg)
    return pkg, result


class RecordingAllocator(BlockAllocator):
    """A shuffled allocator that remembers each sequence's final block table and length."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.finished: list[tuple[list[int], int]] = []

    def release(self, seq) -> None:
        self.finished.append((self.table(seq), self.length(seq)))
        super().release(seq)


class KeptPools(PagedKV):
    """PagedKV that keeps its pools when released, so a test can look at what was written."""

    kept: list[dict[str, np.ndarray]] = []

    def release(self) -> None:
        KeptPools.kept.append(dict(self.pools))
        super().release()


@pytest.fixture
def use_allocator(monkeypatch):
    """Route paged generation through a given allocator (the runtime's default makes its own)."""
    KeptPools.kept = []

    def install(alloc: BlockAllocator) -> None:
        monkeypatch.setitem(
            kvmod.LAYOUTS,
            "paged",
            lambda kv, batch, dtype, **ex: KeptPools(kv, batch, dtype, allocator=alloc, **ex),
        )

    return install


# ---- end to end: paged generation == contiguous generation, every built-in ------------------------
@pytest.mark.parametrize("builtin", BUILTINS)
def test_paged_generation_is_token_exact(builtin, exported, use_allocator):
    path = exported(builtin)
    contiguous = Pipeline(Package.load(path))
    paged_pkg, _ = _paged(path)
    inputs = contiguous.prepare(PROMPTS, IMAGES)
    lengths = inputs.attention_mask.sum(axis=1)
    assert len(set(lengths.tolist())) == 3  # three different prompt lengths, left padded in one batch
    ref = contiguous.generate_from(inputs, max_new_tokens=6)

    alloc = RecordingAllocator(256, BLOCK, seed=7)
    use_allocator(alloc)
    got = Pipeline(paged_pkg).generate_from(inputs, max_new_tokens=6)

    assert got.tokens == ref.tokens
    for a, b in zip(ref.step_logits, got.step_logits):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    # One shared pool: tables are disjoint, shuffled and non-contiguous, and all blocks come back.
    tables = [t for t, _ in alloc.finished]
    assert len(tables) == 3
    flat = [b for t in tables for b in t]
    assert len(flat) == len(set(flat)) and NULL_BLOCK not in flat
    assert any(np.any(np.diff(t) != 1) for t in tables if len(t) > 1)
    for (table, length), prompt_len in zip(alloc.finished, lengths):
        assert length >= prompt_len + 1 and len(table) == -(-length // BLOCK)
    assert alloc.num_free == 255 and not alloc.sequences
    # The runtime wrote every stored token's row and nothing else: padding positions were skipped,
    # so the null block and every block no sequence owned are still all zeros.
    (pools,) = KeptPools.kept
    owned = sorted(flat)
    for name, pool in pools.items():
        assert not np.any(np.delete(pool, owned, axis=0)), name
        for table, length in alloc.finished:
            rows = pool[table].reshape(-1, *pool.shape[2:])
            assert np.all(np.any(rows[:length] != 0, axis=(1, 2))) and not np.any(rows[length:]), name


def test_default_runtime_grows_a_symbolic_pool(exported):
    # No allocator given: the runtime sizes the pool from the prompts and grows it while decoding.
    path = exported("tiny-llava")
    paged_pkg, _ = _paged(path)
    ref = Pipeline(Package.load(path)).generate(PROMPTS, IMAGES, max_new_tokens=40)
    got = Pipeline(paged_pkg).generate(PROMPTS, IMAGES, max_new_tokens=40)
    assert got.tokens == ref.tokens


def test_fixed_pool_runs_and_reports_out_of_blocks(exported):
    path = exported("tiny-llava")
    pkg, _ = _paged(path, num_blocks=64)
    assert pkg.manifest["kv"]["num_blocks"] == 64
    assert pkg.info("decoder")["inputs"][2]["shape"][0] == 64
    ref = Pipeline(Package.load(path)).generate(PROMPTS[:2], IMAGES[:2], max_new_tokens=4)
    assert Pipeline(pkg).generate(PROMPTS[:2], IMAGES[:2], max_new_tokens=4).tokens == ref.tokens
    small, _ = _paged(path, num_blocks=3)
    with pytest.raises(OutOfBlocks, match="out of blocks"):
        Pipeline(small).generate(PROMPTS[:2], IMAGES[:2], max_new_tokens=4)


def test_merged_package_is_rewritten_too(exported, use_allocator):
    # The merged prefill graph (role vlm) has the same KV interface; both it and the decode path go paged.
    path = exported("tiny-llava")
    merged = manager.run(Package.load(path), [Step("merge", {}, 1)])
    paged = manager.run(
        Package.load(path), [Step("merge", {}, 1), Step("paged_kv", {"block_size": BLOCK}, 2)]
    )
    assert set(paged.manifest["history"][-1]["report"]["graphs"]) == {"vlm", "decoder"}
    assert "block_tables" in [i["name"] for i in paged.info("vlm")["inputs"]]
    images = [["demo:1"], ["demo:3"], ["demo:2"]]
    ref = Pipeline(merged).generate(PROMPTS, images, max_new_tokens=5)
    use_allocator(BlockAllocator(128, BLOCK, seed=11))
    assert Pipeline(paged).generate(PROMPTS, images, max_new_tokens=5).tokens == ref.tokens


# ---- the graph, driven directly through its interface -------------------------------------------
def _positions(spec: dict, rows: np.ndarray) -> np.ndarray:
    return np.broadcast_to(rows, [3, *rows.shape] if len(spec["shape"]) == 3 else rows.shape).astype(np.int64)


@pytest.mark.parametrize("builtin", BUILTINS)
def test_graph_interface_matches_contiguous_decoder(builtin, exported):
    """Prefill (left padded) then one decode step through key_cache/block_tables/slot_mapping/context_lens."""
    path = exported(builtin)
    cont = Package.load(path)
    pkg, _ = _paged(path)
    kv = pkg.manifest["kv"]
    decoder = pkg.manifest["pipeline"]["decoder"][0]
    specs = {i["name"]: i for i in pkg.info(decoder)["inputs"]}
    s_cont, s_paged = ortsession.for_graph(cont, decoder), ortsession.for_graph(pkg, decoder)
    # extra decoder inputs (text.decoder_inputs, e.g. token_type_ids): text tokens everywhere
    extra = {n: np.zeros((2, 20), np.int64) for n in cont.manifest["text"].get("decoder_inputs") or {}}
    extra1 = {n: v[:, :1] for n, v in extra.items()}
    # deepstack inputs (text.deepstack): no image position, as the runtime feeds text-only steps
    width = specs["inputs_embeds"]["shape"][2]
    extra.update(deepstack.feeds(cont.manifest, np.zeros((2, 20), np.int64), {}, width, prefill=True))
    extra1.update(deepstack.feeds(cont.manifest, np.zeros((2, 1), np.int64), {}, width, prefill=False))
    rng = np.random.default_rng(0)
    layers, heads, dim = kv["layers"], kv["kv_heads"], kv["head_dim"]
    hidden = specs["inputs_embeds"]["shape"][2]
    batch, seq, real = 2, 20, [20, 13]  # row 1 has 7 padding positions (left padding)
    nb = 12
    tables = np.array([[5, 2], [9, 7]], np.int32)  # non-contiguous, out of order
    mask = np.zeros((batch, seq), np.int64)
    slots = np.zeros((batch, seq), np.int32)
    pos = np.ones((batch, seq), np.int64)
    for b in range(batch):
        mask[b, seq - real[b] :] = 1
        p = np.arange(real[b])
        slots[b, seq - real[b] :] = tables[b][p // BLOCK] * BLOCK + p % BLOCK
        pos[b, seq - real[b] :] = p
    slots[1, : seq - real[1]] = -1  # padding: masked, and never stored
    pools = {
        f"{k}_cache.{i}": (100 * rng.standard_normal((nb, BLOCK, heads, dim))).astype(np.float32)
        for i in range(layers)
        for k in ("key", "value")
    }
    embeds = rng.standard_normal((batch, seq, hidden)).astype(np.float32)
    empty = {
        f"past_key_values.{i}.{k}": np.zeros((batch, heads, 0, dim), np.float32)
        for i in range(layers)
        for k in ("key", "value")
    }
    ref = dict(
        zip(
            [o.name for o in s_cont.get_outputs()],
            s_cont.run(
                None,
                {
                    "inputs_embeds": embeds,
                    "attention_mask": mask,
                    "position_ids": _positions(specs["position_ids"], pos),
                    **extra,
                    **empty,
                },
            ),
        )
    )
    feeds = {
        "inputs_embeds": embeds,
        "position_ids": _positions(specs["position_ids"], pos),
        **extra,
        **pools,
        "block_tables": tables,
        "slot_mapping": slots,
        "context_lens": np.array(real, np.int32),
    }
    before = {n: p.copy() for n, p in pools.items()}
    got = dict(zip([o.name for o in s_paged.get_outputs()], s_paged.run(None, feeds)))
    rows = [f"new_{k}.{i}" for i in range(layers) for k in ("key", "value")]
    assert sorted(got) == sorted(["logits", *rows])
    for b in range(batch):  # logits of real positions only (padding rows are garbage in both)
        np.testing.assert_allclose(
            got["logits"][b, seq - real[b] :], ref["logits"][b, seq - real[b] :], rtol=1e-4, atol=1e-4
        )
    for i in range(layers):
        for k in ("key", "value"):
            new = got[f"new_{k}.{i}"]
            assert new.shape == (batch, seq, heads, dim)
            present = ref[f"present.{i}.{k}"]  # [B, H, seq, D]: this step's rows as stored (keys rotated)
            for b in range(batch):
                np.testing.assert_allclose(
                    new[b, seq - real[b] :],
                    present[b, :, seq - real[b] :].transpose(1, 0, 2),
                    rtol=1e-5,
                    atol=1e-5,
                )
            # The graph only reads the pool.
            np.testing.assert_array_equal(pools[f"{k}_cache.{i}"], before[f"{k}_cache.{i}"])
            write_rows(pools[f"{k}_cache.{i}"], new, slots)
    # What the runtime wrote: each real token's row at its slot; padding skipped; everything else untouched.
    live = slots[slots >= 0]
    for name, pool in pools.items():
        flat, old = pool.reshape(-1, heads, dim), before[name].reshape(-1, heads, dim)
        rest = np.setdiff1d(np.arange(nb * BLOCK), live)
        np.testing.assert_array_equal(flat[rest], old[rest])
        assert not np.array_equal(flat[live], old[live])

    # Decode: one token per row, attending to the pool just written (holes past each context length).
    step = rng.standard_normal((batch, 1, hidden)).astype(np.float32)
    nxt = np.array([[real[0]], [real[1]]], np.int64)
    new_slots = np.array(
        [[tables[b][real[b] // BLOCK] * BLOCK + real[b] % BLOCK] for b in range(batch)], np.int32
    )
    past = {
        f"past_key_values.{i}.{k}": ref[f"present.{i}.{k}"] for i in range(layers) for k in ("key", "value")
    }
    ref2 = dict(
        zip(
            [o.name for o in s_cont.get_outputs()],
            s_cont.run(
                None,
                {
                    "inputs_embeds": step,
                    "attention_mask": np.concatenate([mask, np.ones((batch, 1), np.int64)], 1),
                    "position_ids": _positions(specs["position_ids"], nxt),
                    **extra1,
                    **past,
                },
            ),
        )
    )
    decode = {
        "inputs_embeds": step,
        "position_ids": _positions(specs["position_ids"], nxt),
        **extra1,
        **pools,
        "block_tables": tables,
        "slot_mapping": new_slots,
        "context_lens": np.array(real, np.int32) + 1,
    }
    got2 = dict(zip([o.name for o in s_paged.get_outputs()], s_paged.run(None, decode)))
    np.testing.assert_allclose(got2["logits"], ref2["logits"], rtol=1e-4, atol=1e-4)
    for i in range(layers):
        for k in ("key", "value"):
            want = ref2[f"present.{i}.{k}"][:, :, -1:].transpose(0, 2, 1, 3)
            np.testing.assert_allclose(got2[f"new_{k}.{i}"], want, rtol=1e-5, atol=1e-5)

    # A decode step where row 1 is padding (slot -1, its context unchanged): row 0 is unaffected, and
    # the padding row's rows are never stored.
    pad = dict(decode, slot_mapping=np.array([[new_slots[0, 0]], [-1]], np.int32))
    pad["context_lens"] = np.array([real[0] + 1, real[1]], np.int32)
    got3 = dict(zip([o.name for o in s_paged.get_outputs()], s_paged.run(None, pad)))
    np.testing.assert_allclose(got3["logits"][0], ref2["logits"][0], rtol=1e-4, atol=1e-4)
    snapshot = {n: p.copy() for n, p in pools.items()}
    for i in range(layers):
        for k in ("key", "value"):
            write_rows(pools[f"{k}_cache.{i}"], got3[f"new_{k}.{i}"], pad["slot_mapping"])
            changed = np.flatnonzero(
                np.any(pools[f"{k}_cache.{i}"] != snapshot[f"{k}_cache.{i}"], axis=(2, 3)).reshape(-1)
            )
            assert changed.tolist() == [int(new_slots[0, 0])]


def test_rewritten_graph_is_valid_and_uses_only_atc_ops(exported):
    path = exported("tiny-llava")
    before = Package.load(path).model("decoder")
    old_ops = {n.op_type for n in before.graph}
    pkg, result = _paged(path)
    assert result.modified and result.report["graphs"]["decoder"]["layers"] == [0, 1]
    model = pkg.model("decoder")
    interop.check(model, "decoder")  # onnx.checker (full) and strict shape inference
    added = [n.op_type for n in model.graph if n.name.startswith("paged_kv/")]
    layers = pkg.manifest["kv"]["layers"]
    # Exactly: per K/V pool a Reshape+Gather read and a Slice+Transpose for this step's rows.
    assert added.count("Gather") == 2 * layers + 1 and added.count("Slice") == 2 * layers
    assert added.count("Transpose") == 2 * layers
    assert set(added) == {
        "Shape",
        "Gather",
        "Mul",
        "Add",
        "Squeeze",
        "Cast",
        "GreaterOrEqual",
        "ReduceSum",
        "Unsqueeze",
        "Sub",
        "Range",
        "Less",
        "Concat",
        "Reshape",
        "Transpose",
        "Slice",
    }
    # The graph never writes the pool: a pool's only consumer is a Reshape to rows (a view), whose only
    # consumer is the row Gather; no graph output is pool-sized.
    pools = [v for v in model.graph.inputs if tensor_names.is_cache(v.name)]
    assert len(pools) == 2 * layers
    for pool in pools:
        ((reader, _),) = pool.uses()
        assert reader.op_type == "Reshape"
        ((use, index),) = reader.outputs[0].uses()
        assert use.op_type == "Gather" and index == 0
    assert "ScatterND" not in {n.op_type for n in model.graph}
    # the decoder's nodes are all kept but its copies of a past (test_single_input_concats_...)
    removed = result.report["graphs"]["decoder"]["copies_removed"]
    assert len(model.graph) == len(before.graph) + len(added) - removed
    with open(REPO / "vlmc/backends/ascend/data/onnx_ops.tsv") as f:
        atc = {row[0] for row in csv.reader((ln for ln in f if not ln.startswith("#")), delimiter="\t")}
    # Constant nodes are converted by the ATC parser itself at any opset (onnx_ops.tsv header).
    assert (old_ops | set(added)) - {"Constant"} <= atc
    sig = pkg.info("decoder")
    names = [i["name"] for i in sig["inputs"]]
    assert names == ["inputs_embeds", "position_ids"] + [
        f"{k}_cache.{i}" for i in range(layers) for k in ("key", "value")
    ] + ["block_tables", "slot_mapping", "context_lens"]
    by = {i["name"]: i for i in sig["inputs"]}
    kv = pkg.manifest["kv"]
    assert by["key_cache.0"]["shape"] == ["num_blocks", BLOCK, kv["kv_heads"], kv["head_dim"]]
    assert by["block_tables"] == {"name": "block_tables", "dtype": "int32", "shape": ["batch", "max_blocks"]}
    assert by["slot_mapping"]["dtype"] == by["context_lens"]["dtype"] == "int32"
    assert [o["name"] for o in sig["outputs"]] == ["logits"] + [
        f"new_{k}.{i}" for i in range(layers) for k in ("key", "value")
    ]
    outs = {o["name"]: o for o in sig["outputs"]}
    assert outs["new_key.0"]["shape"] == ["batch", "sequence", kv["kv_heads"], kv["head_dim"]]
    assert {k: kv[k] for k in ("layout", "block_size", "num_blocks")} == {
        "layout": "paged",
        "block_size": BLOCK,
        "num_blocks": "num_blocks",
    }


def test_single_input_concats_of_the_past_are_removed(exported):
    """The export's copy of a past (a one-input Concat) goes; its users read the gathered past."""
    path = exported("tiny-llava")
    before = Package.load(path).model("decoder")
    copies = [
        n
        for n in before.graph
        if n.op_type == "Concat" and len(n.inputs) == 1 and tensor_names.PAST_RE.match(n.inputs[0].name)
    ]
    assert copies, "the tiny LLaVA export no longer copies its past: this test checks nothing"
    pkg, result = _paged(path)
    model = pkg.model("decoder")
    assert result.report["graphs"]["decoder"]["copies_removed"] == len(copies)
    names = {n.name for n in model.graph}
    assert not names & {n.name for n in copies}
    gathered = [
        n.outputs[0]
        for n in model.graph
        if n.name.startswith("paged_kv/Gather") and n.inputs[1].name == "paged_kv/row_idx"
    ]
    assert len(gathered) == 2 * pkg.manifest["kv"]["layers"]
    for value in gathered:  # every past goes straight to the decoder's nodes, none of them a copy
        assert all(not (u.op_type == "Concat" and len(u.inputs) == 1) for u, _ in value.uses())


def test_manager_runs_the_pass_and_saves_a_loadable_package(exported, tmp_path):
    pkg = manager.run(Package.load(exported("tiny-llava")), [Step("paged_kv", {"block_size": 32}, 1)])
    assert pkg.manifest["history"][-1]["modified"] is True
    out = pkg.save(tmp_path / "paged")
    again = Package.load(out)
    assert again.manifest["kv"]["block_size"] == 32
    res = Pipeline(again).generate(PROMPTS[:1], IMAGES[:1], max_new_tokens=3)
    assert len(res.tokens[0]) >= 1
    # Stored samples are consistent paged inputs (real slots distinct, one padding position), so checks
    # can run the graph.
    from vlmc import samples

    feeds = samples.inputs_for(again, "decoder")
    real = feeds["slot_mapping"][feeds["slot_mapping"] >= 0].tolist()
    assert len(set(real)) == len(real) and (feeds["slot_mapping"] < 0).sum() == 1
    ortsession.for_graph(again, "decoder").run(None, feeds)


# ---- negative cases and options ------------------------------------------------------------------
def test_already_paged_and_no_decoder_are_unchanged(exported):
    pkg, _ = _paged(exported("tiny-llava"))
    again = pass_api.get("paged_kv")(block_size=BLOCK).run(pkg)
    assert again.modified is False
    only_embed = Package.load(exported("tiny-llava"))
    for name in list(only_embed.graph_names):
        if only_embed.info(name)["role"] == "decoder":
            only_embed.remove_graph(name)
    only_embed.manifest["pipeline"]["decoder"] = []
    manifest_before = copy.deepcopy(only_embed.manifest)
    out = manager.run(only_embed, [Step("paged_kv", {}, 1)])
    assert out.manifest["history"][-1]["modified"] is False
    assert {k: v for k, v in out.manifest.items() if k != "history"} == {
        k: v for k, v in manifest_before.items() if k != "history"
    }


@pytest.mark.parametrize(
    "value, message",
    [
        (100, "block_size=100 must be a multiple of 16"),
        (528, "block_size=528 is above the maximum 512"),
        (0, "block_size=0 is below the minimum 16"),
        ("128", "block_size must be an integer, got string '128'"),
    ],
)
def test_block_size_validation(value, message):
    with pytest.raises(VlmcError, match=message):
        pass_api.get("paged_kv")(block_size=value)


def test_unknown_option_and_bad_num_blocks():
    with pytest.raises(VlmcError, match="valid options: block_size, num_blocks"):
        pass_api.get("paged_kv")(blocks=4)
    with pytest.raises(VlmcError, match="num_blocks=0 is below the minimum"):
        pass_api.get("paged_kv")(num_blocks=0)


def test_graph_without_attention_mask_is_refused(exported):
    pkg = Package.load(exported("tiny-llava"))
    model = pkg.model("decoder")
    # Make attention_mask an internal tensor: the graph no longer has the decoder interface.
    inputs = {v.name: v for v in model.graph.inputs}
    model.graph.inputs.remove(inputs["attention_mask"])
    identity = ir.node("Identity", [inputs["inputs_embeds"]], outputs=[inputs["attention_mask"]])
    model.graph.insert_before(model.graph.node(0), identity)
    pkg.set_graph("decoder", model)
    with pytest.raises(PassFailed, match="no attention_mask input"):
        manager.run(pkg, [Step("paged_kv", {}, 1)])


# ---- cost follows the context, not the pool -------------------------------------------------------
def _peak_rss_since_reset() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_onnxruntime_reads_the_pools_where_they_are(exported):
    """A decode step over large pools adds far less than one pool to peak memory: nothing copies them.

    The pools are fresh np.zeros (pages not yet resident), so any copy, by onnxruntime's input
    conversion or inside the graph, would make a pool's worth of pages resident.
    """
    pkg, _ = _paged(exported("tiny-llava"))
    kv = pkg.manifest["kv"]
    layers, heads, dim = kv["layers"], kv["kv_heads"], kv["head_dim"]
    pool_bytes = 128 * 2**20
    nb = pool_bytes // (BLOCK * heads * dim * 4)
    sess = ortsession.for_graph(pkg, "decoder")
    hidden = {i.name: i for i in sess.get_inputs()}["inputs_embeds"].shape[2]
    alloc = BlockAllocator(nb, BLOCK, seed=0)
    slots = alloc.allocate("s", 40)
    feeds = {
        "inputs_embeds": np.ones((1, 1, hidden), np.float32),
        "position_ids": np.array([[39]], np.int64),
        "block_tables": alloc.block_tables(["s"]),
        "slot_mapping": slots[-1:].reshape(1, 1).astype(np.int32),
        "context_lens": np.array([40], np.int32),
    }
    for i in range(layers):
        for k in ("key", "value"):
            feeds[f"{k}_cache.{i}"] = np.zeros((nb, BLOCK, heads, dim), np.float32)
    sess.run(None, feeds)  # warm-up: onnxruntime's own buffers
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    base = _peak_rss_since_reset()
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    grew = _peak_rss_since_reset() - base
    assert outs["new_key.0"].shape == (1, 1, heads, dim)
    assert grew < pool_bytes // 4, (
        f"peak RSS grew by {grew / 2**20:.0f} MiB for {2 * layers} pools of 128 MiB"
    )


# ---- Ascend: read-only pools, the host-side write in compile.json ------------------------------------
def test_ascend_builds_take_read_only_pools_and_say_how_rows_are_written(exported, tmp_path):
    from vlmc.backends import ascend

    pkg, _ = _paged(exported("tiny-llava"))
    summary = ascend.compile(
        pkg, tmp_path / "build", {"soc": "Ascend910B", "soc_variant": "Ascend910B2", "sequence_buckets": [64]}
    )
    kv = pkg.manifest["kv"]
    info = summary["paged_kv"]
    assert set(info["builds"]) == {"decoder_prefill", "decoder_decode"}
    for dims in info["builds"].values():
        assert dims[1:] == [BLOCK, kv["kv_heads"], kv["head_dim"]] and dims[0] > 1
    assert "ReshapeAndCache" in info["write"]["op"] and "slot_mapping" in info["write"]["slotMapping"]
    assert all(u.startswith("https://www.hiascend.com/") for u in info["sources"])
    on_disk = json.loads((tmp_path / "build" / "compile.json").read_text())
    assert on_disk["paged_kv"] == info
    # The decoder file both builds read returns rows, never a pool, and writes nothing.
    model = graphs.load_ir(tmp_path / "build" / "graphs" / "decoder.onnx")
    outs = [o.name for o in model.graph.outputs]
    assert outs[0] == "logits" and all(o.startswith(("new_key", "new_value")) for o in outs[1:])
    assert "ScatterND" not in {n.op_type for n in model.graph}
    contiguous = ascend.compile(
        Package.load(exported("tiny-llava")),
        tmp_path / "c",
        {"soc": "Ascend910B", "soc_variant": "Ascend910B2", "sequence_buckets": [64]},
    )
    assert contiguous["paged_kv"] is None


def test_fp16_io_decoder_gets_fp16_pools(exported, use_allocator):
    # quantize fp16 with keep_io_fp32: false makes the cache inputs float16; pools of that dtype are fed
    # as they are (a float32 pool would be cast, i.e. copied whole, every step).
    path = exported("tiny-llava")
    quant = pass_api.get("quantize")(
        decoder={"weights": "fp16", "keep_io_fp32": False}, eval_tokens=0, eval_samples=0
    )
    fp16 = Package.load(path)
    quant.run(fp16)
    paged = Package.load(path)
    quant.run(paged)
    pass_api.get("paged_kv")(block_size=BLOCK).run(paged)
    assert {i["name"]: i["dtype"] for i in paged.info("decoder")["inputs"]}["key_cache.0"] == "float16"
    ref = Pipeline(fp16).generate(PROMPTS, IMAGES, max_new_tokens=5)
    use_allocator(BlockAllocator(128, BLOCK, seed=5))
    got = Pipeline(paged).generate(PROMPTS, IMAGES, max_new_tokens=5)
    assert got.tokens == ref.tokens
    assert {p.dtype for p in KeptPools.kept[0].values()} == {np.dtype(np.float16)}


def test_split_decoder_ranges_each_return_their_rows(exported, use_allocator):
    # split first, then paged_kv: every layer range reads its own pools and returns its own rows.
    path = exported("tiny-llava")
    pkg = manager.run(
        Package.load(path),
        [Step("split", {"decoder_ranges": 2}, 1), Step("paged_kv", {"block_size": BLOCK}, 2)],
    )
    ranges = pkg.manifest["pipeline"]["decoder"]
    assert len(ranges) == 2
    outs = [[o["name"] for o in pkg.info(r)["outputs"]] for r in ranges]
    assert [o for o in outs[0] if o.startswith("new_")] == ["new_key.0", "new_value.0"]
    assert [o for o in outs[1] if o.startswith("new_")] == ["new_key.1", "new_value.1"]
    ref = Pipeline(Package.load(path)).generate(PROMPTS, IMAGES, max_new_tokens=5)
    use_allocator(BlockAllocator(128, BLOCK, seed=3))
    assert Pipeline(pkg).generate(PROMPTS, IMAGES, max_new_tokens=5).tokens == ref.tokens
