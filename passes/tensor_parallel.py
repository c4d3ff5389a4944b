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

Layers are found structurally (the residual Adds whose other operand is a MatMul with a constant weight),
never by node names; the heads count comes from the query projection's width and ``kv.head_dim``.
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
class _Column:
    node: ir.Node
    role: str  # "q", "kv" (k or v: reaches a present output) or "mlp"
    bias: ir.Node | None = None


@dataclass
class _Cut:
    """One row-parallel projection: the residual Add it feeds, and the column projections before it."""

    index: int
    kind: str  # "attention" | "mlp"
    layer: int
    add: ir.Node
    residual: ir.Value
    row: ir.Node  # the row-parallel MatMul; its output is the partial sum
    row_bias: ir.Node | None
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
        model = package.model(dec)
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


def _projection(v: ir.Value) -> tuple[ir.Node, ir.Node | None] | None:
    """The MatMul (x, W constant 2-D) producing ``v``, directly or through a bias Add; else None."""
    node = v.producer()
    bias = None
    if node is not None and node.op_type == "Add":
        consts = [i for i in node.inputs if _const_weight(i, 1)]
        if len(consts) == 1:
            other = next(i for i in node.inputs if i is not consts[0])
            bias, node = node, other.producer()
    if node is not None and node.op_type == "MatMul" and _const_weight(node.inputs[1], 2):
        return node, bias
    return None


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


def _find_cuts(graph: ir.Graph, dec: str, layers: int) -> list[_Cut]:
    """The 2*layers residual projections in order, with the column projections each one's block holds."""
    inputs = {v.name: v for v in graph.inputs}
    if "inputs_embeds" not in inputs:
        raise VlmcError(f"tensor_parallel: graph {dec!r} has no inputs_embeds input")
    outputs = {v.name: v for v in graph.outputs}
    cur = inputs["inputs_embeds"]
    cuts: list[_Cut] = []
    attention = 0
    while True:
        found = []
        for v in _through_casts(cur):
            for user, idx in v.uses():
                if user.op_type == "Add" and len(user.inputs) == 2:
                    proj = _projection(user.inputs[1 - idx])
                    if proj is not None:
                        found.append((user, v, *proj))
        if not found:
            break
        if len(found) > 1:
            raise VlmcError(
                f"tensor_parallel: graph {dec!r}: the residual stream after projection {len(cuts)} feeds "
                f"{len(found)} projection Adds; the decoder does not have the standard layer structure"
            )
        add, residual, row, row_bias = found[0]
        block = _backward([row.inputs[0]], set()) & _forward([residual])
        presents_of: dict[ir.Node, list[str]] = {}
        columns = []
        for node in graph:
            if node in block and node.op_type == "MatMul" and _const_weight(node.inputs[1], 2):
                # Within the block only: everything later in the decoder depends on every projection.
                reach = _forward([node.outputs[0]]) & block
                reached = sorted(
                    o.name
                    for o in outputs.values()
                    if o.name.startswith(PRESENT_PREFIX) and o.producer() in reach
                )
                presents_of[node] = reached
                bias = None
                users = node.outputs[0].uses()
                if len(users) == 1 and users[0][0].op_type == "Add":
                    cand = users[0][0]
                    if any(_const_weight(i, 1) for i in cand.inputs):
                        bias = cand
                columns.append(_Column(node, "kv" if reached else "q", bias))
        presents = sorted({p for ps in presents_of.values() for p in ps})
        kind = "attention" if presents else "mlp"
        if kind == "mlp":
            for c in columns:
                c.role = "mlp"
        layer = attention - 1 if kind == "mlp" else attention
        if kind == "attention":
            attention += 1
        cuts.append(_Cut(len(cuts), kind, layer, add, residual, row, row_bias, columns, presents))
        cur = add.outputs[0]
    kinds = [c.kind for c in cuts]
    if len(cuts) != 2 * layers or kinds != ["attention", "mlp"] * layers:
        raise VlmcError(
            f"tensor_parallel: graph {dec!r}: found {len(cuts)} residual projections ({', '.join(kinds) or 'none'}), "
            f"expected attention and MLP for each of the {layers} layers; the decoder does not have the "
            "Llama/Qwen2-style layer structure tensor_parallel supports (LLaVA, Qwen2-VL decoders)"
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
    heads = int(q[0].node.inputs[1].shape[1]) // hd
    for c in kvc:
        if int(c.node.inputs[1].shape[1]) != kv * hd:
            raise VlmcError(
                f"tensor_parallel: graph {dec!r}: a key/value projection is {c.node.inputs[1].shape[1]} wide, "
                f"not kv_heads*head_dim = {kv * hd}"
            )
    mlp = cuts[1]
    widths = {int(c.node.inputs[1].shape[1]) for c in mlp.columns}
    if len(widths) != 1 or not mlp.columns:
        raise VlmcError(f"tensor_parallel: graph {dec!r}: the MLP projections have widths {sorted(widths)}")
    inter = widths.pop()
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
        raise VlmcError(f"tensor_parallel: size {n} neither divides nor is a multiple of the {kv} KV heads")
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
    w = lay.intermediate // lay.size
    mlp_idx = np.arange(rank * w, (rank + 1) * w)
    seen: set[ir.Value] = set()
    visited: dict[ir.Node, bool] = {}  # target-shape Concats already rewritten (simplify may share them)
    for cut in cuts:
        for c in cut.columns:
            idx = {"q": q_idx, "kv": kv_idx, "mlp": mlp_idx}[c.role]
            for v, axis in [(c.node.inputs[1], 1)] + (
                [(next(i for i in c.bias.inputs if _const_weight(i, 1)), 0)] if c.bias is not None else []
            ):
                if v in seen or len(v.uses()) != 1:
                    raise VlmcError(
                        f"tensor_parallel: graph {dec!r}: weight {v.name!r} is shared; cannot shard it"
                    )
                seen.add(v)
                _sliced(v, axis, idx)
        _sliced(cut.row.inputs[1], 0, q_idx if cut.kind == "attention" else mlp_idx)
        if cut.kind == "attention":
            folded = _set_head_counts(graph, cut, lay, visited)
            if lay.kv_mode == "replicated":
                _set_repeat(graph, cut, lay, dec, folded)


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
    outs = [c.node.outputs[0] for c in cut.columns]
    block = _forward(outs) & _backward([cut.row.inputs[0]], set())
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
    kv_outs = [c.node.outputs[0] for c in cut.columns if c.role == "kv"]
    block = _forward(kv_outs) & _backward([cut.row.inputs[0]], set())
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
        for v in (cut.row.outputs[0], cut.residual):
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
            bounds = [prev.residual, prev.row.outputs[0]]
        if k < len(cuts):
            cut = cuts[k]
            targets = [cut.row.outputs[0], cut.residual] + [o for o in outs if o.name in cut.presents]
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
        by[prev.row.outputs[0].name].name = REDUCED.format(k - 1)
    if k < len(cuts):
        cut = cuts[k]
        names = {cut.row.outputs[0].name: PARTIAL.format(k), cut.residual.name: RESIDUAL.format(k)}
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
