"""rules/_base.py's apply: match -> check -> rewrite over one snapshot of the nodes, with reasons and counts."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from vlmc import graphs, interop
from vlmc.backends.ascend.rules import Context, Graph, NoMatch, Rule, apply

FLOAT = ir.DataType.FLOAT


def _node(op_type: str, inputs: list[ir.Value], name: str) -> ir.Node:
    node = ir.node(op_type, inputs, name=name)
    node.outputs[0].name = f"{name}_out"
    return node


def _model() -> ir.Model:
    """x -> Relu "first" -> Neg -> Relu "head" -> Relu "tail" -> Relu "refused" -> y, and a dead Sigmoid."""
    x = ir.Value(name="x", shape=ir.Shape([2, 3]), type=ir.TensorType(FLOAT))
    first = _node("Relu", [x], "first")
    neg = _node("Neg", [first.outputs[0]], "neg")
    head = _node("Relu", [neg.outputs[0]], "head")
    tail = _node("Relu", [head.outputs[0]], "tail")
    refused = _node("Relu", [tail.outputs[0]], "refused")
    dead = _node("Sigmoid", [neg.outputs[0]], "dead")
    y = refused.outputs[0]
    y.shape, y.type = ir.Shape([2, 3]), ir.TensorType(FLOAT)
    g = ir.Graph(
        [x],
        [y],
        nodes=[first, neg, head, tail, refused, dead],
        opset_imports={"": graphs.EXPORT_OPSET},
        name="g",
    )
    return ir.Model(g, ir_version=8)


def _match(ctx: Context, node: ir.Node):
    if node.inputs[0].is_graph_input():
        return NoMatch("reads a graph input")
    tail = Graph.only_consumer(node.outputs[0])
    return node, tail if tail is not None and tail.op_type == "Relu" else None


def _check(ctx: Context, match) -> str | None:
    return "refused on purpose" if match[0].name == "refused" else None


def _rewrite(ctx: Context, match) -> None:
    """Relu (and a Relu right after it, which changes nothing) -> Max(x, 0)."""
    head, tail = match
    gr = ctx.graph
    new = ir.node(
        "Max", [head.inputs[0], gr.add_init("zero", np.zeros((), np.float32))], name=gr.unique("max")
    )
    last = tail if tail is not None else head
    gr.replace(head, [new], [tail] if tail is not None else [], [(last.outputs[0], new.outputs[0])])


RULE = Rule(
    name="relu_to_max", anchors=("Relu",), source="a test", match=_match, check=_check, rewrite=_rewrite
)


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(interop.session_bytes(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_apply_counts_rewrites_and_reasons_and_names_refusals():
    model = _model()
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    want = _run(model, x)
    ctx = Context(graph=Graph(model), name="g", facts={}, report=None)
    counts = apply(ctx, RULE)
    # "first" reads the graph input; "head" is rewritten and takes "tail" with it, so "tail" (in the
    # snapshot, but gone) is not visited; "refused" matches and its check gives the reason
    assert counts == {"applied": 1, "not_matched": {"reads a graph input": 1}}
    assert ctx.problems == ["refused (Relu): refused on purpose"]
    kinds = [n.op_type for n in model.graph]
    assert kinds == ["Relu", "Neg", "Max", "Relu"]  # the dead Sigmoid is gone too (dce)
    assert [n.name for n in model.graph if n.op_type == "Relu"] == ["first", "refused"]
    assert model.graph.outputs[0].name == "refused_out"
    np.testing.assert_array_equal(_run(model, x), want)


def test_a_rule_whose_anchors_are_absent_rewrites_nothing_but_dead_nodes_still_go():
    model = _model()
    before = interop.fingerprint(model)
    ctx = Context(graph=Graph(model), name="g", facts={}, report=None)
    rule = Rule(name="none", anchors=("Conv",), source="a test", match=_match, check=_check, rewrite=_rewrite)
    assert apply(ctx, rule) == {"applied": 0, "not_matched": {}}
    assert ctx.problems == []
    assert "Sigmoid" not in [n.op_type for n in model.graph]  # apply always ends with dce
    assert interop.fingerprint(model) != before
