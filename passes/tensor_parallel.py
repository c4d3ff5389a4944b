"""tensor_parallel: shard the decoder Megatron-style over N ranks, as segments cut at the all-reduce points.

The split is the one Megatron-LM uses (and MindIE-LLM/ATB on Ascend): q/k/v and gate/up are
column-parallel (each rank computes its own heads and its slice of the MLP's intermediate width),
o_proj and down_proj are row-parallel (each rank multiplies its slice and the ranks' partial sums are
added by an all-reduce). That is two all-reduces per layer, after the attention output projection and
after the MLP down projection (NVIDIA/apex ``apex/transformer/tensor_parallel/layers.py``,
ColumnParallelLinear / RowParallelLinear, the Megatron code apex carries).

No ONNX parser plugin registers an HCCL collective, so an offline 910B ``.om`` cannot contain one
(docs/atc-facts.md, "Several cards"; hicann/ge ``--cluster_config.md``). Each rank's
decoder is therefore cut at the all-reduce points into ``2 * layers + 1`` segment graphs, and the host
calls the collective between them (``HcclAllReduce(sendBuf, recvBuf, count, dataType, op, comm,
stream)``, hicann/hccl ``include/hccl.h``; ``torch.distributed.all_reduce`` on gloo here). The host plan
— segment, all-reduce, segment, ... — is written into the manifest (``tensor_parallel.plan``).

Segment ``k`` of rank ``r`` is graph ``<decoder>.rank<r>.<k>``. Segment 0 takes the decoder's inputs;
segment ``k > 0`` takes ``tp_residual.{k-1}`` (the residual stream) and ``tp_reduced.{k-1}`` (the summed
projection) and starts with their residual Add. Segment ``k < 2L`` returns ``tp_partial.{k}`` (this
rank's share of the row-parallel projection, before the all-reduce) and ``tp_residual.{k}``; attention
segments also return their layer's ``present.{i}.key/value``; the last segment returns ``logits``.

Embedding, vision and the final norm + lm_head are replicated (every rank holds and runs them whole): a
vocab-parallel head would need an all-gather of the logits per step for a few hundred MB per card.

Layers are found structurally, never by node names or order (``_find_cuts``): the residual Adds whose
other operand is a projection's output (through its bias, a post-norm, casts, reshapes); Adds of
what does not read the stream (learned positions, Qwen3-VL's deepstack rows) stay in the replicated
stream. The heads count comes from the query projection's width and ``kv.head_dim``. The scheme is
Megatron-LM's (Shoeybi et al., arXiv:1909.08053, section 3).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.pass_api import Option, Pass, PassResult, register

logger = logging.getLogger(__name__)

SIZES = (2, 4, 8)
PARTIAL = "tp_partial.{}"
REDUCED = "tp_reduced.{}"
RESIDUAL = "tp_residual.{}"
PRESENT_PREFIX = "present."
PAST = "past_key_values.{}.{}"


def segment_name(decoder: str, rank: int, k: int) -> str:
    """The graph holding segment ``k`` of ``rank``."""
    return f"{decoder}.rank{rank}.{k}"


@dataclass
class _Proj:
    """A projection ``x @ W (+ b)``: a MatMul or Gemm with a constant 2-D weight, and its constant bias."""

    node: ir.Node
    weight: ir.Value
    out_axis: int  # the weight's output-feature axis (1 for MatMul, 0 for a Gemm with transB)
    bias: ir.Value | None = None  # the 1-D constant added to the output
    bias_add: ir.Node | None = None  # the Add holding it (None when it is the Gemm's C)

    @property
    def width(self) -> int:
        return int(self.weight.shape[self.out_axis])

    @property
    def fan_in(self) -> int:
        return int(self.weight.shape[1 - self.out_axis])


@dataclass
class _Column:
    proj: _Proj
    role: str  # "q", "kv" (k or v: reaches a present output) or "mlp"


@dataclass
class _Cut:
    """One row-parallel projection: the residual Add it feeds, and the column projections before it."""

    index: int
    kind: str  # "attention" | "mlp"
    layer: int
    add: ir.Node
    residual: ir.Value
    row: _Proj  # the row-parallel projection
    partial: ir.Value  # its output as the all-reduce takes it (this rank's share of the sum)
    columns: list[_Column] = field(default_factory=list)
    presents: list[str] = field(default_factory=list)


@dataclass
class _Layout:
    size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    kv_mode: str  # "split" | "replicated"

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.size

    @property
    def kv_per_rank(self) -> int:
        return self.kv_heads // self.size if self.kv_mode == "split" else 1

    @property
    def n_rep(self) -> int:
        return self.heads // self.kv_heads

    def q_heads(self, rank: int) -> range:
        return range(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)

    def kv_of_rank(self, rank: int) -> list[int]:
        if self.kv_mode == "split":
            return list(range(rank * self.kv_per_rank, (rank + 1) * self.kv_per_rank))
        # Replicated: every query head of the rank shares one KV head (h // n_rep, as repeat_kv maps them).
        return [self.q_heads(rank).start // self.n_rep]


@register
class TensorParallel(Pass):
    """Shard the decoder over ``size`` ranks; each rank's decoder becomes segments cut at the all-reduces."""

    name = "tensor_parallel"
    summary = (
        "tensor parallelism (Megatron split): q/k/v, gate/up column-parallel, o/down row-parallel; each "
        "rank's decoder is 2*layers+1 segment graphs with the host's all-reduce between them (plan in the manifest)"
    )
    requires = ("unmerged",)
    options = (
        Option(
            "size",
            int,
            None,
            "number of ranks (cards); must divide the attention heads and the MLP width",
            choices=SIZES,
            required=True,
        ),
    )

    def check_package(self, package: Package) -> tuple[str, _Layout]:
        m = package.manifest
        n = self.opts["size"]
        if m.get("tensor_parallel"):
            raise VlmcError(
                f"tensor_parallel: the package is already split over {m['tensor_parallel']['size']} ranks"
            )
        if m["kv"].get("layout") == "paged":
            raise VlmcError(
                "tensor_parallel: the KV layout is already paged; run tensor_parallel before paged_kv "
                "(paged_kv then gives each rank's pools its share of the KV heads)"
            )
        chain = m["pipeline"].get("decoder", [])
        if len(chain) != 1:
            raise VlmcError(
                f"tensor_parallel: the decoder is split into {len(chain)} layer ranges ({', '.join(chain)}); "
                "tensor parallelism shards every layer across the ranks, so run it on the unsplit package"
            )
        dec = chain[0]
        info = package.info(dec)
        if info.get("quantization") or info.get("precision") not in ("fp32", "fp16"):
            raise VlmcError(
                f"tensor_parallel: graph {dec!r} is already quantized ({info.get('precision')}); run "
                "tensor_parallel before quantize, so each rank's weights get their own scales and groups"
            )
        model = package.model(dec).clone()  # finding the layers may rewrite an OPT-style flattened Add
        cuts = _find_cuts(model.graph, dec, int(m["kv"]["layers"]))
        layout = _layout(cuts, m, n, dec)
        return dec, layout

    def run(self, package: Package, plan: tuple[str, _Layout] | None = None) -> PassResult:
        dec, layout = plan if plan is not None else self.check_package(package)
        source = package.model(dec)
        info = package.info(dec)
        precision = info["precision"]
        names: list[list[str]] = []
        kinds: list[tuple[str, int]] = []
        weight_bytes: dict[str, int] = {}
        for rank in range(layout.size):
            model = source.clone()
            cuts = _find_cuts(model.graph, dec, layout.layers)
            _shard(model.graph, cuts, layout, rank, dec)
            segs = _segments(model, cuts, dec, layout.kv_per_rank)
            row = []
            for k, seg in enumerate(segs):
                name = segment_name(dec, rank, k)
                seg.graph.name = name
                package.set_graph(name, seg, role="decoder", precision=precision, rank=rank, segment=k)
                weight_bytes[name] = _weight_bytes(seg)
                row.append(name)
            names.append(row)
            kinds = [(c.kind, c.layer) for c in cuts]
        package.remove_graph(dec)
        package.files.pop(f"samples/{dec}.npz", None)
        package.manifest["pipeline"]["decoder"] = names[0]
        steps: list[dict] = []
        for k in range(len(names[0])):
            kind, layer = kinds[k] if k < len(kinds) else ("head", layout.layers - 1)
            steps.append(
                {"step": "segment", "index": k, "kind": kind, "layer": layer, "graphs": [r[k] for r in names]}
            )
            if k < len(kinds):
                steps.append(
                    {
                        "step": "all_reduce",
                        "op": "sum",
                        "input": PARTIAL.format(k),
                        "output": REDUCED.format(k),
                        "after": "attention output projection"
                        if kind == "attention"
                        else "MLP down projection",
                    }
                )
        package.manifest["tensor_parallel"] = {
            "size": layout.size,
            "heads": layout.heads,
            "heads_per_rank": layout.heads_per_rank,
            "kv_heads": layout.kv_heads,
            "kv_heads_per_rank": layout.kv_per_rank,
            "kv": layout.kv_mode,
            "kv_heads_of_rank": [layout.kv_of_rank(r) for r in range(layout.size)],
            "intermediate_per_rank": layout.intermediate // layout.size,
            "replicated": ["embed", "vision", "final norm and lm_head (last segment)"],
            "source_graph": dec,
            "collective": {
                "op": "all_reduce",
                "reduce": "sum",
                "cpu": "torch.distributed gloo",
                "ascend": "HcclAllReduce",
            },
            "plan": steps,
        }
        per_rank = [sum(weight_bytes[n] for n in row) for row in names]
        return PassResult(
            package,
            True,
            {
                "size": layout.size,
                "kv": layout.kv_mode,
                "segments_per_rank": len(names[0]),
                "all_reduces_per_step": len(kinds),
                "weight_bytes_per_rank": per_rank,
            },
        )


