"""fold_constants: evaluate subgraphs that depend only on constants, using onnx-graphsurgeon."""

from __future__ import annotations

import logging

import onnx_graphsurgeon as gs

from vlmc import graphs as G
from vlmc.pass_api import Option, Pass, PassResult, register
from vlmc.passes._folding import foldable

logger = logging.getLogger(__name__)


@register
class FoldConstants(Pass):
    """Fold constant subgraphs (onnxruntime evaluates them) and drop what becomes unused."""

    name = "fold_constants"
    summary = "fold constant subexpressions with onnx-graphsurgeon + onnxruntime (numerics preserved)"
    preserves_numerics = True
    options = (
        Option("graphs", list, None, "graph names to fold (default: all)", items=str),
        Option("size_threshold_mb", float, 64.0, "do not materialize folded tensors larger than this", min=0),
    )

    def run(self, package):
        names, skipped = foldable(package, self.opts["graphs"] or package.graph_names, self.name)
        report = {name: {"skipped": why} for name, why in skipped.items()}
        modified = False
        limit = int(self.opts["size_threshold_mb"] * 1024 * 1024)
        for name in names:
            model = package.graph(name)
            before = G.fingerprint(model)
            n_before = len(model.graph.node)
            graph = gs.import_onnx(model)
            graph.fold_constants(size_threshold=limit, error_ok=True).cleanup().toposort()
            folded = gs.export_onnx(graph, do_type_check=False)
            folded.ir_version = model.ir_version
            del folded.opset_import[:]
            folded.opset_import.extend(model.opset_import)
            # graphsurgeon keeps tensors it cannot fold; only accept a graph that really changed
            if G.fingerprint(folded) != before:
                package.set_graph(name, folded)
                modified = True
                model = folded
            report[name] = {"nodes_before": n_before, "nodes_after": len(model.graph.node)}
        return PassResult(package, modified, report)
