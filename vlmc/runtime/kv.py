"""KV-cache state for the decoder loop: what the decoder graphs read and how their outputs update it."""

from __future__ import annotations

import logging

import numpy as np

from vlmc.errors import VlmcError
from vlmc.runtime.paged import PagedKV  # imported lazily: paged.py is only needed for paged packages

logger = logging.getLogger(__name__)


class ContiguousKV:
    """One [batch, kv_heads, length, head_dim] tensor per layer and K/V; grows by concatenation inside the graph."""

    def __init__(self, kv: dict, batch: int, dtype: str = "float32") -> None:
        self.layers = int(kv["layers"])
        shape = (batch, int(kv["kv_heads"]), 0, int(kv["head_dim"]))
        self.past = {
            f"past_key_values.{i}.{k}": np.zeros(shape, np.dtype(dtype))
            for i in range(self.layers)
            for k in ("key", "value")
        }
        # (present, past) name pairs, spelled once: update() runs every step
        self._names = [
            (f"present.{i}.{k}", f"past_key_values.{i}.{k}")
            for i in range(self.layers)
            for k in ("key", "value")
        ]
        self._present_order = [n for n, _ in self._names]
        self._pasts = [p for _, p in self._names]
        self._presents = frozenset(self._present_order)

    def feeds(self, step: dict) -> dict[str, np.ndarray]:
        return dict(self.past)

    def update(self, outputs: dict[str, np.ndarray]) -> None:
        if outputs.keys() >= self._presents:  # every layer's present (a whole decoder): in one update
            self.past.update(zip(self._pasts, map(outputs.__getitem__, self._present_order)))
            return
        for name, past in self._names:
            if name in outputs:
                self.past[past] = outputs[name]

    def release(self) -> None:
        self.past.clear()


# layout -> factory(kv facts, batch, dtype, step info); the paged layout registers itself here.
LAYOUTS = {"contiguous": lambda kv, batch, dtype, **_: ContiguousKV(kv, batch, dtype)}


def _paged(kv: dict, batch: int, dtype: str, **extra) -> object:
    return PagedKV(kv, batch, dtype, **extra)


LAYOUTS["paged"] = _paged


def make(kv: dict, batch: int, dtype: str = "float32", **extra) -> object:
    """KV state for the manifest's ``kv.layout``.

    Raises:
        VlmcError: the layout is not one this runtime knows (a package from a newer vlmc).
    """
    layout = kv.get("layout")
    if layout not in LAYOUTS:
        raise VlmcError(
            f"unknown KV layout {layout!r} (kv.layout); known layouts: {', '.join(LAYOUTS)}; "
            "upgrade vlmc, or re-export the package with this one"
        )
    return LAYOUTS[layout](kv, batch, dtype, **extra)