# ---- finding the layers -------------------------------------------------------------------------------
def _const_weight(v: ir.Value | None, ndim: int) -> bool:
    return v is not None and v.const_value is not None and v.is_initializer() and len(v.shape or ()) == ndim


def _as_projection(node: ir.Node | None) -> _Proj | None:
    """``node`` as a projection: a MatMul by a constant 2-D weight (with the bias Add after it, if any) or
    a Gemm (its C is the bias); else None."""
    if node is None:
        return None
    if node.op_type == "MatMul" and _const_weight(node.inputs[1], 2):
        proj = _Proj(node, node.inputs[1], 1)
        users = node.outputs[0].uses()
        if len(users) == 1 and users[0][0].op_type == "Add":
            add = users[0][0]
            consts = [i for i in add.inputs if _const_weight(i, 1)]
            if len(consts) == 1 and int(consts[0].shape[0]) == proj.width:
                proj.bias, proj.bias_add = consts[0], add
        return proj
    if node.op_type == "Gemm" and _const_weight(node.inputs[1], 2):
        attrs = {name: a.value for name, a in node.attributes.items()}
        if attrs.get("transA", 0):
            return None
        proj = _Proj(node, node.inputs[1], 0 if attrs.get("transB", 0) else 1)
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if c is not None:
            if not _const_weight(c, 1) or int(c.shape[0]) != proj.width:
                return None
            proj.bias = c
        return proj
    return None


