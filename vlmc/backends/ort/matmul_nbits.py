"""Lower the quantize pass's weight-only INT4/INT8 MatMuls to onnxruntime's ``com.microsoft.MatMulNBits``.

The portable package dequantizes each weight with plain opset-17 ops (``Cast -> [Sub] -> Mul ->
Reshape`` before the MatMul, passes/quantize/weight_only.py), which onnxruntime runs on every call.
MatMulNBits keeps the integer weight and multiplies with it in one kernel. Its contract
(microsoft/onnxruntime docs/ContribOperators.md, "com.microsoft.MatMulNBits"):

* ``Y = A @ dequant(B)`` with ``dequant = (q - zero_point) * scale`` per block of ``block_size``
  rows of K; ``block_size`` a power of two >= 16; ``bits`` 2, 4 or 8; attributes ``K`` and ``N``.
* ``B``: uint8 ``(N, k_blocks, block_size * bits / 8)``, k_blocks = ceil(K / block_size), packed
  along K (for 4 bits the first value in the low nibble, the second in the high one).
* ``scales``: ``(N, k_blocks)``, the type of A. No ``zero_points``: the default is ``2^(bits-1)``
  (8 for 4 bits, 128 for 8 bits), which is exactly quantize's symmetric form stored as ``q + 8``.
* ``accuracy_level``: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 -- the lowest precision A may be
  computed in; 4 lets the CPU kernel quantize A to int8 per block (what onnxruntime-genai's
  builder writes for CPU), 1 keeps A in float32.

The facts the quantize pass records per MatMul (``graphs[name].quantization.weights.nodes``: the
integer weight, its scales, the group size, the storage) say what to pack; nothing is re-derived
from the float weights. A node whose recorded form does not fit MatMulNBits keeps its dequant
chain and is listed with the reason.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from vlmc import interop

logger = logging.getLogger(__name__)

DOMAIN = "com.microsoft"
OP = "MatMulNBits"
SOURCE = "microsoft/onnxruntime docs/ContribOperators.md#com.microsoft.MatMulNBits"
# The dequantization ops quantize writes before a MatMul's weight input (weight_only.py).
_DEQUANT_OPS = frozenset({"Cast", "Div", "Mul", "Sub", "Unsqueeze", "Concat", "Reshape"})
# INT8 is per output channel; MatMulNBits still wants blocks: each block repeats the channel's scale.
INT8_BLOCK = 128
MODES = ("int4_weight_only", "int8_weight_only")


def _const_chain(value: ir.Value) -> tuple[list[ir.Node], set[str]] | None:
    """The nodes computing ``value`` from initializers alone and the initializer names they read, or None."""
    nodes: list[ir.Node] = []
    leaves: set[str] = set()
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_initializer():
            leaves.add(v.name)
            continue
        producer = v.producer()
        if producer is None or producer.op_type not in _DEQUANT_OPS or producer.domain not in ("", "ai.onnx"):
            return None
        nodes.append(producer)
        stack.extend(producer.inputs)
    return nodes, leaves


def _block_for(k: int) -> int:
    """The MatMulNBits block for a per-channel INT8 weight of K rows: :data:`INT8_BLOCK`, smaller for small K."""
    b = INT8_BLOCK
    while b > 16 and b > k:
        b //= 2
    return b


def _pack(fact: dict, bits: int, q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(B uint8 (N, k_blocks, blob), scales float32 (N, k_blocks), block_size, K) of one recorded weight."""
    if bits == 4:
        g = int(fact["group_size"])
        if fact.get("storage") == "packed":
            # quantize's packing (row 2i low nibble, row 2i+1 high, each q+8) is MatMulNBits' along K.
            k, n = 2 * q.shape[0], q.shape[1]
            packed_kn = q
        else:
            k, n = q.shape
            u = (q.astype(np.int16) + 8).astype(np.uint8)
            packed_kn = u[0::2] | (u[1::2] << 4)
        b = np.ascontiguousarray(packed_kn.T).reshape(n, k // g, g // 2)
        s = np.ascontiguousarray(scale.reshape(k // g, n).T)
        return b, s.astype(np.float32), g, k
    k, n = q.shape
    block = _block_for(k)
    blocks = -(-k // block)
    u = np.full((n, blocks * block), 128, np.uint8)  # padded rows dequantize to (128 - 128) * s = 0
    u[:, :k] = (q.astype(np.int16) + 128).astype(np.uint8).T
    s = np.repeat(scale.reshape(n, 1).astype(np.float32), blocks, axis=1)
    return u.reshape(n, blocks, block), s, block, k


def _why_not(fact: dict, bits: int, node: ir.Node, leaves: set[str] | None) -> str | None:
    if node.op_type != "MatMul":
        return f"{node.op_type} (only MatMul is lowered; a Gemm keeps its dequant chain)"
    if leaves is None:
        return "its weight input is not the quantize pass's dequant chain"
    if fact.get("weight") not in leaves or fact.get("scale") not in leaves:
        return "the recorded weight or scale is not what its dequant chain reads"
    if fact.get("axis", 1) != 1:
        return f"recorded axis {fact.get('axis')} (MatMulNBits blocks run along K, axis 0 of [k, n])"
    if bits == 4:
        g = fact.get("group_size")
        if not g or g < 16 or g & (g - 1):
            return f"group size {g} is not a power of two >= 16 (MatMulNBits block_size)"
    return None


def lower(
    model: ir.Model, quantization: dict, accuracy_level: int, store: interop.TensorStore | None = None
) -> dict:
    """Replace the recorded weight-only MatMuls of ``model`` (in place) with MatMulNBits; the facts of what was done.

    Args:
        model: a clone of the package's graph (its weight tensors are shared, never written).
        quantization: the graph's ``quantization`` facts from the manifest.
        accuracy_level: MatMulNBits' ``accuracy_level`` (see the module docstring).
        store: where the packed weights go as they are made (None: kept in memory).
    """
    weights = quantization.get("weights") or {}
    bits = 4 if weights.get("dtype") == "int4" else 8
    graph = model.graph
    by_name = {n.name: n for n in graph}
    lowered: list[str] = []
    kept: dict[str, str] = {}
    block_sizes: set[int] = set()
    dead: list[ir.Node] = []
    for node_name, fact in (weights.get("nodes") or {}).items():
        node = by_name.get(node_name)
        if node is None:
            kept[node_name] = "not in the graph"
            continue
        chain = _const_chain(node.inputs[1]) if len(node.inputs) > 1 else None
        why = _why_not(fact, bits, node, chain[1] if chain else None)
        if why is not None:
            kept[node_name] = why
            continue
        inits = graph.initializers
        q = inits[fact["weight"]].const_value.numpy()
        scale = inits[fact["scale"]].const_value.numpy()
        b, s, block, k = _pack(fact, bits, q, scale)
        del q, scale
        n = int(b.shape[0])
        prefix = node_name.strip("/").replace("/", "_") or fact["weight"]
        b_val = _initializer(graph, store, b, f"{prefix}_MatMulNBits_B")
        s_val = _initializer(graph, store, s, f"{prefix}_MatMulNBits_scales")
        del b, s
        out = node.outputs[0]
        new = ir.node(
            OP,
            [node.inputs[0], b_val, s_val],
            {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": accuracy_level},
            domain=DOMAIN,
            name=node_name,
            outputs=[ir.Value(name=f"{out.name}_nbits", shape=out.shape, type=out.type)],
        )
        graph.insert_after(node, new)
        ir.convenience.replace_all_uses_with(out, new.outputs[0], replace_graph_outputs=True)
        name = out.name
        graph.remove(node, safe=True)
        new.outputs[0].name = name
        dead.extend(chain[0])
        lowered.append(node_name)
        block_sizes.add(block)
    _drop_unused(graph, dead)
    if lowered:
        model.opset_imports[DOMAIN] = 1
    return {
        "op": f"{DOMAIN}.{OP}",
        "source": SOURCE,
        "bits": bits,
        "block_size": sorted(block_sizes),
        "accuracy_level": accuracy_level,
        "zero_points": f"default 2^(bits-1) = {2 ** (bits - 1)} (symmetric, stored q + {2 ** (bits - 1)})",
        "nodes_lowered": len(lowered),
        "nodes_kept": kept,
    }


def _initializer(graph: ir.Graph, store: interop.TensorStore | None, arr: np.ndarray, name: str) -> ir.Value:
    tensor = store.put(arr, name) if store is not None else ir.tensor(np.ascontiguousarray(arr), name=name)
    v = ir.Value(name=name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    graph.register_initializer(v)
    return v


def _drop_unused(graph: ir.Graph, candidates: list[ir.Node]) -> None:
    """Remove the dequant nodes nothing reads any more (a chain shared with another user stays), then the
    initializers they alone read."""
    pending = list(candidates)
    removed = True
    while removed:
        removed = False
        for node in list(pending):
            if node.graph is not graph:
                pending.remove(node)
                continue
            if all(not o.uses() and not o.is_graph_output() for o in node.outputs):
                graph.remove(node, safe=True)
                pending.remove(node)
                removed = True
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        graph.initializers.pop(name)
