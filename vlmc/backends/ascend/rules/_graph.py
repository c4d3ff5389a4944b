"""Producer/consumer maps, constant lookups and node surgery over a GraphProto being lowered."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

logger = logging.getLogger(__name__)


class Graph:
    """A GraphProto under rewrite, with the maps the rules match against."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.g = model.graph
        self.inits = {t.name: t for t in self.g.initializer}
        self._names: set[str] = set()
        # Nodes are identified by name, never by Python identity: protobuf hands out new wrapper
        # objects after the node list is rebuilt, and ids of freed wrappers are reused. So every node
        # gets a unique name (this graph is the lowering's own copy).
        seen: set[str] = set()
        for i, n in enumerate(self.g.node):
            if not n.name or n.name in seen:
                base = n.name or f"{n.op_type}_{i}"
                name, k = base, 1
                while name in seen:
                    name, k = f"{base}_{k}", k + 1
                n.name = name
            seen.add(n.name)
        self.refresh()

    def refresh(self) -> None:
        self.by_name: dict[str, onnx.NodeProto] = {n.name: n for n in self.g.node}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        self._names = {n.name for n in self.g.node} | set(self.inits)
        for n in self.g.node:
            for o in n.output:
                self.producer[o] = n
                self._names.add(o)
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in self.g.output}

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def const(self, name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        p = self.producer.get(name)
        if p is not None and p.op_type == "Constant":
            for a in p.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
        return None

    def add_init(self, base: str, value: np.ndarray) -> str:
        name = self.unique(base)
        t = numpy_helper.from_array(np.ascontiguousarray(value), name)
        self.g.initializer.append(t)
        self.inits[name] = t
        return name

    def only_consumer(self, tensor: str) -> onnx.NodeProto | None:
        cons = self.consumers.get(tensor, [])
        if len(cons) == 1 and tensor not in self.outputs:
            return cons[0]
        return None

    def _index(self, node: onnx.NodeProto) -> int:
        return next(i for i, n in enumerate(self.g.node) if n.name == node.name)

    def insert_before(self, anchor: onnx.NodeProto, nodes: list[onnx.NodeProto]) -> None:
        idx = self._index(anchor)
        for k, n in enumerate(nodes):
            self.g.node.insert(idx + k, n)
        self.refresh()

    def replace(self, old: onnx.NodeProto, new: list[onnx.NodeProto], drop: list[onnx.NodeProto]) -> None:
        """Put ``new`` where ``old`` was and take ``drop`` out (nodes are matched by name)."""
        nodes = list(self.g.node)
        idx = self._index(old)
        dropped = {n.name for n in drop} | {old.name}
        kept = (
            [n for n in nodes[:idx] if n.name not in dropped]
            + new
            + [n for n in nodes[idx + 1 :] if n.name not in dropped]
        )
        del self.g.node[:]
        self.g.node.extend(kept)
        self.refresh()

    def dce(self) -> None:
        """Remove nodes whose outputs nobody uses, then unused initializers."""
        changed = True
        while changed:
            changed = False
            used = {i for n in self.g.node for i in n.input} | self.outputs
            keep = [n for n in self.g.node if any(o in used for o in n.output if o)]
            if len(keep) != len(self.g.node):
                del self.g.node[:]
                self.g.node.extend(keep)
                changed = True
        used = {i for n in self.g.node for i in n.input} | self.outputs
        dead = [t for t in self.g.initializer if t.name not in used]
        for t in dead:
            self.g.initializer.remove(t)
            self.inits.pop(t.name, None)
        self.refresh()

    def const_subgraph(self, tensor: str) -> tuple[list[onnx.NodeProto], list[str]] | None:
        """The nodes computing ``tensor`` from constants only (topological), and the initializers they read."""
        nodes: list[onnx.NodeProto] = []
        leaves: list[str] = []
        stack, seen = [tensor], set()
        while stack:
            t = stack.pop()
            if t in seen or not t:
                continue
            seen.add(t)
            if t in self.inits:
                leaves.append(t)
                continue
            p = self.producer.get(t)
            if p is None:
                return None  # a graph input: not constant
            if all(q.name != p.name for q in nodes):
                nodes.append(p)
            stack.extend(p.input)
        order = {n.name: i for i, n in enumerate(self.g.node)}
        nodes.sort(key=lambda n: order[n.name])
        return nodes, leaves


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


@dataclass
class QParams:
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1


def qparams(gr: Graph, node: onnx.NodeProto) -> QParams | None:
    """Scale/zero point of a Q or DQ node when both are constants."""
    scale = gr.const(node.input[1])
    if scale is None:
        return None
    zp = (
        gr.const(node.input[2])
        if len(node.input) > 2 and node.input[2]
        else np.zeros_like(scale, dtype=np.uint8)
    )
    if zp is None:
        return None
    return QParams(scale.astype(np.float32), zp, int(attr(node, "axis", 1)))


def as_int8(q: np.ndarray, zp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shift uint8 data/zero points to int8 (q-128, zp-128 give the same real values)."""
    if q.dtype == np.uint8:
        return (q.astype(np.int16) - 128).astype(np.int8), zp.astype(np.int16) - 128
    return q.astype(np.int8), zp.astype(np.int16)


def broadcast_shape(p: QParams, ndim: int) -> tuple[int, ...]:
    if p.per_tensor:
        return (1,) * ndim
    shape = [1] * ndim
    shape[p.axis % ndim] = p.scale.size
    return tuple(shape)


def folded_value(gr: Graph, tensor: str) -> np.ndarray | None:
    """A float constant, looking through a DequantizeLinear of constants."""
    v = gr.const(tensor)
    if v is not None:
        return v.astype(np.float32)
    p = gr.producer.get(tensor)
    if p is not None and p.op_type == "DequantizeLinear":
        q = gr.const(p.input[0])
        params = qparams(gr, p)
        if q is not None and params is not None:
            zp = params.zero_point.astype(np.float32).reshape(broadcast_shape(params, q.ndim))
            return (q.astype(np.float32) - zp) * params.scale.reshape(broadcast_shape(params, q.ndim))
    return None