# What may sit between a row-parallel projection and its residual Add: its bias, a post-norm (Gemma3's
# post_attention_layernorm, GLM-4's post_self_attn_layernorm: RMSNorm or LayerNorm, as primitive ops or
# one normalization op), casts and reshapes. Each of these ops sees the whole hidden state, so the
# all-reduce comes before them.
_TO_RESIDUAL = frozenset(
    {
        "Add",
        "Cast",
        "Constant",
        "Div",
        "Identity",
        "LayerNormalization",
        "Mul",
        "Pow",
        "Reciprocal",
        "ReduceMean",
        "Reshape",
        "RMSNormalization",
        "SimplifiedLayerNormalization",
        "Sqrt",
        "Sub",
    }
)


def _row_projection(v: ir.Value) -> _Proj | None:
    """The one projection whose output reaches ``v`` through only :data:`_TO_RESIDUAL` ops, else None."""
    found: set[ir.Node] = set()
    seen: set[ir.Node] = set()
    todo = [v]
    while todo:
        x = todo.pop()
        node = x.producer()
        if node is None:
            if x.const_value is None:
                return None  # a graph input: not a projection's output
            continue
        if node in seen:
            continue
        seen.add(node)
        proj = _as_projection(node)
        if proj is not None:
            found.add(node)
            continue
        if node.op_type not in _TO_RESIDUAL:
            return None
        # A Reshape's target shape is not data; the other ops' constant operands are weights.
        data = node.inputs[:1] if node.op_type == "Reshape" else node.inputs
        todo += [i for i in data if i is not None and i.const_value is None]
    if len(found) != 1:
        return None
    return _as_projection(found.pop())


def _partial(proj: _Proj) -> ir.Value:
    """The row projection's output as the ranks' partial sums: past reshapes only (linear, so they commute
    with the sum), never past the bias (added once, after the all-reduce) or a norm."""
    v = proj.node.outputs[0]
    while True:
        users = v.uses()
        if len(users) == 1 and users[0][0].op_type == "Reshape" and users[0][1] == 0:
            v = users[0][0].outputs[0]
        else:
            return v


def _through_casts(v: ir.Value) -> list[ir.Value]:
    out, todo = [], [v]
    while todo:
        x = todo.pop()
        out.append(x)
        todo += [u.outputs[0] for u, _ in x.uses() if u.op_type in ("Cast", "Identity")]
    return out


def _backward(values: list[ir.Value], stop: set[ir.Value], through_shape: bool = True) -> set[ir.Node]:
    """Nodes the values depend on, not looking past ``stop`` (nor past Shape nodes unless ``through_shape``)."""
    seen: set[ir.Node] = set()
    todo = [v for v in values if v not in stop]
    while todo:
        node = todo.pop().producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.op_type == "Shape" and not through_shape:
            continue
        todo += [i for i in node.inputs if i is not None and i not in stop]
    return seen


def _forward(values: list[ir.Value]) -> set[ir.Node]:
    seen: set[ir.Node] = set()
    todo = list(values)
    while todo:
        for user, _ in todo.pop().uses():
            if user not in seen:
                seen.add(user)
                todo += list(user.outputs)
    return seen


def _reads(v: ir.Value, stream: set[ir.Value]) -> bool:
    """Whether ``v`` depends on a residual-stream value other than through its shape."""
    nodes = _backward([v], set(), through_shape=False)
    return any(n.op_type != "Shape" and any(i in stream for i in n.inputs) for n in nodes) or v in stream


