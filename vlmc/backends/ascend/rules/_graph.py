"""The onnx-ir graph the Ascend rules rewrite: unique names, constant lookups, node surgery, weight output.

Producers and consumers come from the IR itself (``value.producer()``, ``value.uses()``); dead-node
removal and naming are onnx-ir's common passes (RemoveUnusedNodesPass, NameFixPass). What is left
here is what those do not cover: fresh names that follow the lowering's ``<node>_<what>`` scheme,
the constant a value holds (initializer or Constant node), and new deploy-form weights, which go to
a :class:`vlmc.interop.TensorStore` one tensor at a time so a lowering never holds more than the
weight it is working on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from vlmc import graphs, interop

logger = logging.getLogger(__name__)


class Graph:
    """An onnx-ir model under rewrite (the lowering's own copy), with the lookups the rules match on.

    Args:
        model: the model; it is rewritten in place.
        store: where new weights of :data:`vlmc.interop.EXTERNAL_DATA_THRESHOLD` bytes or more are
            written as they are made (None keeps them in memory: small graphs and tests).
    """

    def __init__(self, model: ir.Model, store: interop.TensorStore | None = None) -> None:
        self.model = model
        self.g = model.graph
        self.store = store
        # Rules identify nodes by name in messages and in the quantize pass's facts.
        graphs.name_nodes(model)
        self._names = self._live_names()

    def _live_names(self) -> set[str]:
        names = {n.name for n in self.g} | set(self.g.initializers)
        names |= {o.name for n in self.g for o in n.outputs if o.name}
        return names

    # ---- names and constants ------------------------------------------------------------------
    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def value(self, base: str) -> ir.Value:
        """A new, unnamed-before value with a unique name (the output of a node the rule makes)."""
        return ir.Value(name=self.unique(base))

    def const(self, value: ir.Value | None) -> np.ndarray | None:
        """The value's constant (an initializer, memory-mapped, or a Constant node's tensor)."""
        tensor = None if value is None else ir.convenience.get_const_tensor(value)
        return None if tensor is None else tensor.numpy()

    def add_init(self, base: str, array: np.ndarray) -> ir.Value:
        """A new initializer; a large one is written to the store at once and read back memory-mapped."""
        name = self.unique(base)
        array = np.ascontiguousarray(array)
        tensor = ir.tensor(array, name=name)
        if self.store is not None and tensor.nbytes >= interop.EXTERNAL_DATA_THRESHOLD:
            if tensor.dtype.bitwidth == 4:
                # numpy holds 4-bit values one per byte; the file holds them packed, as ONNX does
                stored = self.store.put(np.frombuffer(tensor.tobytes(), np.uint8), name)
                tensor = _pointing_at(stored, tensor.dtype, tensor.shape, name)
            else:
                tensor = self.store.put(array, name)
        del array
        value = ir.Value(name=name, const_value=tensor, type=ir.TensorType(tensor.dtype), shape=tensor.shape)
        self.g.register_initializer(value)
        return value

    def add_alias_init(self, base: str, source: ir.ExternalTensor) -> ir.Value:
        """A new initializer whose bytes are exactly those of a weight stored in a file: it points at them.

        Nothing is read or written here; the build's writer copies the bytes from the source file
        (onnx-ir does it with copy_file_range, in the kernel).
        """
        name = self.unique(base)
        tensor = _pointing_at(source, source.dtype, source.shape, name)
        value = ir.Value(name=name, const_value=tensor, type=ir.TensorType(tensor.dtype), shape=tensor.shape)
        self.g.register_initializer(value)
        return value

    def add_deferred_init(
        self, base: str, dtype: ir.DataType, shape: tuple[int, ...], make: Callable[[], np.ndarray]
    ) -> ir.Value:
        """A new initializer whose values ``make()`` computes when they are first needed.

        With a store, the tensor is an ``onnx_ir.LazyTensor`` (not cached): the build's writer calls
        ``make`` when it writes the tensor, one tensor at a time, so a deploy weight the lowering only
        reshapes (quantize's packed int4, unpacked to int8) is written once, into the build, instead
        of to the store and then again from it. Without a store it is made at once (as add_init).
        """
        if self.store is None:
            return self.add_init(base, make())
        name = self.unique(base)

        def materialize() -> ir.TensorProtocol:
            return ir.tensor(np.ascontiguousarray(make()), name=name)

        tensor = ir.LazyTensor(materialize, dtype=dtype, shape=ir.Shape(shape), name=name)
        value = ir.Value(name=name, const_value=tensor, type=ir.TensorType(dtype), shape=tensor.shape)
        self.g.register_initializer(value)
        return value

    # ---- structure ----------------------------------------------------------------------------
    @staticmethod
    def only_consumer(value: ir.Value) -> ir.Node | None:
        users = value.consumers()
        if len(users) == 1 and not value.is_graph_output():
            return users[0]
        return None

    def insert_before(self, anchor: ir.Node, nodes: list[ir.Node]) -> None:
        self.g.insert_before(anchor, nodes)

    def replace(
        self,
        old: ir.Node,
        new: list[ir.Node],
        drop: list[ir.Node],
        takes_over: list[tuple[ir.Value, ir.Value]],
    ) -> None:
        """Put ``new`` where ``old`` was, take ``drop`` out, and let each new value take over an old one.

        A new value that takes over keeps the old one's name (and its place among the graph outputs),
        so the rewritten graph reads the same to everything around it (onnx-ir's
        ``replace_nodes_and_values``, which also gives it what was known of the old one's type and shape).
        """
        for n in (old, *drop):
            self._names.discard(n.name)
            self._names.difference_update(o.name for o in n.outputs if o.name)
        ir.convenience.replace_nodes_and_values(
            self.g, old, [old, *drop], new, [b for b, _ in takes_over], [a for _, a in takes_over]
        )

    def replace_inputs(self, old: ir.Node, inputs: list[ir.Value | None]) -> ir.Node:
        """``old`` with other inputs (same op, attributes, name and outputs)."""
        outs = [ir.Value(name=o.name) for o in old.outputs]
        new = ir.Node(
            old.domain,
            old.op_type,
            inputs,
            attributes=list(old.attributes.values()),
            outputs=outs,
            name=old.name,
        )
        self.replace(old, [new], [], list(zip(old.outputs, outs)))
        return new

    def dce(self) -> None:
        """Remove nodes whose outputs nobody uses, then unused initializers (onnx-ir's pass)."""
        RemoveUnusedNodesPass()(self.model)
        self._names = self._live_names()

    def const_subgraph(self, value: ir.Value) -> tuple[list[ir.Node], list[ir.Value]] | None:
        """The nodes computing ``value`` from constants only (in graph order), and the initializers they read."""
        nodes: list[ir.Node] = []
        leaves: list[ir.Value] = []
        stack, seen = [value], set()
        while stack:
            v = stack.pop()
            if v is None or v in seen:
                continue
            seen.add(v)
            if v.is_initializer():
                leaves.append(v)
                continue
            p = v.producer()
            if p is None:
                return None  # a graph input: not constant
            if p not in nodes:
                nodes.append(p)
            stack.extend(p.inputs)
        order = {n: i for i, n in enumerate(self.g)}
        nodes.sort(key=order.__getitem__)
        return nodes, leaves

    def opset(self, default: int = 17) -> int:
        return self.g.opset_imports.get("", self.g.opset_imports.get("ai.onnx", default))


def attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def release(*values: ir.Value | None) -> None:
    """Drop the memory maps of weights a rule has read (their pages count as resident while mapped).

    Best effort: a tensor someone else still holds a numpy view of keeps its map (closing it would
    pull the memory from under that view; mmap refuses with BufferError).
    """
    for v in values:
        t = v.const_value if v is not None else None
        if isinstance(t, ir.ExternalTensor):
            with contextlib.suppress(BufferError):
                t.release()


def input_at(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


@dataclass
class QParams:
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1


def qparams(gr: Graph, node: ir.Node) -> QParams | None:
    """Scale/zero point of a Q or DQ node when both are constants."""
    scale = gr.const(node.inputs[1])
    if scale is None:
        return None
    zp_value = input_at(node, 2)
    zp = gr.const(zp_value) if zp_value is not None else np.zeros_like(scale, dtype=np.uint8)
    if zp is None:
        return None
    return QParams(scale.astype(np.float32), np.array(zp), int(attr(node, "axis", 1)))


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


def folded_value(gr: Graph, value: ir.Value | None) -> np.ndarray | None:
    """A float constant, looking through a DequantizeLinear of constants."""
    v = gr.const(value)
    if v is not None:
        return v.astype(np.float32)
    p = value.producer() if value is not None else None
    if p is not None and p.op_type == "DequantizeLinear":
        q = gr.const(p.inputs[0])
        params = qparams(gr, p)
        if q is not None and params is not None:
            zp = params.zero_point.astype(np.float32).reshape(broadcast_shape(params, q.ndim))
            return (q.astype(np.float32) - zp) * params.scale.reshape(broadcast_shape(params, q.ndim))
    return None


def _pointing_at(stored: ir.ExternalTensor, dtype: ir.DataType, shape, name: str) -> ir.ExternalTensor:
    """A tensor named ``name`` whose bytes are ``stored``'s bytes in its file (nothing is read)."""
    return ir.ExternalTensor(
        stored.location, stored.offset, stored.length, dtype, shape=shape, name=name, base_dir=stored.base_dir
    )
