"""vlmc.manager holds every pass to the contract: each violation is caught, with a message for its author."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from vlmc import manager
from vlmc.errors import PassFailed, PassRefused, VlmcError
from vlmc.pass_api import Pass, PassResult, contract_violations, registry
from vlmc.recipe import Step

from ._compose_builders import package


class _Step(Step):
    """A recipe step bound to a pass class that is not in the global registry."""

    def __init__(self, cls, index=1, **opts):
        super().__init__(name=cls.name, options=cls.validate_options(opts, cls.name), index=index)
        self.cls = cls

    def instantiate(self):
        return self.cls(**self.options)


@pytest.fixture()
def pkg(tmp_path):
    return package(tmp_path / "pkg", layers=2)


def _scaled(model: ir.Model, factor: float) -> ir.Model:
    """A clone of ``model`` with its first initializer scaled (the original is not touched)."""
    model = model.clone()
    weight = next(iter(model.graph.initializers.values()))
    weight.const_value = ir.tensor(weight.const_value.numpy() * np.float32(factor), name=weight.name)
    return model


def _first_weight(model: ir.Model) -> np.ndarray:
    return next(iter(model.graph.initializers.values())).const_value.numpy()


class _Scale(Pass):
    """Lossy and functional: scales the embedding table on a clone; evaluate reports the ratio."""

    name = "scale_lossy"
    summary = "scale the embeddings"
    lossy = True
    changes_input = False

    def run(self, package, plan=None):
        package.set_graph("embed_tokens", _scaled(package.model("embed_tokens"), 3.0))
        return PassResult(package)

    def evaluate(self, before, after, result):
        old, new = _first_weight(before.model("embed_tokens")), _first_weight(after.model("embed_tokens"))
        return {"ratio": float(np.abs(new).sum() / np.abs(old).sum())}


class _NoEvaluate(_Scale):
    name = "no_evaluate"
    evaluate = Pass.evaluate  # the base class's: says nothing about fidelity


class _LossyInPlace(_Scale):
    name = "lossy_in_place"
    changes_input = True


class _EditsInPlace(_Scale):
    """Declares changes_input = False, then renames a node of the graph the package holds."""

    name = "edits_in_place"

    def run(self, package, plan=None):
        next(iter(package.model("embed_tokens").graph)).name = "renamed"
        return PassResult(package)


class _WrongModified(Pass):
    name = "wrong_modified"
    summary = "changes a graph, says it did not"

    def run(self, package, plan=None):
        package.set_graph("embed_tokens", _scaled(package.model("embed_tokens"), 2.0))
        return PassResult(package, modified=False)


class _RefusesInCheck(Pass):
    name = "refuses_in_check"
    summary = "refuses the package in check_package"

    def check_package(self, package):
        raise VlmcError("refuses_in_check: this package has no graph named vlm")

    def run(self, package, plan=None):  # pragma: no cover - check_package refuses first
        raise AssertionError("run after a refusal")


class _RefusesInRun(Pass):
    name = "refuses_in_run"
    summary = "refuses a recipe value in run"

    def run(self, package, plan=None):
        raise VlmcError("refuses_in_run: group_size 48 is not a multiple of 32")


class _Planner(Pass):
    """check_package's plan is an object run must receive as it is (no state kept on the pass)."""

    name = "planner"
    summary = "plan, then act on the plan"
    made: list = []
    seen: list = []

    def check_package(self, package):
        plan = {"factor": 4.0, "graph": "embed_tokens"}
        type(self).made.append(plan)
        return plan

    def run(self, package, plan=None):
        type(self).seen.append(plan)
        package.set_graph(plan["graph"], _scaled(package.model(plan["graph"]), plan["factor"]))
        return PassResult(package, True)


def test_a_functional_lossy_pass_with_evaluate_runs_and_reports_fidelity(pkg):
    embed = pkg.model("embed_tokens")  # held before the pass: the snapshot shares this object
    out = manager.run(pkg, [_Step(_Scale)])
    assert out.manifest["history"][-1]["report"]["fidelity"]["ratio"] == pytest.approx(3.0, rel=1e-5)
    assert out.model("embed_tokens") is not embed


