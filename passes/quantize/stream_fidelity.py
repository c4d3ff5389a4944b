"""Per-graph fidelity of a graph too large for one session: run it segment by segment, FP32 and quantized.

The whole-graph path (``fidelity.graph_fidelity``) opens one onnxruntime session on the FP32 graph
(while recording) and one on the quantized graph: each holds the graph's weights, 24.6 GiB for a 7B
decoder in FP32. Here the graph is cut into segments (``segments``) of at most ``SEGMENT_BYTES``
of weights, at positions where the fewest values cross (a decoder's layer boundaries, where only
the residual stream, masks and rotary tables do). Each segment runs on every eval sample from the
values that crossed the previous cut, its session closed and its memory maps dropped before the
next opens. Resident: one segment's weights, one cut's crossing values per sample, and the graph
outputs themselves (which the whole-graph path holds too). The FP32 graph and the quantized graph
are cut independently, each by its own structure: only graph outputs are compared, with the same
metric code as the whole-graph path (``fidelity.accumulate``).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import onnx_ir as ir

from . import segments

logger = logging.getLogger(__name__)

# Weights of one segment (FP32 bytes as stored). A LLaVA-1.5-7B decoder layer is 0.81 GB, so
# segments are about one layer; the FP32 lm_head (0.52 GB) fits with its layer.
SEGMENT_BYTES = 1 << 30

_FLOATS = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16}


def order(graph: ir.Graph) -> list[ir.Node]:
    """A topological order of the nodes with each weight-only chain placed just before its first reader.

    A node whose inputs are all weights (or outputs of such nodes), e.g. a weight's dequantization, is
    constant; placed where the graph has it (onnxruntime's quantizer may put all of them first), its
    output would cross every cut up to its reader and be held per sample.
    """
    nodes = list(graph)
    constant: set[ir.Node] = set()
    for n in nodes:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in n.attributes.values()):
            continue
        if all(
            v is None or v.is_initializer() or v.const_value is not None or v.producer() in constant
            for v in n.inputs
        ):
            constant.add(n)
    out: list[ir.Node] = []
    placed: set[ir.Node] = set()

    def place(n: ir.Node) -> None:
        stack = [(n, False)]
        while stack:
            node, ready = stack.pop()
            if node in placed:
                continue
            if ready:
                placed.add(node)
                out.append(node)
                continue
            stack.append((node, True))
            for v in node.inputs:
                p = v.producer() if v is not None else None
                if p is not None and p in constant and p not in placed:
                    stack.append((p, False))

    for n in nodes:
        if n not in constant:
            place(n)
    for n in nodes:  # constant nodes no other node reads (graph outputs)
        if n not in placed:
            place(n)
    return out


def _brings(nodes: list[ir.Node], expand: dict | None = None) -> list[int]:
    """Weight bytes each node brings to its segment's session (a weight counts at its first reader);
    ``expand`` maps a dtype to how many times its bytes the session holds."""
    seen: set[ir.Value] = set()
    out = []
    for n in nodes:
        b = 0
        for v in n.inputs:
            if v is not None and v not in seen and v.const_value is not None:
                seen.add(v)
                b += v.const_value.nbytes * (expand or {}).get(v.const_value.dtype, 1)
        out.append(b)
    return out


# A dequantized weight-only session (``ortsession.dequantized``) holds each integer weight as float32:
# int8 storage 4x its bytes, int4 packed two to a uint8 8x. Segments are sized by what is held.
DEQUANTIZED = {ir.DataType.INT8: 4, ir.DataType.UINT8: 8, ir.DataType.INT4: 8, ir.DataType.UINT4: 8}


def cuts(nodes: list[ir.Node], segment_bytes: int | None = None, expand: dict | None = None) -> list[int]:
    """Cut positions (the last is ``len(nodes)``): segments of at most ``segment_bytes`` (default
    ``SEGMENT_BYTES``) of weights (or one node's, if more), each ended where the fewest values cross,
    the latest such place."""
    segment_bytes = SEGMENT_BYTES if segment_bytes is None else segment_bytes
    first_use, last_use = segments.uses(nodes)
    n_nodes = len(nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    # crossing[i]: values made before position i and read at or after it (cut "before node i").
    delta = [0] * (n_nodes + 2)
    for v, last in last_use.items():
        p = v.producer()
        if p is None or p not in pos:
            continue  # a graph input: always at hand
        if last > pos[p]:
            delta[pos[p] + 1] += 1
            delta[last + 1] -= 1
    # A cut must not split a QDQ unit (DequantizeLinear -> op -> QuantizeLinear): onnxruntime fuses a
    # whole unit into an integer kernel (QLinearMatMul, ...) and a split one runs in float, so the
    # segments would not compute what the whole graph does.
    split_unit = [0] * (n_nodes + 2)
    for v, last in last_use.items():
        p = v.producer()
        if p is None or p not in pos:
            continue
        readers = [pos[u.node] for u in v.uses() if u.node in pos]
        if p.op_type == "DequantizeLinear":
            end = last
        else:
            end = max((r for r in readers if nodes[r].op_type == "QuantizeLinear"), default=-1)
        if end > pos[p]:
            split_unit[pos[p] + 1] += 1
            split_unit[end + 1] -= 1
    crossing, running, inside = [0] * (n_nodes + 1), 0, 0
    for i in range(n_nodes + 1):
        running += delta[i]
        inside += split_unit[i]
        crossing[i] = running + (n_nodes + 1) * (inside > 0)  # a split unit only as a last resort
    brings = _brings(nodes, expand)
    out, start = [], 0
    while start < n_nodes:
        total, end = 0, start
        while end < n_nodes and (end == start or total + brings[end] <= segment_bytes):
            total += brings[end]
            end += 1
        if end == n_nodes:
            cut = n_nodes
        else:
            # In the window's second half, so a graph's preamble (few values alive before its mask and
            # rotary tables exist) does not make a run of tiny segments; the latest of the fewest.
            cut = min(range(end, start + (end - start) // 2, -1), key=lambda i: crossing[i])
        out.append(cut)
        start = cut
    return out


def run(
    model: ir.Model,
    feeds: list[dict[str, np.ndarray]],
    open_session,
    segment_bytes: int | None = None,
    expand: dict | None = None,
    on_output=None,
) -> tuple[list[dict[str, np.ndarray]], dict]:
    """The graph's outputs per sample, computed segment by segment; and facts (segments, largest).

    ``expand``: how many times a dtype's bytes the sessions hold (``DEQUANTIZED`` for weight-only).
    ``on_output(sample, name, array)``, if given, takes each graph output as its segment makes it,
    instead of it being kept for the result (a decoder's present KV of every layer).
    """
    graph = model.graph
    nodes = order(graph)
    _, last_use = segments.uses(nodes)
    positions = cuts(nodes, segment_bytes, expand)
    brings = _brings(nodes, expand)
    held_bytes = [sum(brings[a:b]) for a, b in zip([0, *positions], positions)]
    pieces = segments.split(model, nodes, positions, last_use, graph_outputs=True)
    last_by_name = {v.name: i for v, i in last_use.items()}
    output_names = {v.name for v in graph.outputs}
    # Graph inputs, in the dtype the graph takes (an fp16 graph without fp32 IO takes float16).
    inputs = {}
    for v in graph.inputs:
        want = _FLOATS.get(v.dtype)
        arrays = [f[v.name] for f in feeds if v.name in f]
        if want is not None:
            arrays = [a.astype(want, copy=False) if a.dtype.kind == "f" else a for a in arrays]
        if len(arrays) == len(feeds):
            inputs[v.name] = arrays
    held: dict[str, list[np.ndarray]] = {}
    results = [{} for _ in feeds]
    largest = 0
    t0 = time.monotonic()
    parts = [s for _, s, _ in pieces if s is not None]
    for k, (cut, seg, out_names) in enumerate(pieces):
        if seg is None:
            continue
        largest = max(largest, held_bytes[k])
        samples = [
            {v.name: (held[v.name] if v.name in held else inputs[v.name])[s] for v in seg.inputs}
            for s in range(len(feeds))
        ]
        got = seg.run(samples, open_session)
        del samples
        for j, name in enumerate(out_names):
            arrays = [g[j] for g in got]
            if name in output_names:
                for s, a in enumerate(arrays):
                    if on_output is None:
                        results[s][name] = a
                    else:
                        on_output(s, name, a)
            if last_by_name.get(name, -1) >= cut:
                held[name] = arrays
        del got
        for name in [n for n in held if last_by_name.get(n, -1) < cut]:
            del held[name]
        logger.info(
            "quantize: streamed fidelity segment %d/%d (%.2f GiB of weights), %.1f s",
            k + 1,
            len(parts),
            held_bytes[k] / 2**30,
            time.monotonic() - t0,
        )
    # Graph outputs that are graph inputs or weights themselves pass through.
    made = {name for _, _, names in pieces for name in names}
    for v in graph.outputs:
        if v.name in made:
            continue
        for s in range(len(feeds)):
            a = (
                inputs[v.name][s]
                if v.name in inputs
                else v.const_value.numpy()
                if v.const_value is not None
                else None
            )
            if a is not None and on_output is None:
                results[s][v.name] = a
            elif a is not None:
                on_output(s, v.name, a)
    return results, {"segments": len(parts), "largest_segment_weight_bytes": int(largest)}


def _fp32_session(model: ir.Model):
    from vlmc import ortsession

    return ortsession.from_model(model)


def _session_for(precision: str | None):
    from vlmc import ortsession

    if precision in ("int8_weight_only", "int4_weight_only"):
        # Each weight's dequantization run once (as the whole-graph fidelity session does), so the
        # segment runs at FP32 speed on every sample instead of dequantizing per call.
        return ortsession.dequantized
    return lambda m: ortsession.from_model(m, precision=precision)


def reference(model: ir.Model, feeds: list[dict], segment_bytes: int | None = None) -> list[dict]:
    """FP32 outputs of the graph on ``feeds``, segment by segment (before it is quantized)."""
    outs, facts = run(model, feeds, _fp32_session, segment_bytes)
    logger.info("quantize: FP32 reference recorded in %d segments", facts["segments"])
    return outs


def graph_fidelity(
    model: ir.Model,
    precision: str | None,
    feeds: list[dict],
    refs: list[dict],
    segment_bytes: int | None = None,
    last_position: bool = False,
) -> tuple[dict, dict]:
    """``fidelity.graph_fidelity``'s numbers for the quantized ``model``, run segment by segment.

    ``last_position`` (a decoder): ``logits`` are compared at the last position, as the whole-graph
    path does (``fidelity.last_position``); ``refs`` may hold that position only."""
    from . import fidelity

    if not refs:
        return {}, {}
    order_of = {v.name: i for i, v in enumerate(model.graph.outputs)}  # the whole-graph path's order
    expand = DEQUANTIZED if precision in ("int8_weight_only", "int4_weight_only") else None
    out: dict[str, dict] = {}

    def compare(sample: int, name: str, got: np.ndarray) -> None:
        # Each output is compared as its segment makes it: only the FP32 references stay resident.
        if name in refs[sample]:
            ref = refs[sample][name]
            if last_position and name == fidelity.LOGITS:
                got, ref = got[:, -1:], ref[:, -1:]
            fidelity.accumulate(out, {name: ref}, {name: got})

    _, facts = run(model, feeds[: len(refs)], _session_for(precision), segment_bytes, expand, compare)
    if last_position and fidelity.LOGITS in out:
        out[fidelity.LOGITS]["positions"] = "last"
    return dict(sorted(out.items(), key=lambda kv: order_of.get(kv[0], len(order_of)))), facts
