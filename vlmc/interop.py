"""The one seam between vlmc's IR (onnx_ir.Model) and tools written against ModelProto or ONNX files.

vlmc keeps every graph as an onnx-ir model whose weights stay in their files. Foreign tools
(onnxsim, onnx-graphsurgeon, onnxruntime.quantization, onnxruntime sessions, onnx.utils.Extractor)
are reached only through this module, which hands them a bounded form of the graph and brings
their result back to the IR:

* :func:`as_proto` — a ModelProto in which every weight of ``weight_limit`` bytes or more is a
  graph *input* (a value the tool cannot know, so it never reads or copies it). On exit the tool's
  result, if given back, becomes an IR model holding the same weight tensors (nothing is read).
  ``weight_limit=None`` reads every weight in (only for tools that need all values and graphs known
  to be small, e.g. the fp16 converter).
* :func:`as_file` — the graph saved to a file (weights streamed one tensor at a time), for tools
  that take a path (quantize_static, calibrators, InferenceSession on graphs over 2 GB).
* :func:`load_result` — a file a tool wrote, opened as IR (weights memory-mapped, not read).
* :func:`session_bytes` — the serialized graph for an in-memory InferenceSession (bounded by the
  protobuf limit; larger graphs go through :func:`as_file`).

Usage::

    with interop.as_proto(model, weight_limit=1 << 20) as seam:
        seam.give_back(onnxsim.simplify(seam.proto)[0])
    simplified = seam.model  # onnx_ir.Model, or None if nothing was given back
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from vlmc import graphs
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT_LIMIT = 1 << 20  # 1 MiB: shape arithmetic and small constants stay foldable


class ProtoSeam:
    """What :func:`as_proto` yields: ``proto`` for the tool, ``held`` weights, ``model`` after exit."""

    def __init__(self, proto: onnx.ModelProto, held: dict[str, ir.Value], like: ir.Model) -> None:
        self.proto = proto
        self.held = held  # initializer name -> the IR value the proto sees as a graph input
        self._like = like
        self._result: onnx.ModelProto | None = None
        self.model: ir.Model | None = None

    def give_back(self, result: onnx.ModelProto) -> None:
        """Hand the tool's result back; on exit it becomes :attr:`model` with the held weights restored."""
        self._result = result

    def _finish(self) -> None:
        if self._result is not None:
            self.model = _with_held(self._result, self.held, self._like)
        self.proto = None  # type: ignore[assignment]  (let the tool's copy go)
        self._result = None


@contextlib.contextmanager
def as_proto(model: ir.Model, weight_limit: int | None = DEFAULT_WEIGHT_LIMIT) -> Iterator[ProtoSeam]:
    """A ModelProto of ``model`` with weights of ``weight_limit`` bytes or more held back as inputs.

    Args:
        model: the IR graph; it is not changed.
        weight_limit: bytes from which an initializer is held back (never read). ``None`` reads
            every weight into the proto.

    Yields:
        a :class:`ProtoSeam`; call ``give_back(result)`` to get ``seam.model`` after the block.
    """
    limit = float("inf") if weight_limit is None else weight_limit
    g = model.graph
    order = list(g.initializers.items())
    held = {n: v for n, v in order if v.const_value is not None and v.const_value.nbytes >= limit}
    n_inputs = len(g.inputs)
    try:
        for n in held:
            g.initializers.pop(n)
            g.inputs.append(held[n])
        proto = _full_proto(model)  # the small weights' bytes are read in: tools may need them
    finally:
        while len(g.inputs) > n_inputs:
            g.inputs.pop()
        g.initializers.clear()
        for _, v in order:
            g.register_initializer(v)
    seam = ProtoSeam(proto, held, model)
    del proto
    try:
        yield seam
    finally:
        seam._finish()


def _with_held(proto: onnx.ModelProto, held: dict[str, ir.Value], like: ir.Model) -> ir.Model:
    # The held weights go back as initializers (the same tensors: nothing is read), in ``like``'s order.
    model = ir.from_proto(proto)
    g = model.graph
    for v in [v for v in g.inputs if v.name in held]:
        g.inputs.remove(v)
        v.const_value = held[v.name].const_value
        g.register_initializer(v)
    order_initializers_like(g, like)
    return model


def order_initializers_like(graph: ir.Graph, like: ir.Model) -> None:
    """Register ``graph``'s initializers again in ``like``'s order, new ones last: a foreign tool's
    result keeps the package's weight order, so its data file is laid out as before."""
    rank = {n: i for i, n in enumerate(like.graph.initializers)}
    order = sorted(graph.initializers.items(), key=lambda kv: rank.get(kv[0], len(rank)))
    graph.initializers.clear()
    for _, v in order:
        graph.register_initializer(v)


def _full_proto(model: ir.Model) -> onnx.ModelProto:
    """A ModelProto with every initializer's bytes inside (read one tensor at a time)."""
    proto = ir.to_proto(model)
    graphs.drop_initializer_infos(proto, model)
    tensors = {name: v.const_value for name, v in model.graph.initializers.items()}
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        src = tensors.get(t.name)
        if src is None:
            raise VlmcError(f"weight {t.name!r} has no data")
        t.raw_data = src.tobytes()
        t.ClearField("data_location")  # ClearField: proto2 keeps an explicitly set default
        del t.external_data[:]
    return proto


def from_proto(proto: onnx.ModelProto) -> ir.Model:
    """A tool's ModelProto as an IR model (tensor bytes are referenced, not copied)."""
    return ir.from_proto(proto)


def session_bytes(model: ir.Model | onnx.ModelProto) -> bytes:
    """The serialized graph with its weights, for an in-memory onnxruntime session (< 2 GiB graphs)."""
    proto = model if isinstance(model, onnx.ModelProto) else _full_proto(model)
    return proto.SerializeToString()


@contextlib.contextmanager
def as_file(model: ir.Model, directory: str | Path | None = None, name: str = "graph.onnx") -> Iterator[Path]:
    """The graph saved to ``<dir>/<name>`` with its weights streamed there, for tools that take a path.

    Without ``directory`` a temporary one is made and removed on exit (results a tool writes there
    must be read, or loaded with :func:`load_result` into a directory that outlives the block).
    """
    if directory is not None:
        path = Path(directory) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        graphs.save(model, path)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="vlmc-seam-") as tmp:
        path = Path(tmp) / name
        graphs.save(model, path)
        yield path


def load_result(path: str | Path, in_memory: bool = False) -> ir.Model:
    """A graph file a tool wrote, as IR; its weights stay in the file (memory-mapped when read).

    ``in_memory`` reads every weight in, for results written to a directory about to be removed.
    """
    model = graphs.load_ir(path)
    # Tools write Constant node tensors as external data too; they are small, and an in-memory
    # session or proto of the graph needs them inline.
    for node in model.graph.all_nodes():
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                t = attr.value
                node.attributes[attr.name] = ir.AttrTensor(
                    attr.name, ir.tensor(np.array(t.numpy()), name=t.name)
                )
                t.release()
    if in_memory:
        for g in model.graphs():
            for v in g.initializers.values():
                t = v.const_value
                if isinstance(t, ir.ExternalTensor):
                    v.const_value = ir.tensor(np.array(t.numpy()), name=t.name)
                    t.release()
    return model
