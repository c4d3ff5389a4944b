"""Memory at scale: graphs open with their weights on disk, saving and checking never copy weights, build frees the source."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from vlmc import build, exporters, graphs, interop, manager, recipe
from vlmc.package import Package


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _big_model(mib: int = 64) -> ir.Model:
    w = numpy_helper.from_array(np.full((mib, 256, 1024), 0.5, np.float32), "w")
    c = helper.make_node(
        "Constant", [], ["c"], value=numpy_helper.from_array(np.arange(512, dtype=np.float32))
    )
    add = helper.make_node("Add", ["x", "w"], ["y"])
    graph = helper.make_graph(
        [c, add],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [mib, 256, 1024]),
            helper.make_tensor_value_info("c", TensorProto.FLOAT, [512]),
        ],
        initializer=[w],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_save_and_check_leave_the_model_and_its_memory_alone(tmp_path):
    model = _big_model(64)
    before = interop.fingerprint(model)
    interop.check(model)  # warm up imports and allocator pools before measuring
    rss = _rss_bytes()
    for i in range(4):
        interop.check(model)
        interop.save(model, tmp_path / f"m{i}.onnx")
    # check writes placeholders, save streams the weight: neither keeps a copy (4 x 64 MiB if they did)
    assert _rss_bytes() - rss < 96 * 2**20
    assert interop.fingerprint(model) == before
    loaded = graphs.load_ir(tmp_path / "m3.onnx")
    assert interop.fingerprint(loaded) == before  # structure and every weight byte
    onnx.checker.check_model(str(tmp_path / "m3.onnx"), full_check=True)
    stored = onnx.load(str(tmp_path / "m3.onnx"), load_external_data=False)
    assert [t.data_location for t in stored.graph.initializer] == [TensorProto.EXTERNAL]


def test_check_path_reports_an_invalid_graph(tmp_path):
    proto = ir.to_proto(_big_model(1))
    proto.graph.node[1].input[1] = "missing"
    onnx.save(proto, str(tmp_path / "bad.onnx"))
    with pytest.raises(Exception, match="bad: ONNX check failed"):
        interop.check_path(tmp_path / "bad.onnx", name="bad")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale") / "pkg"
    exporters.export(exporters.load_source("tiny-llava")).save(out)
    return out


def test_opening_and_fingerprinting_a_package_reads_weights_once(tmp_path):
    """Graphs open as onnx-ir models whose weights stay in the file; a fingerprint hashes each weight once."""
    interop.save(_big_model(64), tmp_path / "m.onnx")
    rss = _rss_bytes()
    model = graphs.load_ir(tmp_path / "m.onnx")
    w = model.graph.initializers["w"].const_value
    assert isinstance(w, ir.ExternalTensor)
    assert _rss_bytes() - rss < 16 * 2**20  # 64 MiB of weights, not read
    first = interop.fingerprint(model)
    assert w.meta[interop._HASH_KEY] == first_hash(w)  # the weight's hash is kept with it
    # a new read of the same file: the same hash
    assert interop.fingerprint(graphs.load_ir(tmp_path / "m.onnx")) == first


def first_hash(t) -> str:
    return interop._digest(int(t.dtype), list(t.shape.numpy()), t.tobytes())


def test_fingerprint_sees_one_changed_value_deep_inside_a_large_weight(tmp_path):
    model = _big_model(8)
    before = interop.fingerprint(model)
    w = model.graph.initializers["w"]
    arr = w.const_value.numpy().copy()
    arr[5, 100, 1000] += 1.0  # one value in the middle of 8 MiB: windowed hashes missed this
    w.const_value = ir.tensor(arr, name="w")
    assert interop.fingerprint(model) != before


def test_unchanged_graphs_are_not_rewritten_and_changed_ones_stream(tiny_dir, tmp_path):
    pkg = Package.load(tiny_dir)
    model = pkg.model("vision_encoder")  # loaded, not changed
    node = next(iter(model.graph))
    assert pkg.state()["vision_encoder"] == f"file:{tiny_dir / 'vision_encoder.onnx'}"
    node.doc_string = "changed"  # an in-place edit of the IR is a change
    assert pkg.path_of("vision_encoder") is None and not pkg.state()["vision_encoder"].startswith("file:")
    out = pkg.save(tmp_path / "saved")
    for g in ("embed_tokens", "decoder"):
        assert (out / f"{g}.onnx.data").read_bytes() == (tiny_dir / f"{g}.onnx.data").read_bytes()
    assert next(iter(Package.load(out).model("vision_encoder").graph)).doc_string == "changed"
    assert (tiny_dir / "vision_encoder.onnx").read_bytes() != (out / "vision_encoder.onnx").read_bytes()


@pytest.mark.parametrize("steps", [["fold_constants", "simplify"], ["simplify"]])
def test_folding_leaves_big_weights_unread_and_folds_everything_else(tiny_dir, steps):
    """With every weight matrix above weight_limit_mb, fold_constants/simplify never read those weights:
    numerics are unchanged (--check), and the only nodes they keep that a full fold removes are
    expressions over weights alone (e.g. CLIP's Gather of its position table)."""
    plain = manager.run(Package.load(tiny_dir), recipe.from_dict({"passes": steps}).steps)
    opaque_steps = [{s: {"weight_limit_mb": 0.004}} for s in steps]  # every weight matrix (>= 4 KiB)
    opaque = manager.run(Package.load(tiny_dir), recipe.from_dict({"passes": opaque_steps}).steps, check=True)
    for h in opaque.manifest["history"]:
        for g, r in h["report"].get("numerics_check", {}).items():
            assert r["max_abs_diff"] <= 1e-5, (h["pass"], g)
    for g in opaque.graph_names:
        mine, full = opaque.model(g).graph, plain.model(g).graph
        folded_away = {v.name for n in mine for v in n.outputs} - {v.name for n in full for v in n.outputs}
        weights = set(mine.initializers)
        for n in mine:
            if any(v.name in folded_away for v in n.outputs):
                assert all(v is None or v.name in weights | folded_away for v in n.inputs), (g, n.op_type)
        assert len(folded_away) <= 2, g


def test_unchanged_pass_reports_unmodified(tiny_dir):
    once = manager.run(Package.load(tiny_dir), recipe.from_dict({"passes": ["simplify"]}).steps)
    twice = manager.run(once, recipe.from_dict({"passes": ["simplify"]}).steps)
    assert twice.manifest["history"][-1]["modified"] is False


def test_streaming_export_matches_torch_export(tmp_path):
    """vlmc streams weights out of torch's exporter and lays Linear weights out as [in, out] while tracing;
    the decoder it writes must compute exactly what torch.onnx.export's own output computes, and the
    source model must come back unchanged."""
    import torch

    from vlmc import ortsession, samples
    from vlmc.exporters import base

    src = exporters.load_source("tiny-llava")
    state = {k: v.clone() for k, v in src.model.state_dict().items()}
    pkg = exporters.export(src)
    after = src.model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert all("forward" not in vars(m) for m in src.model.modules())

    kv = pkg.manifest["kv"]
    wrapper = base.DecoderWrapper(src.model.model.language_model, src.model.lm_head, kv["layers"])
    feeds = samples.load(pkg, "decoder")
    past_names, present_names = base.kv_names(kv["layers"])
    names = ["inputs_embeds", "attention_mask", "position_ids", *past_names]
    args = [torch.from_numpy(feeds[n]) for n in names]
    with torch.no_grad():
        torch.onnx.export(
            wrapper.eval(),
            tuple(args),
            str(tmp_path / "torch.onnx"),
            input_names=names,
            output_names=["logits", *present_names],
            dynamic_axes=base.decoder_axes(kv["layers"]),
            opset_version=graphs.EXPORT_OPSET,
            dynamo=False,
        )
    ours = ortsession.for_graph(pkg, "decoder").run(None, feeds)
    theirs = ortsession.from_path(tmp_path / "torch.onnx").run(None, feeds)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # the same ops, but for the Identity nodes vlmc replaces with small copies of shared constants
    theirs_ops = graphs.op_histogram(graphs.load_ir(tmp_path / "torch.onnx"))
    theirs_ops.pop("Identity", None)
    assert graphs.op_histogram(pkg.model("decoder")) == theirs_ops
    stored = graphs.load_ir(pkg.path_of("decoder"))
    assert all(
        isinstance(v.const_value, ir.ExternalTensor)
        for v in stored.graph.initializers.values()
        if v.const_value.nbytes >= 1024
    )


def test_build_frees_the_source_model_and_leaves_no_scratch(tmp_path, monkeypatch):
    refs = {}
    real_export, real_run = exporters.export, manager.run

    def export(source, **kw):
        refs["model"] = weakref.ref(source.model)
        return real_export(source, **kw)

    def run(pkg, steps, check=False):
        gc.collect()
        refs["alive_during_passes"] = refs["model"]() is not None
        refs["resident"] = [g for g in pkg.graph_names if pkg.is_loaded(g)]
        return real_run(pkg, steps, check=check)

    monkeypatch.setattr(exporters, "export", export)
    monkeypatch.setattr(manager, "run", run)
    r = recipe.from_dict({"model": "tiny-llava", "passes": ["fold_constants"], "target": {"backend": "ort"}})
    result = build.build(r, tmp_path / "out")
    assert refs["alive_during_passes"] is False
    assert refs["resident"] == []  # exported graphs are files until a pass reads them
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no scratch or temp directory left
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["build", "package", "vlmc-build.json"]
    assert result.package.root == tmp_path / "out" / "package"
    saved = Package.load(tmp_path / "out" / "package")  # complete on its own: every graph and its weights
    for g in saved.graph_names:
        assert interop.fingerprint(saved.model(g)) == interop.fingerprint(result.package.model(g))


def test_graph_read_before_a_pass_and_unchanged_is_not_a_change(tiny_llava):
    """A library caller may read graphs first; a pass that then changes nothing reports so."""
    pkg = Package.load(tiny_llava)
    before = pkg.state()
    for name in pkg.graph_names:
        pkg.model(name)
    assert pkg.state() == before
    out = manager.run(pkg, recipe.parse("passes: [{simplify: {graphs: [embed_tokens]}}]").steps)
    assert out.manifest["history"][-1]["modified"] is False


def test_per_pass_peak_memory_is_recorded(tiny_dir):
    out = manager.run(
        Package.load(tiny_dir), recipe.from_dict({"passes": ["fold_constants", "simplify"]}).steps
    )
    peaks = [p["peak_rss_bytes"] for p in out.report["passes"]]
    assert len(peaks) == 2 and all(isinstance(x, int) and x > 10 * 2**20 for x in peaks)


def test_fingerprinting_leaves_no_weight_mapped(tmp_path):
    """Hashing a weight in a file maps it only while it is hashed: a fingerprinted package's
    process does not keep every weight resident (onnx-ir maps the whole data file per tensor)."""
    interop.save(_big_model(64), tmp_path / "m.onnx")
    model = graphs.load_ir(tmp_path / "m.onnx")
    w = model.graph.initializers["w"].const_value
    rss = _rss_bytes()
    digest = interop.fingerprint(model)
    assert w.raw is None  # released again
    assert _rss_bytes() - rss < 16 * 2**20  # not 64 MiB of mapped pages
    assert w.meta[interop._HASH_KEY] == interop._digest(int(w.dtype), list(w.shape.numpy()), w.tobytes())
    w.release()
    # a weight a pass had mapped stays mapped (its numpy views stay valid)
    fresh = graphs.load_ir(tmp_path / "m.onnx")
    view = fresh.graph.initializers["w"].const_value.numpy()
    assert interop.fingerprint(fresh) == digest and float(view[0, 0, 0]) == 0.5
