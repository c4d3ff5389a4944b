"""fold_constants: evaluate subgraphs that depend only on constants, using onnx-graphsurgeon."""

from __future__ import annotations

import gc
import logging

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

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
            folded = _export_without_copies(graph)
            folded.ir_version = model.ir_version
            del folded.opset_import[:]
            folded.opset_import.extend(model.opset_import)
            # graphsurgeon keeps tensors it cannot fold; only accept a graph that really changed
            if G.fingerprint(folded) != before:
                package.set_graph(name, folded)
                modified = True
                model = folded
            report[name] = {"nodes_before": n_before, "nodes_after": len(model.graph.node)}
            # One graph resident at a time in a staged package (release is a no-op otherwise). gs
            # graphs are reference cycles whose lazy constants keep the old model's protobuf arena,
            # i.e. all its weights, alive until the cycle collector runs: collect them now.
            del model, graph, folded
            gc.collect()
            package.release(name)
        return PassResult(package, modified, report)


def _export_without_copies(graph: gs.Graph) -> onnx.ModelProto:
    """gs.export_onnx, with each large weight's bytes copied once instead of three times.

    export_onnx hands the original TensorProtos to onnx.helper.make_graph and make_model, which copy
    each one (twice) into the new model, so a multi-GB graph briefly exists three times over.
    Weights that graphsurgeon never loaded (still lazy, so unchanged) are exported as empty stubs
    and get their bytes back afterwards, read once from the original tensor.
    """
    originals: dict[str, onnx.TensorProto] = {}
    for tensor in graph.tensors().values():
        lazy = getattr(tensor, "_values", None)  # how gs itself tells untouched initializers apart
        if (
            isinstance(tensor, gs.Constant)
            and isinstance(lazy, LazyValues)
            and isinstance(lazy.tensor, onnx.TensorProto)
            and lazy.tensor.HasField("raw_data")
            and lazy.nbytes >= G.EXTERNAL_DATA_THRESHOLD
        ):
            stub = onnx.TensorProto()
            stub.name, stub.data_type = lazy.tensor.name, lazy.tensor.data_type
            stub.dims.extend(lazy.tensor.dims)
            originals[tensor.name] = lazy.tensor
            tensor._values = LazyValues(stub)
    folded = gs.export_onnx(graph, do_type_check=False)
    for t in folded.graph.initializer:
        if t.name in originals:
            t.raw_data = originals[t.name].raw_data
    return folded
