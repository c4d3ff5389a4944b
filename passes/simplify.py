"""simplify: onnxsim per graph, then removal of nodes whose outputs nothing uses."""

from __future__ import annotations

import logging

import onnx

from vlmc import graphs as G
from vlmc.pass_api import Option, Pass, PassResult, register
from vlmc.passes._folding import foldable

logger = logging.getLogger(__name__)


def remove_dead_nodes(model: onnx.ModelProto) -> int:
    """Drop nodes (and initializers) that do not contribute to a graph output; return nodes removed."""
    g = model.graph
    live = {o.name for o in g.output}
    keep = []
    for node in reversed(g.node):
        if any(o in live for o in node.output if o):
            keep.append(node)
            live.update(i for i in node.input if i)
            for attr in node.attribute:  # subgraphs read outer-scope names
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    for sn in sub.node:
                        live.update(i for i in sn.input if i)
    removed = len(g.node) - len(keep)
    if removed:
        keep.reverse()
        del g.node[:]
        g.node.extend(keep)
    dead_inits = [t for t in g.initializer if t.name not in live]
    for t in dead_inits:
        g.initializer.remove(t)
    return removed + len(dead_inits)


@register
class Simplify(Pass):
    """Constant-fold and simplify each graph with onnxsim, then drop dead nodes."""

    name = "simplify"
    summary = "onnxsim simplification plus dead-node cleanup on every graph (numerics preserved)"
    preserves_numerics = True
    options = (
        Option("graphs", list, None, "graph names to simplify (default: all)", items=str),
        Option("skip_fuse_bn", bool, True, "leave BatchNormalization unfused (ATC fuses it itself)"),
        Option(
            "max_weight_bytes",
            int,
            1_500_000_000,
            "skip onnxsim for graphs with more weight bytes "
            "(onnxsim serializes the whole model; protobuf caps that at 2 GB)",
            min=0,
        ),
    )

    def run(self, package):
        names, skipped = foldable(package, self.opts["graphs"] or package.graph_names, self.name)
        report = {name: {"skipped": why} for name, why in skipped.items()}
        modified = False
        for name in names:
            model = package.graph(name)
            before = G.fingerprint(model)
            nodes_before = len(model.graph.node)
            if G.initializer_bytes(model) <= self.opts["max_weight_bytes"]:
                model = _onnxsim(model, self.opts["skip_fuse_bn"], name)
            else:
                logger.warning("simplify: %s is too large for onnxsim; only dead nodes are removed", name)
            remove_dead_nodes(model)
            if _same_modulo_node_order(model, package.graph(name)):
                model = package.graph(name)  # onnxsim only reordered nodes: keep the original
            if G.fingerprint(model) != before:
                package.set_graph(name, model)
                modified = True
            report[name] = {"nodes_before": nodes_before, "nodes_after": len(model.graph.node)}
            del model  # one graph resident at a time in a staged package (release is a no-op otherwise)
            package.release(name)
        return PassResult(package, modified, report)


def _same_modulo_node_order(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """onnxsim's topological sort is not stable, so an already simple graph can come back reordered."""
    if a is b:
        return True
    key = lambda m: sorted(n.SerializeToString(deterministic=True) for n in m.graph.node)  # noqa: E731
    same_inits = [(t.name, t.raw_data, list(t.dims)) for t in a.graph.initializer] == [
        (t.name, t.raw_data, list(t.dims)) for t in b.graph.initializer
    ]
    return (
        same_inits
        and key(a) == key(b)
        and a.graph.input == b.graph.input
        and a.graph.output == b.graph.output
    )


def _onnxsim(model: onnx.ModelProto, skip_fuse_bn: bool, name: str) -> onnx.ModelProto:
    import onnxsim

    import vlmc.ortsession  # noqa: F401  (quiets onnxruntime, which onnxsim runs)

    try:
        simplified, ok = onnxsim.simplify(model, skip_fuse_bn=skip_fuse_bn, check_n=0)
    except Exception as exc:  # onnxsim raises RuntimeError/ValidationError on graphs it cannot handle
        logger.warning(
            "simplify: onnxsim could not simplify %s (%s); keeping it", name, str(exc).splitlines()[0]
        )
        return model
    if not ok:
        logger.warning("simplify: onnxsim's own check failed on %s; keeping the original", name)
        return model
    return simplified
