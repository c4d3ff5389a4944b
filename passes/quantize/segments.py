"""A graph cut into segments run one at a time: each segment's weights and one cut's activations resident.

Shared by AWQ's layer-wise calibration (``weight_only.layerwise_inputs``) and quantize's
streamed per-graph fidelity (``stream_fidelity``). A cut is a position in a topological order of
the nodes; the values that cross it (made before it, read at or after it) are what a caller holds
per sample between segments. Each segment is a model of its own whose weights are the graph's own
tensors (memory-mapped from their files; nothing is read until its session is made).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir


def _is_weight(v: ir.Value) -> bool:
    return v.is_initializer() or v.const_value is not None


class Segment:
    """The nodes of ``model`` between ``inputs`` and ``outputs``, as a model of their own.

    Inputs: the values they read that earlier segments (or the graph's inputs) made; outputs:
    ``outputs`` (the values they make that later nodes read, and any graph outputs the caller wants).
    The model is onnx-ir's ``extract`` of them (a clone of the structure bounded by ``inputs`` and
    ``outputs``); its weights are the graph's own tensors.
    """

    def __init__(self, model: ir.Model, inputs: list[ir.Value], outputs: list[ir.Value]):
        graph = ir.convenience.extract(model.graph, inputs, outputs)
        graph.name = "segment"
        self.inputs = list(graph.inputs)
        self.output_names = [v.name for v in outputs]
        self.weight_bytes = sum(
            v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None
        )
        self.model = ir.Model(graph, ir_version=model.ir_version)

    def run(
        self, feeds: list[dict[str, np.ndarray]], open_session: Callable[[ir.Model], object] | None = None
    ) -> list[list[np.ndarray]]:
        """Each sample's outputs; input types the graph did not record come from the first sample.

        ``open_session(model)`` makes the session (default ``ortsession.from_model``). Once it is open
        the segment's memory maps are dropped (the session holds the weights it computes from), and
        the session is closed before this returns: nothing of the segment stays resident.
        """
        from vlmc import ortsession

        for v in self.inputs:
            a = feeds[0][v.name]
            if v.type is None:
                v.type = ir.TensorType(ir.DataType.from_numpy(a.dtype))
            v.shape = ir.Shape([None] * a.ndim)  # lengths vary between samples
        sess = (open_session or ortsession.from_model)(self.model)
        for v in self.model.graph.initializers.values():
            release(v.const_value)
        try:
            return [sess.run(self.output_names, {v.name: f[v.name] for v in self.inputs}) for f in feeds]
        finally:
            del sess


def release(t) -> None:
    """Drop a weight's cached bytes or memory map; it is re-read if asked again."""
    if isinstance(t, ir.ExternalTensor):
        t.release()


def uses(order: list[ir.Node]) -> tuple[dict[str, int], dict[ir.Value, int]]:
    """(first use position by value name, last use position by value) of the non-weight values read."""
    first_use: dict[str, int] = {}
    last_use: dict[ir.Value, int] = {}
    for i, n in enumerate(order):
        for v in n.inputs:
            if v is not None and not _is_weight(v):
                first_use.setdefault(v.name, i)
                last_use[v] = i
    return first_use, last_use


def split(
    model: ir.Model,
    order: list[ir.Node],
    cuts: list[int],
    last_use: dict[ir.Value, int],
    graph_outputs: bool = False,
) -> list[tuple[int, Segment | None, list[str]]]:
    """``(cut, segment of order[previous cut:cut] or None when empty, its output names)`` per cut.

    A segment returns the values it makes that a node at or after its cut reads and, with
    ``graph_outputs``, the graph outputs it makes. Every segment is cloned here, before any runs, so a
    caller may edit the graph between segments.
    """
    pos = {n: i for i, n in enumerate(order)}
    wanted_out = {v for v in model.graph.outputs} if graph_outputs else set()
    plan: list[tuple[int, Segment | None, list[str]]] = []
    start = 0
    for cut in sorted(cuts):
        seg, outs = None, []
        if cut > start:
            seg_nodes = order[start:cut]
            made = {o for n in seg_nodes for o in n.outputs}
            ins, seen = [], set()
            for n in seg_nodes:
                for v in n.inputs:
                    if v is None or v in made or v in seen or _is_weight(v):
                        continue
                    seen.add(v)
                    ins.append(v)
            outs = sorted(
                (o for o in made if last_use.get(o, -1) >= cut or o in wanted_out),
                key=lambda o: pos[o.producer()],
            )
            seg = Segment(model, ins, outs)
            start = cut
        plan.append((cut, seg, [o.name for o in outs]))
    return plan
