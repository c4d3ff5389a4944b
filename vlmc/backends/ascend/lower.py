"""Lowering a portable graph into what ATC builds: QDQ -> AMCT deploy form, weight-only -> NPU ops.

The lowering is a list of rewrite rules (``vlmc/backends/ascend/rules``), one per pattern, each with
match / check / rewrite; a check that fails names the node and says why. In order:

1. ``qdq_matmul``: ``DQ(Q(x)) -> MatMul/Gemm <- DQ(int8 weight, per tensor)`` becomes
   ``AscendQuant(x)`` -> int8 MatMul (+ int32 bias Add) -> ``AscendDequant`` with one deq_scale value.
2. ``qdq_conv``: the same for Conv, with weights and deq_scale per output channel.
3. ``weight_only_matmul``: a MatMul whose weight is dequantized from integers becomes
   ``NPUWeightQuantBatchMatmulV2``, read from the quantize pass's recorded facts (fitting only for
   graphs made by other tools).
4. ``leftover_qdq``: activation ``DQ(Q(x))`` pairs become ``Clip``; constant DQs become
   ``AscendAntiQuant`` (per tensor) or are folded.

Anything still Q/DQ afterwards is an error naming the node. Each rule's source (repository and file)
is in its module and in docs/ascend.md; compile.json counts the rewrites per rule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from vlmc import interop, tensor_names
from vlmc.backends.ascend import rules
from vlmc.backends.ascend.rules import Graph
from vlmc.errors import CheckFailed

logger = logging.getLogger(__name__)

QUANT_CORE_OPS = ("MatMul", "Gemm", "Conv")
# Manifest quantization keys that list the nodes the quantize pass kept in FP32 (first found wins).
_KEPT_FP32_KEYS = ("nodes_kept_fp32", "fp32_nodes", "nodes_to_exclude")


@dataclass
class LowerReport:
    """What the lowering did to one graph (shown in compile.json)."""

    quantized_layers: list[str] = field(default_factory=list)
    weight_only_layers: list[str] = field(default_factory=list)
    weight_only_bits: int | None = None
    weight_only_sources: dict[str, int] = field(default_factory=dict)  # "facts" | "fit" -> layers
    asymmetric_layers: list[str] = field(default_factory=list)  # AscendQuant with a non-zero offset
    int4_storage: str | None = None  # INT4 weights: "int8" (one per int8) or "int4" (ONNX INT4, packed)
    fake_quant_clips: int = 0
    antiquant_constants: int = 0
    folded_constants: int = 0
    kept_fp32: list[str] = field(default_factory=list)
    rules: dict[str, dict] = field(default_factory=dict)  # rule -> {"applied": n, "not_matched": {...}}
    notes: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        return bool(self.quantized_layers or self.weight_only_layers)

    def to_dict(self) -> dict:
        return {
            "quantized_layers": self.quantized_layers,
            "weight_only_layers": self.weight_only_layers,
            "weight_only_bits": self.weight_only_bits,
            "weight_only_sources": self.weight_only_sources,
            "int4_storage": self.int4_storage,
            "asymmetric_layers": self.asymmetric_layers,
            "fake_quant_clips": self.fake_quant_clips,
            "antiquant_constants": self.antiquant_constants,
            "folded_constants": self.folded_constants,
            "kept_fp32": self.kept_fp32,
            "rules": self.rules,
            "notes": self.notes,
        }


def lower(
    model: ir.Model,
    name: str,
    info: dict | None = None,
    int4_weights: str = "int8",
    store: interop.TensorStore | None = None,
) -> tuple[ir.Model, LowerReport]:
    """Lower one graph in place for ATC.

    Weights are read one at a time (memory-mapped) where a rule needs them; each deploy-form weight
    a rule makes goes to ``store`` as it is made, so the lowering holds at most one weight.

    Args:
        model: the portable graph (a copy the caller owns; it is rewritten in place).
        name: the graph's name, for messages.
        info: the graph's manifest entry; its ``quantization`` facts are what the rules read.
        int4_weights: INT4 weight storage, "int8" (one value per int8) or "int4" (ONNX INT4, see
            docs/ascend.md "INT4 on Ascend").
        store: where new weights are written (None keeps them in memory: small graphs, tests).

    Returns:
        The lowered model and what was done.

    Raises:
        CheckFailed: a quantization pattern has no Ascend form; the message names the nodes.
        VlmcError: a weight-only group size the NPU refuses (exit 2).
    """
    info = info or {}
    facts = info.get("quantization") or {}
    report = LowerReport()
    gr = Graph(model, store)
    ctx = rules.Context(gr, name, facts, report, int4_weights=int4_weights)
    for rule in rules.default_rules():
        report.rules[rule.name] = {**rules.apply(ctx, rule), "source": rule.source}
    logger.info("%s: rewrites %s", name, ", ".join(f"{k}={v['applied']}" for k, v in report.rules.items()))
    for node in gr.g:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"):
            ctx.problems.append(
                f"{node.name} ({node.op_type}) is not part of a pattern vlmc can lower; quantize "
                "MatMul/Gemm/Conv with static QDQ (int8 activations, symmetric int8 weights)"
            )
    if ctx.problems:
        raise CheckFailed(f"{name}: cannot lower for Ascend: {'; '.join(ctx.problems)}")
    names = {n.name for n in gr.g}
    recorded = next((facts[k] for k in _KEPT_FP32_KEYS if isinstance(facts.get(k), list)), None)
    if recorded is not None:
        # The quantize pass says which nodes it kept in FP32; nodes it merely skipped follow the precision.
        report.kept_fp32 = [n for n in recorded if n in names]
    elif report.quantized:
        # Without facts: layers with a constant weight that stayed float were kept in FP32; activation x
        # activation MatMuls (attention) were never candidates and follow the precision.
        lowered = set(report.quantized_layers) | set(report.weight_only_layers)
        report.kept_fp32 = [
            n.name
            for n in gr.g
            if n.op_type in QUANT_CORE_OPS
            and n.name not in lowered
            and not _is_int8_input(n)
            and gr.const_subgraph(n.inputs[1]) is not None
        ]
    return model, report


def _is_int8_input(node: ir.Node) -> bool:
    p = node.inputs[0].producer()
    return p is not None and p.op_type == "AscendQuant"


def strip_past(model: ir.Model, name: str, prefix: str = tensor_names.PAST_PREFIX) -> tuple[ir.Model, int]:
    """Make the prefill form of a decoder: drop its past inputs (the past is empty in prefill), in place.

    Each past input is removed from the Concat that appends the new keys/values; a Concat left with
    one input becomes Identity. Any other consumer (e.g. a Shape that measures the past) gets an
    empty tensor ``[batch, ..., 0, ...]`` built from ``inputs_embeds``' batch size.

    Returns:
        The rewritten model and how many non-Concat consumers were given an empty past.

    Raises:
        CheckFailed: a past input's shape has dims other than batch, past_sequence and constants.
    """
    gr = Graph(model)
    past = [i for i in gr.g.inputs if i.name.startswith(prefix)]
    empties = 0
    for inp in past:
        for cons in list(dict.fromkeys(inp.consumers())):
            if cons.op_type != "Concat":
                continue
            rest = [i for i in cons.inputs if i is not inp]
            if not rest:
                # A Concat of the past alone (an identity the exporter left) keeps it and so is fed
                # the empty past below; a Concat with no inputs is not valid ONNX.
                continue
            if len(rest) == 1:
                out = ir.Value(name=cons.outputs[0].name)
                ident = ir.node("Identity", rest, outputs=[out], name=cons.name)
                gr.replace(cons, [ident], [], [(cons.outputs[0], out)])
            else:
                gr.replace_inputs(cons, rest)
        if inp.uses():
            _feed_empty(gr, inp, name)
            empties += 1
        gr.g.inputs.remove(inp)
    return model, empties


def _feed_empty(gr: Graph, inp: ir.Value, name: str) -> None:
    dims = []
    batch_at = None
    for i, d in enumerate(inp.shape or ()):
        if isinstance(d, int):
            dims.append(d)
        elif d.value == "batch":
            dims.append(1)
            batch_at = i
        elif d.value == "past_sequence":
            dims.append(0)
        else:
            raise CheckFailed(f"{name}: cannot build the prefill graph: {inp.name} has dim {d.value!r}")
    dtype = inp.dtype.numpy()
    out = inp.name
    fill = {"value": ir.tensor(np.zeros(1, dtype=dtype))}
    empty = ir.Value(name=None)
    if batch_at is None:
        shape = gr.add_init(f"{out}_empty_shape", np.array(dims, dtype=np.int64))
        nodes = [ir.node("ConstantOfShape", [shape], fill, outputs=[empty], name=gr.unique(f"{out}_empty"))]
    else:
        embeds = next((i for i in gr.g.inputs if i.name == "inputs_embeds"), gr.g.inputs[0])
        shp, bat = gr.value(f"{out}_embeds_shape"), gr.value(f"{out}_batch")
        full = gr.value(f"{out}_empty_shape")
        before = gr.add_init(f"{out}_dims_before", np.array(dims[:batch_at], dtype=np.int64))
        after = gr.add_init(f"{out}_dims_after", np.array(dims[batch_at + 1 :], dtype=np.int64))
        start = gr.add_init(f"{out}_b0", np.array([0], np.int64))
        end = gr.add_init(f"{out}_b1", np.array([1], np.int64))
        nodes = [
            ir.node("Shape", [embeds], outputs=[shp], name=gr.unique(f"{out}_Shape")),
            ir.node("Slice", [shp, start, end], outputs=[bat], name=gr.unique(f"{out}_Slice")),
            ir.node(
                "Concat", [before, bat, after], {"axis": 0}, outputs=[full], name=gr.unique(f"{out}_Concat")
            ),
            ir.node("ConstantOfShape", [full], fill, outputs=[empty], name=gr.unique(f"{out}_empty")),
        ]
    first = next(iter(gr.g), None)
    if first is None:
        gr.g.extend(nodes)
    else:
        gr.g.insert_before(first, nodes)
    # the empty tensor takes the input's place (and name) for every consumer left
    inp.replace_all_uses_with(empty)
    inp_name, inp.name = inp.name, f"{out}__removed"
    empty.name = inp_name
