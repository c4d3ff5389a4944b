"""Pass manager contract: exact `modified`, failures named by position, checks, history, --check numerics."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

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

    def run(self, package):
        package.graph("decoder")  # loading a graph is not a change
        return PassResult(package, False, {"looked": True})


class Liar(Pass):
    name = "liar"
    summary = "changes a graph but says it did not"

    def run(self, package):
        model = package.graph("embed_tokens")
        model.graph.node[0].name = "renamed"
        return PassResult(package, False)


class Boaster(Pass):
    name = "boaster"
    summary = "says it changed something but did not"

    def run(self, package):
        return PassResult(package, True)


class Crash(Pass):
    name = "crash"
    summary = "raises"

    def run(self, package):
        raise RuntimeError("boom")


class Breaker(Pass):
    name = "breaker"
    summary = "writes an invalid graph"

    def run(self, package):
        model = package.graph("embed_tokens")
        model.graph.node.append(helper.make_node("Relu", ["does_not_exist"], ["dangling"]))
        package.set_graph("embed_tokens", model)
        return PassResult(package, True)


class ScaleEmbeddings(Pass):
    """Claims to preserve numerics but scales the embedding table: --check must catch it."""

    name = "scale"
    summary = "multiply embeddings"
    preserves_numerics = True
    options = (Option("factor", float, 1.0, "scale factor"),)

    def run(self, package):
        model = package.graph("embed_tokens")
        init = model.graph.initializer[0]
        arr = onnx.numpy_helper.to_array(init) * self.opts["factor"]
        init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
        package.set_graph("embed_tokens", model)
        return PassResult(package, self.opts["factor"] != 1.0 or True)


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
    from vlmc import build as B
    from vlmc import recipe

    r = recipe.parse("model: tiny-llava\npasses: [simplify]")
    r.steps.append(_Step(Crash, 2))
    out = tmp_path / "out"
    with pytest.raises(PassFailed):
        B.build(r, out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