def _unflatten(graph: ir.Graph, cur: ir.Value) -> bool:
    """Rewrite a residual Add done on the flattened stream into one on the stream itself.

    OPT's decoder layer (BLIP-2's language model) flattens the hidden state to ``[tokens, hidden]`` for
    its MLP and adds the residual there, then views the sum back (transformers ``OPTDecoderLayer``:
    ``hidden_states.reshape(-1, hidden)``, ``(residual + hidden_states).view(shape)``). The segments pass
    ``[batch, sequence, hidden]`` tensors, so the MLP's output is viewed as the stream before the Add and
    the Add takes the stream; the Add is elementwise, so the sum is the same. Returns whether it applied.
    """
    for v in _through_casts(cur):
        for flat_node, i in v.uses():
            if flat_node.op_type != "Reshape" or i != 0:
                continue
            flat = flat_node.outputs[0]
            for add, j in flat.uses():
                if add.op_type != "Add" or len(add.inputs) != 2 or _row_projection(add.inputs[1 - j]) is None:
                    continue
                back = add.outputs[0].uses()
                if len(back) != 1 or back[0][0].op_type != "Reshape" or back[0][1] != 0:
                    continue
                view = back[0][0]
                shapes = [n for n in _backward([view.inputs[1]], set(), through_shape=False)]
                if any(
                    n.op_type == "Shape" and n.inputs[0] not in _through_casts(cur) for n in shapes
                ) or any(
                    i is not None and i.producer() is None and i.const_value is None
                    for n in shapes
                    for i in n.inputs
                ):
                    continue  # the view back is not to the stream's own shape
                shape = ir.node("Shape", [v], name=f"{add.name}/tp_stream_shape")
                viewed = ir.node("Reshape", [add.inputs[1 - j], shape.outputs[0]], name=f"{add.name}/tp_view")
                summed = ir.node("Add", [v, viewed.outputs[0]], name=f"{add.name}/tp_stream_add")
                graph.insert_after(add, [shape, viewed, summed])
                for node in (shape, viewed, summed):
                    node.outputs[0].name = f"{node.name}_output_0"
                if v.dtype is not None:
                    summed.outputs[0].dtype = viewed.outputs[0].dtype = v.dtype
                view.outputs[0].replace_all_uses_with(summed.outputs[0])
                # The flattened Add and its view are dead now; removed, so the projection has one use.
                graph.remove([view, add], safe=True)
                return True
    return False


def _find_cuts(graph: ir.Graph, dec: str, layers: int) -> list[_Cut]:
    """The 2*layers residual projections in order, with the column projections each one's block holds.

    The residual stream is followed from ``inputs_embeds`` through its Adds. An Add whose other operand
    is a projection's output (through its bias, a post-norm, casts, reshapes) ends a block; an Add of
    something that does not read the stream (BLIP-2's learned positions, Qwen3-VL's deepstack visual
    rows) is part of the replicated stream and followed through.
    """
    inputs = {v.name: v for v in graph.inputs}
    if "inputs_embeds" not in inputs:
        raise VlmcError(f"tensor_parallel: graph {dec!r} has no inputs_embeds input")
    outputs = {v.name: v for v in graph.outputs}
    cur = inputs["inputs_embeds"]
    stream: set[ir.Value] = set()
    cuts: list[_Cut] = []
    attention = 0
    while True:
        stream |= set(_through_casts(cur))
        found, passed = [], []
        for v in _through_casts(cur):
            for user, idx in v.uses():
                if user.op_type != "Add" or len(user.inputs) != 2 or user.inputs[1 - idx] is v:
                    continue
                other = user.inputs[1 - idx]
                proj = _row_projection(other)
                if proj is not None and _reads(proj.node.inputs[0], stream):
                    found.append((user, v, proj))
                elif not _reads(other, stream):
                    passed.append(user)
        if not found and not passed:
            if _unflatten(graph, cur):
                continue
            break
        if len(found) > 1 or (not found and len(passed) > 1):
            raise VlmcError(
                f"tensor_parallel: graph {dec!r}: the residual stream after projection {len(cuts)} feeds "
                f"{len(found) or len(passed)} Adds; the decoder does not have the standard layer structure"
            )
        if not found:
            cur = passed[0].outputs[0]  # replicated: every rank adds the same rows to its whole stream
            continue
        add, residual, row = found[0]
        block = _backward([row.node.inputs[0]], set()) & _forward([residual])
        columns: list[_Column] = []
        presents: set[str] | list[str] = set()
        for node in graph:
            proj = _as_projection(node) if node in block else None
            if proj is None:
                continue
            # Within the block only: everything later in the decoder depends on every projection.
            reach = _forward([node.outputs[0]]) & block
            reached = {
                o.name
                for o in outputs.values()
                if o.name.startswith(PRESENT_PREFIX) and o.producer() in reach
            }
            columns.append(_Column(proj, "kv" if reached else "q"))
            presents |= reached
        presents = sorted(presents)
        kind = "attention" if any(c.role == "kv" for c in columns) else "mlp"
        if kind == "mlp":
            for c in columns:
                c.role = "mlp"
        layer = attention - 1 if kind == "mlp" else attention
        if kind == "attention":
            attention += 1
        cuts.append(_Cut(len(cuts), kind, layer, add, residual, row, _partial(row), columns, presents))
        cur = add.outputs[0]
    kinds = [c.kind for c in cuts]
    if len(cuts) != 2 * layers or kinds != ["attention", "mlp"] * layers:
        raise VlmcError(
            f"tensor_parallel: graph {dec!r}: found {len(cuts)} residual projections ({', '.join(kinds) or 'none'}), "
            f"expected attention and MLP for each of the {layers} layers; the decoder does not have the "
            "pre-norm or post-norm transformer layer structure tensor_parallel supports"
        )
    return cuts


