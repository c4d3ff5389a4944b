"""simplify on a small hand-built package: onnxsim's rewrites and dead-node removal, numerics and `modified` exact."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from vlmc import manager
from vlmc.passes import simplify
from vlmc.recipe import Step

from .._compose_builders import run, vision_graph
from ._folding_builders import folding_package, op_types, pixels, with_dead_and_identity


def _simplify(pkg, **options):
    return manager.run(pkg, [Step(name="simplify", options=options, index=1)])


def test_identity_and_dead_node_go_and_the_outputs_stay(tmp_path):
    pkg = folding_package(tmp_path, with_dead_and_identity)
    before = pkg.model("vision_encoder")
    assert {"Identity", "Sigmoid"} <= set(op_types(before))
    want = run(before, pixels())
    out = _simplify(pkg)
    entry = out.manifest["history"][-1]
    assert entry["pass"] == "simplify" and entry["modified"] is True
    after = out.model("vision_encoder")
    assert not {"Identity", "Sigmoid"} & set(op_types(after))
    assert entry["report"]["vision_encoder"] == {
        "nodes_before": len(before.graph),
        "nodes_after": len(after.graph),
    }
    assert [v.name for v in after.graph.outputs] == [v.name for v in before.graph.outputs]
    got = run(after, pixels())
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


def test_already_simple_package_is_modified_false_and_untouched(tmp_path):
    pkg = folding_package(tmp_path, lambda model: model)
    state = pkg.state()
    out = _simplify(pkg)
    assert out.manifest["history"][-1]["modified"] is False
    assert out.state() == state


def test_only_the_named_graphs_are_simplified(tmp_path):
    pkg = folding_package(tmp_path, with_dead_and_identity)
    out = _simplify(pkg, graphs=["decoder"])
    assert out.manifest["history"][-1]["modified"] is False
    assert "Identity" in op_types(out.model("vision_encoder"))


def test_quantized_graph_is_skipped_with_the_reason(tmp_path):
    pkg = folding_package(tmp_path, with_dead_and_identity)
    pkg.manifest["graphs"]["vision_encoder"]["precision"] = "int4_weight_only"
    out = _simplify(pkg, graphs=["vision_encoder"])
    entry = out.manifest["history"][-1]
    assert entry["modified"] is False
    assert "folding would undo the quantization" in entry["report"]["vision_encoder"]["skipped"]


def test_remove_dead_nodes_says_whether_it_removed_anything():
    model = with_dead_and_identity(vision_graph())
    assert simplify.remove_dead_nodes(model) is True
    assert "Sigmoid" not in op_types(model) and "Identity" in op_types(model)
    assert simplify.remove_dead_nodes(model) is False
    assert isinstance(model, ir.Model)
