"""Pass manager contract: exact `modified`, failures named by position, checks, history, --check numerics."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import manager
from vlmc.errors import CheckFailed, PassFailed
from vlmc.package import Package
from vlmc.pass_api import Option, Pass, PassResult
from vlmc.recipe import Step


class _Step(Step):
    """A recipe step bound to a pass class that is not in the global registry."""

    def __init__(self, cls, index, **opts):
        super().__init__(name=cls.name, options=cls.validate_options(opts, cls.name), index=index)
        self.cls = cls

    def instantiate(self):
        return self.cls(**self.options)


class Noop(Pass):
    name = "noop"
    summary = "does nothing"

    def run(self, package, plan=None):
        package.model("decoder")  # loading a graph is not a change
        return PassResult(package, False, {"looked": True})


class Liar(Pass):
    name = "liar"
    summary = "changes a graph but says it did not"

    def run(self, package, plan=None):
        model = package.model("embed_tokens")
        next(iter(model.graph)).name = "renamed"
        return PassResult(package, False)


class Boaster(Pass):
    name = "boaster"
    summary = "says it changed something but did not"

    def run(self, package, plan=None):
        return PassResult(package, True)


class Crash(Pass):
    name = "crash"
    summary = "raises"

    def run(self, package, plan=None):
        raise RuntimeError("boom")


class Breaker(Pass):
    name = "breaker"
    summary = "writes an invalid graph"

    def run(self, package, plan=None):
        model = package.model("embed_tokens")
        # a node reading a value that nothing produces and the graph does not take in
        model.graph.append(ir.node("Relu", [ir.Value(name="does_not_exist")], name="dangling"))
        package.set_graph("embed_tokens", model)
        return PassResult(package, True)


class ScaleEmbeddings(Pass):
    """Claims to preserve numerics but scales the embedding table: --check must catch it."""

    name = "scale"
    summary = "multiply embeddings"
    preserves_numerics = True
    options = (Option("factor", float, 1.0, "scale factor"),)

    def run(self, package, plan=None):
        # a lossy pass is judged against the snapshot, which shares the original model: edit a clone
        model = package.model("embed_tokens").clone()
        weight = next(iter(model.graph.initializers.values()))
        arr = weight.const_value.numpy() * self.opts["factor"]
        weight.const_value = ir.tensor(arr.astype(np.float32), name=weight.name)
        package.set_graph("embed_tokens", model)
        return PassResult(package)  # modified left to the manager


def test_noop_pass_records_history_with_modified_false(tiny_llava):
    pkg = manager.run(Package.load(tiny_llava), [_Step(Noop, 1)])
    h = pkg.manifest["history"][-1]
    assert h == {"pass": "noop", "index": 1, "options": {}, "modified": False, "report": {"looked": True}}
    assert pkg.report["passes"][-1]["seconds"] >= 0


@pytest.mark.parametrize(
    "cls, text",
    [
        (Liar, "reported modified=False but it changed embed_tokens"),
        (Boaster, "reported modified=True but it changed nothing"),
    ],
)
def test_misreported_modified_is_rejected(tiny_llava, cls, text):
    with pytest.raises(PassFailed) as err:
        manager.run(Package.load(tiny_llava), [_Step(Noop, 1), _Step(cls, 2)])
    msg = str(err.value)
    assert f"pass #2 '{cls.name}'" in msg and text in msg and "ran before it: noop" in msg


def test_failing_pass_names_itself_position_and_predecessors(tiny_llava):
    with pytest.raises(PassFailed) as err:
        manager.run(Package.load(tiny_llava), [_Step(Noop, 1), _Step(Noop, 2), _Step(Crash, 3)])
    assert str(err.value) == "pass #3 'crash' failed with RuntimeError: boom (ran before it: noop, noop)"


def test_invalid_graph_is_caught_by_the_checker(tiny_llava):
    with pytest.raises(PassFailed, match=r"pass #1 'breaker' produced an invalid graph"):
        manager.run(Package.load(tiny_llava), [_Step(Breaker, 1)])


def test_check_catches_a_numerics_changing_pass(tiny_llava):
    with pytest.raises(
        CheckFailed, match=r"pass #1 'scale' changed the numerics of embed_tokens:inputs_embeds"
    ):
        manager.run(Package.load(tiny_llava), [_Step(ScaleEmbeddings, 1, factor=2.0)], check=True)


def test_check_passes_real_simplify_and_fold(tiny_llava):
    from vlmc import recipe

    r = recipe.parse("passes: [fold_constants, simplify]")
    pkg = manager.run(Package.load(tiny_llava), r.steps, check=True)
    for h in pkg.manifest["history"]:
        assert h["modified"] is True
        for graph, res in h["report"]["numerics_check"].items():
            assert res["max_abs_diff"] <= 1e-4, graph


def test_simplify_twice_reaches_a_fixed_point(tiny_llava, tmp_path):
    """`modified` is exact, so re-running a pass on its own output reports no change."""
    from vlmc import recipe

    once = manager.run(Package.load(tiny_llava), recipe.parse("passes: [simplify]").steps)
    once.save(tmp_path / "once")
    twice = manager.run(Package.load(tmp_path / "once"), recipe.parse("passes: [simplify]").steps)
    assert twice.manifest["history"][-1]["modified"] is False
    assert twice.report["passes"][-1]["changed"] == []


def test_pass_raising_mid_build_leaves_no_output(tiny_llava, tmp_path):
    from vlmc import build, recipe

    r = recipe.parse("model: tiny-llava\npasses: [simplify]")
    r.steps.append(_Step(Crash, 2))
    out = tmp_path / "out"
    with pytest.raises(PassFailed):
        build.build(r, out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


class Planner(Pass):
    """Computes a plan in check_package; run gets it (no state kept on the pass)."""

    name = "planner"
    summary = "plan then act"

    def check_package(self, package):
        return {"scale": 2.0}

    def run(self, package, plan=None):
        assert plan == {"scale": 2.0}
        return ScaleEmbeddings(factor=plan["scale"]).run(package)


class Lossy(Pass):
    """A lossy pass: the manager calls evaluate(before, after) and refuses merged packages."""

    name = "lossy"
    summary = "scale and report"
    lossy = True
    changes_input = False  # ScaleEmbeddings edits a clone
    requires = ("unmerged",)

    def run(self, package, plan=None):
        return ScaleEmbeddings(factor=3.0).run(package)

    def evaluate(self, before, after, result):
        old = next(iter(before.model("embed_tokens").graph.initializers.values())).const_value.numpy()
        new = next(iter(after.model("embed_tokens").graph.initializers.values())).const_value.numpy()
        return {"ratio": float(np.abs(new).sum() / np.abs(old).sum())}


class ManifestBreaker(Pass):
    name = "manifest_breaker"
    summary = "drops a required manifest fact"

    def run(self, package, plan=None):
        del package.manifest["kv"]["layers"]
        return PassResult(package)


@pytest.mark.parametrize(("factor", "modified"), [(1.0, False), (2.0, True)])
def test_manager_works_out_modified_when_the_pass_leaves_it_open(tiny_llava, factor, modified):
    pkg = manager.run(Package.load(tiny_llava), [_Step(ScaleEmbeddings, 1, factor=factor)])
    assert pkg.manifest["history"][-1]["modified"] is modified
    assert pkg.report["passes"][-1]["changed"] == (["embed_tokens"] if modified else [])


def test_check_package_plan_is_handed_to_run(tiny_llava):
    pkg = manager.run(Package.load(tiny_llava), [_Step(Planner, 1)])
    assert pkg.manifest["history"][-1]["modified"] is True


def test_lossy_pass_is_evaluated_against_the_package_before_it(tiny_llava):
    pkg = manager.run(Package.load(tiny_llava), [_Step(Lossy, 1)])
    assert pkg.manifest["history"][-1]["report"]["fidelity"]["ratio"] == pytest.approx(3.0, rel=1e-5)


def test_declared_precondition_is_checked_before_the_pass(tiny_llava):
    pkg = Package.load(tiny_llava)
    pkg.manifest["pipeline"]["vlm"] = "decoder"  # what merge records
    with pytest.raises(PassFailed, match=r"pass #1 'lossy' failed: lossy cannot run on a merged package"):
        manager.run(pkg, [_Step(Lossy, 1)])


def test_a_pass_that_breaks_the_manifest_is_blamed(tiny_llava):
    with pytest.raises(
        PassFailed, match=r"pass #2 'manifest_breaker' broke the manifest: .*kv.layers is missing"
    ):
        manager.run(Package.load(tiny_llava), [_Step(Noop, 1), _Step(ManifestBreaker, 2)])