def _layout(cuts: list[_Cut], m: dict, n: int, dec: str) -> _Layout:
    kv, hd = int(m["kv"]["kv_heads"]), int(m["kv"]["head_dim"])
    att = cuts[0]
    q = [c for c in att.columns if c.role == "q"]
    kvc = [c for c in att.columns if c.role == "kv"]
    if len(q) != 1 or len(kvc) != 2:
        raise VlmcError(
            f"tensor_parallel: graph {dec!r}: layer 0's attention has {len(q)} query and {len(kvc)} key/value "
            "projections, expected 1 and 2 (a fused qkv projection is not supported)"
        )
    heads = q[0].proj.width // hd
    for c in kvc:
        if c.proj.width != kv * hd:
            raise VlmcError(
                f"tensor_parallel: graph {dec!r}: a key/value projection is {c.proj.width} wide, "
                f"not kv_heads*head_dim = {kv * hd}"
            )
    mlp = cuts[1]
    inter = mlp.row.fan_in
    for c in mlp.columns:
        # gate and up fused into one projection (GLM-4's gate_up_proj, chunked in two): each rank takes
        # its slice of every part, so its chunks are its gate and its up slices.
        if c.proj.width % inter:
            raise VlmcError(
                f"tensor_parallel: graph {dec!r}: an MLP projection is {c.proj.width} wide, not a multiple "
                f"of the down projection's {inter} inputs"
            )
    if not mlp.columns:
        raise VlmcError(
            f"tensor_parallel: graph {dec!r}: the MLP has no projections before its down projection"
        )
    if heads % n:
        raise VlmcError(
            f"tensor_parallel: size {n} does not divide the {heads} attention heads; use one of "
            f"{', '.join(str(s) for s in SIZES if heads % s == 0) or 'none'}"
        )
    if inter % n:
        raise VlmcError(f"tensor_parallel: size {n} does not divide the MLP width {inter}")
    if kv % n == 0:
        mode = "split"
    elif n % kv == 0:
        mode = "replicated"
    else:
        raise VlmcError(
            f"tensor_parallel: size {n} neither divides nor is a multiple of the {kv} KV heads "
            f"({heads} attention heads)"
        )
    return _Layout(n, len(cuts) // 2, heads, kv, hd, inter, mode)


# ---- sharding ---------------------------------------------------------------------------------------
def _sliced(value: ir.Value, axis: int, index: np.ndarray) -> None:
    """Replace a constant's content with its entries ``index`` along ``axis``, read only when needed."""
    src = value.const_value
    shape = list(src.shape)
    shape[axis] = len(index)

    def make() -> ir.Tensor:
        # Only the rank's slice is materialized (the source stays memory-mapped), one tensor at a time.
        return ir.Tensor(np.ascontiguousarray(np.take(src.numpy(), index, axis=axis)))

    value.const_value = ir.LazyTensor(make, dtype=src.dtype, shape=ir.Shape(shape), name=value.name)
    value.shape = ir.Shape(shape)


def _head_cols(heads: list[int], hd: int) -> np.ndarray:
    return np.concatenate([np.arange(h * hd, (h + 1) * hd) for h in heads])


def _shard(graph: ir.Graph, cuts: list[_Cut], lay: _Layout, rank: int, dec: str) -> None:
    q_idx = _head_cols(list(lay.q_heads(rank)), lay.head_dim)
    kv_idx = _head_cols(lay.kv_of_rank(rank), lay.head_dim)
    seen: set[ir.Value] = set()
    visited: dict[ir.Node, bool] = {}  # target-shape Concats already rewritten (simplify may share them)
    widths: dict[tuple[ir.Node, int], ir.Value] = {}  # (target-shape Concat, rank's width) -> its copy
    for cut in cuts:
        inner = cut.row.fan_in  # this block's width (heads*head_dim or the MLP's intermediate size)
        w = inner // lay.size
        mlp_idx = np.arange(rank * w, (rank + 1) * w)
        for c in cut.columns:
            idx = {"q": q_idx, "kv": kv_idx, "mlp": mlp_idx}[c.role]
            if c.role == "mlp" and c.proj.width > inner:  # a fused projection's parts, each sliced alike
                _set_chunks(graph, c.proj, c.proj.width, lay.size)
                idx = np.concatenate([part * inner + idx for part in range(c.proj.width // inner)])
            targets = [(c.proj.node, c.proj.weight, c.proj.out_axis)]
            if c.proj.bias is not None:
                targets.append((c.proj.bias_add or c.proj.node, c.proj.bias, 0))
            full = c.proj.width
            for node, v, axis in targets:
                _sliced(_own(graph, node, v, seen), axis, idx)
            for view in _views_of(c.proj):
                _set_view_width(graph, view, full, len(idx), widths)
        row = cut.row
        weight = _own(graph, row.node, row.weight, seen)
        _sliced(weight, 1 - row.out_axis, q_idx if cut.kind == "attention" else mlp_idx)
        flat = row.node.inputs[0].producer()
        if flat is not None and flat.op_type == "Reshape":
            _set_view_width(graph, flat, inner, w, widths)
        if row.bias is not None and row.bias_add is None and rank > 0:
            # A Gemm's bias is inside the partial sum: rank 0 alone adds it, so the sum holds it once.
            _zeroed(_own(graph, row.node, row.bias, seen))
        if cut.kind == "attention":
            folded = _set_head_counts(graph, cut, lay, visited)
            if lay.kv_mode == "replicated":
                _set_repeat(graph, cut, lay, dec, folded)


def _views_of(proj: _Proj) -> list[ir.Node]:
    """The Reshapes that view a column projection's output (after its bias, through casts) back."""
    out = proj.bias_add.outputs[0] if proj.bias_add is not None else proj.node.outputs[0]
    return [u for v in _through_casts(out) for u, i in v.uses() if u.op_type == "Reshape" and i == 0]


def _set_view_width(
    graph: ir.Graph, view: ir.Node, full: int, width: int, widths: dict[tuple[ir.Node, int], ir.Value]
) -> None:
    """A Reshape's target shape whose last entry is the constant ``full`` (a sharded projection's feature
    width in the whole model), made the rank's ``width``.

    onnxsim fuses a 3-D ``MatMul`` + bias ``Add`` into ``Reshape [-1, in] -> Gemm -> Reshape`` back to
    ``Concat(Shape(x)[:-1], [out])`` (Qwen-VL's q/k/v with their c_attn biases), and a Gemm row projection
    flattens its input to ``[-1, in]`` the same way: those widths are constants of the whole model and the
    rank's weights are narrower. A target shape that is a constant gets a constant of its own; a Concat
    (which simplify may share between q, k and v of different widths) gets one copy per width
    (``widths``), so each Reshape reads the width its own projection has. Head reshapes (a head_dim last)
    are :func:`_rewrite_heads`'.
    """
    if full == width:
        return
    shape = view.inputs[1]
    c = _int_const(shape)
    if c is not None:
        if c.ndim == 1 and c.size and int(c[-1]) == full:
            new = c.copy()
            new[-1] = width
            value = ir.Value(name=f"{view.name}/tp_width", const_value=ir.Tensor(new))
            value.shape, value.dtype = ir.Shape(new.shape), ir.DataType.from_numpy(new.dtype)
            graph.register_initializer(value)
            view.replace_input_with(1, value)
        return
    concat = shape.producer()
    if concat is None or concat.op_type != "Concat" or not concat.inputs:
        return
    last = _int_const(concat.inputs[-1])
    if last is None or last.size != 1 or int(last.reshape(-1)[0]) != full:
        return
    key = (concat, width)
    if key not in widths:
        c = np.full_like(last, width)
        value = ir.Value(name=f"{concat.name}/tp_width_{width}", const_value=ir.Tensor(c))
        value.shape, value.dtype = ir.Shape(c.shape), ir.DataType.from_numpy(c.dtype)
        graph.register_initializer(value)
        axis = int(concat.attributes["axis"].value)
        copy = ir.node(
            "Concat", [*concat.inputs[:-1], value], {"axis": axis}, name=f"{concat.name}/tp_width_{width}"
        )
        copy.outputs[0].name = f"{copy.name}_output_0"
        copy.outputs[0].dtype = shape.dtype
        graph.insert_after(concat, [copy])
        widths[key] = copy.outputs[0]
    view.replace_input_with(1, widths[key])


def _set_chunks(graph: ir.Graph, proj: _Proj, width: int, size: int) -> None:
    """The chunks of a fused projection's output, made the rank's: a Slice's or Split's constant bounds
    (what fold_constants leaves of ``torch.chunk``) divided by ``size``. Bounds computed from the output's
    shape shrink with the sharded weight by themselves."""
    out = proj.bias_add.outputs[0] if proj.bias_add is not None else proj.node.outputs[0]
    for user, i in out.uses():
        if i != 0 or user.op_type not in ("Slice", "Split"):
            continue
        last = {-1, len(out.shape) - 1} if out.shape is not None else {-1, 2}
        if user.op_type == "Slice":
            axes = _int_const(user.inputs[3]) if len(user.inputs) > 3 else None
            along = axes is not None and set(axes.reshape(-1).tolist()) <= last
        else:
            along = int(user.attributes["axis"].value if "axis" in user.attributes else 0) in last
        if not along:
            continue  # not a chunk of the features
        slots = (1, 2) if user.op_type == "Slice" else (1,)
        for slot in slots:
            c = _int_const(user.inputs[slot]) if slot < len(user.inputs) else None
            if c is None:
                continue
            # Ends past the width (INT64_MAX, "to the end") stay; the bounds are multiples of size.
            new = np.where(np.abs(c) <= width, c // size, c).astype(c.dtype)
            value = ir.Value(name=f"{user.name}/tp_chunk_{slot}", const_value=ir.Tensor(new))
            value.shape, value.dtype = ir.Shape(new.shape), ir.DataType.from_numpy(new.dtype)
            graph.register_initializer(value)
            user.replace_input_with(slot, value)


def _own(graph: ir.Graph, node: ir.Node, value: ir.Value, seen: set[ir.Value]) -> ir.Value:
    """``value`` as ``node``'s own constant, to be sliced for this rank. simplify gives equal constants one
    initializer (OPT's zero-initialized biases, a tied weight); a shared one is copied for ``node`` (the
    copy reads the same memory-mapped source), so slicing it leaves the other users whole."""
    if value not in seen and len(value.uses()) == 1:
        seen.add(value)
        return value
    own = ir.Value(name=f"{value.name}/tp_{len(seen)}", const_value=value.const_value)
    own.shape, own.dtype = value.shape, value.dtype
    graph.register_initializer(own)
    for i, inp in enumerate(node.inputs):
        if inp is value:
            node.replace_input_with(i, own)
    seen.add(own)
    return own


def _zeroed(value: ir.Value) -> None:
    src = value.const_value
    value.const_value = ir.Tensor(np.zeros(tuple(src.shape), dtype=src.dtype.numpy()), name=value.name)


def _int_const(v: ir.Value | None) -> np.ndarray | None:
    if v is None:
        return None
    t = ir.convenience.get_const_tensor(v)
    return None if t is None else np.asarray(t.numpy())


def _shape_concats(node: ir.Node) -> set[ir.Node]:
    """The Concats that build a Reshape's or Expand's target shape."""
    return {n for n in _backward([node.inputs[1]], set(), through_shape=False) if n.op_type == "Concat"}


def _replace_const(graph: ir.Graph, node: ir.Node, i: int, c: np.ndarray, value: int) -> None:
    new = ir.Value(name=f"{node.name}/tp_heads_{i}", const_value=ir.Tensor(np.full_like(c, value)))
    new.shape, new.dtype = ir.Shape(c.shape), ir.DataType.from_numpy(c.dtype)
    graph.register_initializer(new)
    node.replace_input_with(i, new)


def _set_head_counts(graph: ir.Graph, cut: _Cut, lay: _Layout, visited: dict[ir.Node, bool]) -> set[ir.Node]:
    """Head counts an earlier pass folded into the attention's target shapes, made the rank's own.

    The export computes them from the projections' shapes (Shape -> Gather), which shard by themselves;
    fold_constants/simplify replace that with the model's constants: ``[b, kv, n_rep, s, d]`` for
    repeat_kv's Expand and ``[b, heads, s, d]`` / ``[b, s, heads, d]`` for the head reshapes. Those are
    rewritten to the rank's heads (and KV heads), each Concat once (``visited``: Concat -> whether it
    held the query heads; simplify may share one Concat between layers). Returns the nodes whose target
    shape had its query-head count rewritten.
    """
    outs = [c.proj.node.outputs[0] for c in cut.columns]
    block = _forward(outs) & _backward([cut.row.node.inputs[0]], set())
    done: set[ir.Node] = set()
    for node in (n for n in block if n.op_type in ("Reshape", "Expand")):
        for concat in _shape_concats(node):
            if concat not in visited:
                visited[concat] = _rewrite_heads(graph, concat, node.op_type, lay)
            if visited[concat]:
                done.add(node)
    return done


def _rewrite_heads(graph: ir.Graph, concat: ir.Node, op_type: str, lay: _Layout) -> bool:
    consts = [_int_const(i) for i in concat.inputs]
    scalar = [
        int(c.reshape(-1)[0]) if c is not None and c.size == 1 and c.dtype.kind == "i" else None
        for c in consts
    ]
    if len(scalar) == 5 and op_type == "Expand" and scalar[1] == lay.kv_heads != lay.kv_per_rank:
        _replace_const(graph, concat, 1, consts[1], lay.kv_per_rank)
    if len(scalar) != 4 or scalar[3] != lay.head_dim:
        return False
    heads = False
    for i in (1, 2):
        if scalar[i] == lay.heads != lay.heads_per_rank:
            _replace_const(graph, concat, i, consts[i], lay.heads_per_rank)
            heads = True
        elif scalar[i] == lay.kv_heads != lay.kv_per_rank:
            _replace_const(graph, concat, i, consts[i], lay.kv_per_rank)
    return heads


def _set_repeat(graph: ir.Graph, cut: _Cut, lay: _Layout, dec: str, folded: set[ir.Node]) -> None:
    """Where the rank holds one KV head for fewer query heads than n_rep, repeat_kv must repeat it
    heads_per_rank times: rewrite the n_rep constant in each Expand's target shape and in the head count
    of the Reshape after it (transformers' ``repeat_kv``: expand to [b, kv, n_rep, s, d], reshape to
    [b, kv*n_rep, s, d]). A Reshape in ``folded`` already had its folded head count rewritten
    (_set_head_counts)."""
    kv_outs = [c.proj.node.outputs[0] for c in cut.columns if c.role == "kv"]
    block = _forward(kv_outs) & _backward([cut.row.node.inputs[0]], set())
    expands = [n for n in block if n.op_type == "Expand"]
    changed = 0
    for e in expands:
        targets = []
        shape_nodes = _backward([e.inputs[1]], set(), through_shape=False)
        reshapes = [u for u, i in e.outputs[0].uses() if u.op_type == "Reshape" and i == 0]
        for r in reshapes:
            if r in folded:
                targets.append(None)
                continue
            shape_nodes |= _backward([r.inputs[1]], set(), through_shape=False)
        for node in shape_nodes:
            if node.op_type == "Concat" and len(node.inputs) == 5:
                c = _int_const(node.inputs[2])
                if c is not None and c.size == 1 and int(c.reshape(-1)[0]) == lay.n_rep:
                    targets.append((node, 2, c))
            elif node.op_type == "Mul":
                for i, inp in enumerate(node.inputs):
                    c = _int_const(inp)
                    if (
                        c is not None
                        and c.size == 1
                        and int(c.reshape(-1)[0]) == lay.n_rep
                        and c.dtype.kind == "i"
                    ):
                        targets.append((node, i, c))
        if len(targets) != 2:
            raise VlmcError(
                f"tensor_parallel: graph {dec!r}: size {lay.size} exceeds the {lay.kv_heads} KV heads, which "
                "needs the repeat_kv structure rewritten, and it was not recognized; use a size that divides "
                "the KV heads"
            )
        for target in targets:
            if target is not None:
                _replace_const(graph, *target, lay.heads_per_rank)
            changed += 1
    if not changed:
        raise VlmcError(
            f"tensor_parallel: graph {dec!r}: found no repeat_kv in layer {cut.layer}; cannot replicate KV heads"
        )


# ---- segments ---------------------------------------------------------------------------------------
def _only_shape_used(v: ir.Value) -> bool:
    for user, _ in v.uses():
        if user.op_type == "Shape":
            continue
        if user.op_type in ("Concat", "Identity") and len(user.inputs) == 1:
            if _only_shape_used(user.outputs[0]):
                continue
        return False
    return True


def _segments(model: ir.Model, cuts: list[_Cut], dec: str, kv_per_rank: int) -> list[ir.Model]:
    g = model.graph
    ins = {v.name: v for v in g.inputs}
    embeds = ins["inputs_embeds"]
    shared = [v for n, v in ins.items() if not n.startswith("past_key_values.") and n != "inputs_embeds"]
    outs = list(g.outputs)
    for cut in cuts:  # the tensors passed between segments have the residual stream's type
        for v in (cut.partial, cut.residual):
            # The residual stream is [batch, sequence, hidden] like inputs_embeds, whatever an earlier
            # pass's shape inference recorded (fold_constants/simplify leave unk__N dims there, which
            # become segment inputs no backend can size).
            v.shape = ir.Shape(embeds.shape)
            if v.dtype is None:
                v.dtype = embeds.dtype
    segs = []
    for k in range(len(cuts) + 1):
        if k == 0:
            bounds = []
        else:
            prev = cuts[k - 1]
            bounds = [prev.residual, prev.partial]
        if k < len(cuts):
            cut = cuts[k]
            targets = [cut.partial, cut.residual] + [o for o in outs if o.name in cut.presents]
        else:
            claimed = {p for c in cuts for p in c.presents}
            targets = [o for o in outs if o.name not in claimed]
        own_past: list[ir.Value] = []
        if k < len(cuts) and cuts[k].kind == "attention":
            own_past = [ins[n] for x in ("key", "value") if (n := PAST.format(cuts[k].layer, x)) in ins]
        stop = set(bounds) | set(ins.values())
        reached = _backward(targets, stop)
        used = {i for n in reached for i in n.inputs if i is not None}
        used |= set(targets) & set(ins.values())
        own = ([embeds] if k == 0 else []) + [v for v in shared if v in used] + own_past
        seg_in = list(bounds) + [v for v in g.inputs if v in own]
        foreign = [v for v in g.inputs if v in used and v not in seg_in]
        where = f"tensor_parallel: {dec} segment {k}"
        try:
            sub = ir.convenience.extract(g, inputs=seg_in + foreign, outputs=targets)
        except ValueError as exc:
            raise VlmcError(f"{where}: the segment is not bounded by its inputs ({exc})") from None
        by = {v.name: v for v in sub.inputs}
        for f in foreign:
            fv = by[f.name]
            if f.name == "inputs_embeds" and k > 0:
                target = by[cuts[k - 1].residual.name]
            elif f.name.startswith("past_key_values.") and own_past:
                kind = f.name.rsplit(".", 1)[1]
                target = by[PAST.format(cuts[k].layer, kind)]
            else:
                target = None
            if target is None or not _only_shape_used(fv):
                raise VlmcError(
                    f"{where}: the segment needs the values of {f.name!r}, which belongs to another segment"
                )
            fv.replace_all_uses_with(target)
            sub.inputs.remove(fv)
        _name_boundaries(sub, cuts, k)
        _fix_shapes(sub, kv_per_rank)
        segs.append(ir.Model(sub, ir_version=model.ir_version, producer_name="vlmc"))
    return segs


def _name_boundaries(sub: ir.Graph, cuts: list[_Cut], k: int) -> None:
    if k > 0:
        prev = cuts[k - 1]
        by = {v.name: v for v in sub.inputs}
        by[prev.residual.name].name = RESIDUAL.format(k - 1)
        by[prev.partial.name].name = REDUCED.format(k - 1)
    if k < len(cuts):
        cut = cuts[k]
        names = {cut.partial.name: PARTIAL.format(k), cut.residual.name: RESIDUAL.format(k)}
        inputs = set(sub.inputs)
        for i, o in enumerate(list(sub.outputs)):
            if o.name not in names:
                continue
            new_name = names[o.name]
            if o in inputs:  # a graph input passed straight through needs a node of its own to be an output
                node = ir.node("Identity", [o], name=f"tp/identity_{k}_{i}")
                sub.append(node)
                node.outputs[0].shape, node.outputs[0].dtype = o.shape, o.dtype
                sub.outputs[i] = node.outputs[0]
                o = node.outputs[0]
            o.name = new_name


def _fix_shapes(sub: ir.Graph, kv_per_rank: int) -> None:
    """The rank's KV inputs and outputs hold its share of the heads; shapes recorded inside the graph
    for the whole model (per-head reshapes) no longer hold, so they are dropped for inference to redo."""
    io = set(sub.inputs) | set(sub.outputs)
    for v in io:
        if (
            (v.name.startswith(("past_key_values.", PRESENT_PREFIX)))
            and v.shape is not None
            and len(v.shape) == 4
        ):
            dims = list(v.shape)
            dims[1] = kv_per_rank
            v.shape = ir.Shape(dims)
    for node in sub:
        for o in node.outputs:
            if o not in io:
                o.shape = None


def _weight_bytes(model: ir.Model) -> int:
    return sum(
        int(v.const_value.nbytes) for v in model.graph.initializers.values() if v.const_value is not None
    )
