"""Executors: what runs one graph for the generation loop (onnxruntime here; a compile output's builds elsewhere).

The loop in :mod:`vlmc.runtime.pipeline` is the only generation loop vlmc has. It asks an executor
which inputs a graph declares, feeds them by name, and reads the outputs by name. What differs between
onnxruntime on a package, the lowered Ascend graphs on CPU and ``.om`` files on a 910B is the executor
(docs/architecture.md, "Executors").
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

import numpy as np
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from vlmc import ortsession
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# onnxruntime type strings -> numpy dtype names (the manifest's spelling).
_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(bfloat16)": "bfloat16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


@runtime_checkable
class Executor(Protocol):
    """Runs the graphs of one package by their manifest names.

    ``inputs(graph)`` lists the graph's inputs in order as ``{"name", "dtype"}`` (dtype a numpy
    name such as ``"float16"``); the loop feeds every one by name. ``run(graph, feeds)`` returns every
    output by name as numpy arrays. ``close()`` frees what the executor holds (sessions, device memory).

    An executor may also offer ``new_pool(name, shape, dtype)``: paged KV then keeps its pools in what
    that returns (an object with ``shape``, ``dtype`` and ``write(rows, slot_mapping)``, e.g. device
    memory) instead of numpy arrays; see :class:`vlmc.runtime.paged.PagedKV`.
    """

    def inputs(self, graph: str) -> list[dict]: ...

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class OrtExecutor:
    """The package's graphs on onnxruntime CPU, one session per graph, opened on first use."""

    def __init__(self, pkg, threads: int | None = None) -> None:
        self.pkg = pkg
        self.threads = threads
        self.sessions: dict[str, object] = {}

    def session(self, name: str):
        if name not in self.sessions:
            self.sessions[name] = ortsession.for_graph(self.pkg, name, self.threads)
        return self.sessions[name]

    def inputs(self, graph: str) -> list[dict]:
        return [
            {"name": i.name, "dtype": _ORT_TYPES.get(i.type, i.type)}
            for i in self.session(graph).get_inputs()
        ]

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self.session(graph)
        try:
            outputs = sess.run(None, feeds)
        except InvalidArgument as exc:
            # onnxruntime checks feeds against the graph's declared inputs before running anything. The
            # loop builds its feeds from vlmc.json (KV heads and head size, hidden size, dtypes), so a
            # rejected feed means the manifest disagrees with the graph it describes (edited or from
            # another export), which is bad input to report in one line, not a vlmc bug.
            said = " ".join(str(exc).split()).split("INVALID_ARGUMENT : ")[-1]  # one line
            raise VlmcError(
                f"graph {graph!r} rejects the inputs vlmc.json describes ({said}); the package's manifest "
                "does not match its graphs: re-export it"
            ) from exc
        return dict(zip([o.name for o in sess.get_outputs()], outputs))

    def close(self) -> None:
        """Drop the sessions (each holds a copy of its graph's weights)."""
        self.sessions.clear()
