"""Fixed-seed sample inputs for a graph, used by numerics checks and calibration fallbacks.

Exporters store the inputs they traced with in ``samples/<graph>.npz``; those are preferred because
they are valid for the family (e.g. a patch count that matches ``image_grid_thw``). Otherwise inputs
are generated from the manifest signature with the dimension conventions below.
"""

from __future__ import annotations

import io
import logging

import numpy as np

from vlmc.errors import VlmcError
from vlmc.package import Package

logger = logging.getLogger(__name__)

# Symbolic dimension names used by the exporters, and the sizes generated inputs use for them.
DIM_SIZES = {
    "batch": 1,
    "sequence": 5,
    "past_sequence": 3,
    "images": 1,
    "patches": 16,
    "num_blocks": 8,
    "max_blocks": 2,
}


def sample_path(graph: str) -> str:
    return f"samples/{graph}.npz"


def store(pkg: Package, graph: str, feeds: dict[str, np.ndarray]) -> None:
    """Attach sample inputs for a graph to the package (written with it)."""
    buf = io.BytesIO()
    np.savez(buf, **{k: np.ascontiguousarray(v) for k, v in sorted(feeds.items())})
    pkg.files[sample_path(graph)] = buf.getvalue()


def load(pkg: Package, graph: str) -> dict[str, np.ndarray] | None:
    """Stored samples for a graph, if the package has them and they match its inputs."""
    rel = sample_path(graph)
    blob = pkg.files.get(rel)
    if blob is None and pkg.root is not None:
        from vlmc import paths

        where = str(pkg.root / "vlmc.json")
        if paths.inside(pkg.root, rel, f"samples of graph {graph!r}", where).is_file():
            blob = paths.read_bytes(pkg.root, rel, f"samples of graph {graph!r}", where)
    if blob is None:
        return None
    try:  # never pickle: allow_pickle stays off, object arrays are refused
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            feeds = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, KeyError) as exc:
        raise VlmcError(
            f"{rel} is not a readable sample file ({type(exc).__name__}); re-export the package"
        ) from None
    names = [i["name"] for i in pkg.info(graph)["inputs"]]
    if sorted(names) != sorted(feeds):
        return None
    return feeds


def generate(pkg: Package, graph: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs generated from the signature: random floats, in-vocab ids, consistent masks/positions."""
    rng = np.random.default_rng(seed)
    info = pkg.info(graph)
    sizes = dict(DIM_SIZES)
    sizes["total_sequence"] = sizes["sequence"] + sizes["past_sequence"]
    vocab = int(pkg.facts("text").get("vocab_size", 100))
    feeds = {}
    for spec in info["inputs"]:
        shape = [d if isinstance(d, int) else sizes.get(d, 2) for d in spec["shape"]]
        name, dtype = spec["name"], np.dtype(spec["dtype"])
        if name == "attention_mask":
            arr = np.ones(shape, dtype)
        elif name == "position_ids":
            pos = np.arange(sizes["past_sequence"], sizes["past_sequence"] + shape[-1])
            arr = np.broadcast_to(pos, shape).astype(dtype)
        elif name == "input_ids":
            arr = rng.integers(0, vocab, size=shape).astype(dtype)
        elif dtype.kind in "iu":
            arr = np.zeros(shape, dtype)
        elif dtype.kind == "b":
            arr = np.ones(shape, dtype)
        else:
            arr = rng.standard_normal(shape).astype(dtype)
        feeds[name] = arr
    return feeds


def inputs_for(pkg: Package, graph: str, seed: int = 0) -> dict[str, np.ndarray]:
    return load(pkg, graph) or generate(pkg, graph, seed)