def test_a_lossy_pass_without_evaluate_is_refused_before_anything_runs(pkg):
    state = pkg.state()
    with pytest.raises(
        PassFailed, match=r"pass #1 'no_evaluate' \(.*_NoEvaluate\) breaks the pass contract"
    ) as e:
        manager.run(pkg, [_Step(_NoEvaluate)])
    assert "does not implement evaluate(before, after, result)" in str(e.value)
    assert "override Pass.evaluate" in str(e.value)
    assert e.value.exit_code == 1  # a pass bug, not bad input
    assert pkg.state() == state and not pkg.manifest["history"]


def test_a_contract_violation_of_a_later_pass_stops_the_recipe_before_the_first(pkg):
    with pytest.raises(PassFailed, match=r"pass #2 'lossy_in_place' .* changes_input = False"):
        manager.run(pkg, [_Step(_Scale, 1), _Step(_LossyInPlace, 2)])
    assert not pkg.manifest["history"]


def test_a_pass_that_declares_changes_input_false_and_edits_in_place_is_caught(pkg):
    pkg.model("embed_tokens")  # held by the package when the pass starts
    with pytest.raises(PassFailed) as e:
        manager.run(pkg, [_Step(_EditsInPlace)])
    assert (
        "pass #1 'edits_in_place' declares changes_input = False but edited graph 'embed_tokens' in place"
        in str(e.value)
    )
    assert "Model.clone()" in str(e.value)


def test_a_wrong_modified_is_caught(pkg):
    with pytest.raises(PassFailed, match=r"reported modified=False but it changed embed_tokens"):
        manager.run(pkg, [_Step(_WrongModified)])


@pytest.mark.parametrize(
    ("cls", "text"),
    [
        (_RefusesInCheck, "this package has no graph named vlm"),
        (_RefusesInRun, "group_size 48 is not a multiple of 32"),
    ],
)
def test_a_refusal_is_pass_refused_with_exit_code_2_wherever_it_is_found(pkg, cls, text):
    with pytest.raises(PassRefused) as e:
        manager.run(pkg, [_Step(cls)])
    assert f"pass #1 {cls.name!r} failed: {cls.name}: {text} (it was the first pass)" == str(e.value)
    assert e.value.exit_code == 2


def test_a_declared_requirement_refused_is_pass_refused(pkg):
    class _Unmerged(_Scale):
        name = "needs_unmerged"
        requires = ("unmerged",)

    pkg.manifest["pipeline"]["vlm"] = "decoder"  # what merge records
    with pytest.raises(PassRefused, match=r"needs_unmerged cannot run on a merged package") as e:
        manager.run(pkg, [_Step(_Unmerged)])
    assert e.value.exit_code == 2


def test_check_packages_plan_reaches_run_as_it_is(pkg):
    _Planner.made, _Planner.seen = [], []
    out = manager.run(pkg, [_Step(_Planner)])
    (made,), (seen,) = _Planner.made, _Planner.seen  # check_package ran once, and run once
    assert seen is made
    assert out.report["passes"][-1]["changed"] == ["embed_tokens"]


def test_every_registered_pass_keeps_the_contract():
    # quantize and prune_visual_tokens are lossy: each implements evaluate and changes_input = False.
    assert {name: contract_violations(cls) for name, cls in registry().items()} == {
        name: [] for name in registry()
    }
    lossy = {name for name, cls in registry().items() if cls.lossy}
    assert lossy == {"quantize", "prune_visual_tokens"}


def test_quantize_check_package_returns_the_schemes_run_receives(pkg):
    from vlmc.passes.quantize import scheme

    q = registry()["quantize"](decoder={"weights": "int8"}, vision={"weights": "fp32"})
    plan = q.check_package(pkg)
    assert list(plan) == ["decoder"]  # fp32 leaves the vision graph alone, so it is not planned
    assert isinstance(plan["decoder"], scheme.GraphScheme) and plan["decoder"].mode == "int8_weight_only"


def test_merge_refuses_in_check_package_what_run_would_fail_on(pkg):
    from vlmc.pass_api import get

    outputs = pkg.manifest["graphs"]["embed_tokens"]["outputs"]
    pkg.manifest["graphs"]["embed_tokens"]["outputs"] = [dict(o, name="not_embeds") for o in outputs]
    with pytest.raises(
        VlmcError, match=r"merge: embed graph 'embed_tokens' must map input_ids -> inputs_embeds"
    ):
        get("merge")().check_package(pkg)  # found before run, so the manager reports a refusal
    with pytest.raises(PassRefused) as e:
        manager.run(pkg, [Step(name="merge", options={"graph": "vlm"}, index=1)])
    assert e.value.exit_code == 2 and not pkg.manifest["history"]
