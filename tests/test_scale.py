"""Memory at scale: staged packages keep graphs on disk, saving and checking never copy weights, build frees the source."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from vlmc import build as B
from vlmc import exporters, manager
from vlmc import graphs as G
from vlmc import recipe as R
from vlmc.package import Package


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _big_model(mib: int = 64) -> onnx.ModelProto:
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
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_save_and_check_leave_the_model_and_its_memory_alone(tmp_path):
    model = _big_model(64)
    before = model.SerializeToString(deterministic=True)
    G.check(model)  # warm up imports and allocator pools before measuring
    rss = _rss_bytes()
    for i in range(4):
        G.check(model)
        G.save(model, tmp_path / f"m{i}.onnx")
    # Taking the bytes out and putting them back grew the protobuf arena by 64 MiB per call (512 MiB here).
    assert _rss_bytes() - rss < 96 * 2**20
    assert model.SerializeToString(deterministic=True) == before
    loaded = G.load(tmp_path / "m3.onnx")
    assert loaded.SerializeToString(deterministic=True) == before
    assert G.fingerprint(loaded) == G.fingerprint(model)
    onnx.checker.check_model(str(tmp_path / "m3.onnx"), full_check=True)
    stored = onnx.load(str(tmp_path / "m3.onnx"), load_external_data=False)
    assert [t.data_location for t in stored.graph.initializer] == [TensorProto.EXTERNAL]
    const = stored.graph.node[0].attribute[0].t  # large Constant tensors go to the data file too
    assert const.data_location == TensorProto.EXTERNAL


def test_weightless_copy_has_no_weight_bytes():
    model = _big_model(8)
    copy, moved = G.weightless_copy(model)
    assert copy.ByteSize() < 8 * 1024
    assert [t.name for t, _ in moved] == ["w", ""]
    assert copy.graph.node[1] == model.graph.node[1]
    assert len(model.graph.initializer[0].raw_data) == 8 * 256 * 1024 * 4


def test_check_path_reports_an_invalid_graph(tmp_path):
    model = _big_model(1)
    model.graph.node[1].input[1] = "missing"
    G.save(model, tmp_path / "bad.onnx")
    with pytest.raises(Exception, match="bad: ONNX check failed"):
        G.check_path(tmp_path / "bad.onnx", name="bad")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("scale") / "pkg"
    exporters.export(exporters.load_source("tiny-llava")).save(out)
    return out


def test_release_stages_changed_graphs_and_drops_unchanged_ones(tiny_dir, tmp_path):
    pkg = Package.load(tiny_dir)
    pkg.release()  # no staging: a no-op
    pkg.graph("embed_tokens")
    pkg.release("embed_tokens")
    assert pkg.is_loaded("embed_tokens")

    pkg.stage(tmp_path / "staging")
    pkg.release("embed_tokens")  # unchanged: dropped, nothing written
    assert not pkg.is_loaded("embed_tokens") and not pkg.is_staged("embed_tokens")
    assert list((tmp_path / "staging").iterdir()) == []

    model = pkg.graph("vision_encoder")
    model.graph.node[0].doc_string = "changed"
    fp = G.fingerprint(model)
    pkg.release("vision_encoder")
    assert not pkg.is_loaded("vision_encoder") and pkg.is_staged("vision_encoder")
    assert pkg.state()["vision_encoder"] == fp and pkg.state()["decoder"] == "disk"
    assert pkg.path_of("vision_encoder").parent.parent == tmp_path / "staging"
    again = pkg.graph("vision_encoder")
    assert again.graph.node[0].doc_string == "changed" and G.fingerprint(again) == fp

    out = pkg.save(tmp_path / "saved")
    assert Package.load(out).graph("vision_encoder").graph.node[0].doc_string == "changed"
    assert (tiny_dir / "vision_encoder.onnx").read_bytes() != (out / "vision_encoder.onnx").read_bytes()


@pytest.mark.parametrize("steps", [["fold_constants", "simplify"], ["simplify"]])
def test_passes_over_a_staged_package_leave_no_graph_resident(tiny_dir, tmp_path, steps):
    plain = manager.run(Package.load(tiny_dir), R.from_dict({"passes": steps}).steps)
    staged_pkg = Package.load(tiny_dir)
    staged_pkg.stage(tmp_path / "staging")
    staged = manager.run(staged_pkg, R.from_dict({"passes": steps}).steps)
    assert not any(staged.is_loaded(g) for g in staged.graph_names)
    # the same passes, the same modified flags and the same graphs as without staging
    assert [h["modified"] for h in staged.manifest["history"]] == [
        h["modified"] for h in plain.manifest["history"]
    ]
    for g in staged.graph_names:
        assert G.fingerprint(staged.graph(g)) == G.fingerprint(plain.graph(g))
    # superseded staging files are purged: one file per staged graph
    onnx_files = sorted(p.stem for p in (tmp_path / "staging").glob("*/*.onnx"))
    assert onnx_files == sorted(g for g in staged.graph_names if staged.is_staged(g))


def test_unchanged_pass_on_staged_package_reports_unmodified(tiny_dir, tmp_path):
    pkg = Package.load(tiny_dir)
    pkg.stage(tmp_path / "staging")
    once = manager.run(pkg, R.from_dict({"passes": ["simplify"]}).steps)
    twice = manager.run(once, R.from_dict({"passes": ["simplify"]}).steps)
    assert twice.manifest["history"][-1]["modified"] is False


def test_build_frees_the_source_model_and_removes_staging(tmp_path, monkeypatch):
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
    recipe = R.from_dict({"model": "tiny-llava", "passes": ["fold_constants"], "target": {"backend": "ort"}})
    result = B.build(recipe, tmp_path / "out")
    assert refs["alive_during_passes"] is False
    assert refs["resident"] == []
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or temp directory left
    assert result.package.root == tmp_path / "out" / "package"
    assert not any(result.package.is_staged(g) for g in result.package.graph_names)
    saved = Package.load(tmp_path / "out" / "package")  # complete on its own: every graph and its weights
    for g in saved.graph_names:
        assert G.fingerprint(saved.graph(g)) == G.fingerprint(result.package.graph(g))


def test_graph_loaded_before_a_pass_and_released_unchanged_is_not_a_change(tiny_llava, tmp_path):
    """A library caller may load graphs, then stage the package; a pass that only releases them changed nothing."""
    from vlmc import manager, recipe
    from vlmc.package import Package

    pkg = Package.load(tiny_llava)
    for name in pkg.graph_names:
        pkg.graph(name)
    pkg.stage(tmp_path / "staging")
    before = pkg.state()
    pkg.release()
    assert pkg.state() == before
    out = manager.run(pkg, recipe.parse("passes: [{simplify: {graphs: [embed_tokens]}}]").steps)
    assert out.manifest["history"][-1]["modified"] is False
