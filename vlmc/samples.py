"""Fixed-seed sample inputs for a graph, used by numerics checks and calibration fallbacks.

Exporters store the inputs they traced with in ``samples/<graph>.npz``; those are preferred because
they are valid for the family (e.g. a patch count that matches ``image_grid_thw``). Otherwise inputs
are generated from the manifest signature with the dimension conventions below.
"""

from __future__ import annotations

import io
import logging
import zipfile
from collections.abc import Iterable

import numpy as np

from vlmc import paths
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


def store_streamed(pkg: Package, graph: str, arrays: Iterable[tuple[str, np.ndarray]]) -> None:
    """:func:`store` for samples too large to hold at once (paged_kv's pools: ~21 MB per layer at 7B).

    ``arrays`` yields (name, array) one at a time, in the order they are made; each is written to
    the ``.npz`` as it comes and dropped. The archive's directory lists the entries in sorted name
    order, as :func:`store` (np.savez of the sorted dict) does, so readers see the same archive: the
    same entries (names, storage, bytes) in the same order; only where each entry sits in the file
    differs. The package keeps the file's path (in its scratch directory) and moves it into the
    package on save.
    """
    target = pkg.scratch_path(f"samples-{graph}").with_suffix(".npz")
    # np.savez's archive: stored (uncompressed), every entry zip64, named <key>.npy (numpy/lib/_npyio_impl.py _savez)
    with zipfile.ZipFile(target, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, arr in arrays:
            with z.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)
            del arr
        # the central directory (what namelist() and np.load's .files read) in np.savez's sorted order
        z.filelist.sort(key=lambda info: info.filename[: -len(".npy")])
    pkg.files[sample_path(graph)] = target


def _source(pkg: Package, graph: str):
    """Where a graph's samples are: bytes in memory, a file path, or None."""
    rel = sample_path(graph)
    blob = pkg.files.get(rel)
    if blob is None and pkg.root is not None:
        where = str(pkg.root / "vlmc.json")
        if paths.inside(pkg.root, rel, f"samples of graph {graph!r}", where).is_file():
            return paths.regular_file(pkg.root, rel, f"samples of graph {graph!r}", where)
    return io.BytesIO(blob) if isinstance(blob, bytes) else blob


def load(pkg: Package, graph: str) -> dict[str, np.ndarray] | None:
    """Stored samples for a graph, if the package has them and they match its inputs."""
    rel = sample_path(graph)
    src = _source(pkg, graph)
    if src is None:
        return None
    try:  # never pickle: allow_pickle stays off, object arrays are refused
        with np.load(src, allow_pickle=False) as z:
            feeds = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise VlmcError(
            f"{rel} is not a readable sample file ({type(exc).__name__}); re-export the package"
        ) from None
    names = [i["name"] for i in pkg.info(graph)["inputs"]]
    if sorted(names) != sorted(feeds):
        return None
    return feeds


def shapes(pkg: Package, graph: str) -> dict[str, tuple[int, ...]] | None:
    """The shapes of a graph's stored samples (as :func:`load` would give them), read from the headers only.

    Used where only the sample's names and shapes matter (the Ascend gear plan), so a paged decoder's
    pools (hundreds of MB at 7B) are never read.
    """
    rel = sample_path(graph)
    src = _source(pkg, graph)
    if src is None:
        return None
    out: dict[str, tuple[int, ...]] = {}
    try:
        with zipfile.ZipFile(src) as z:
            for entry in z.namelist():
                with z.open(entry) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                    else:  # format 3.0 (utf-8 field names): no public header reader; read the arrays
                        full = load(pkg, graph)
                        return None if full is None else {k: v.shape for k, v in full.items()}
                if dtype.hasobject:  # load() refuses these (no pickles)
                    raise ValueError("object array")
                out[entry[: -len(".npy")] if entry.endswith(".npy") else entry] = tuple(shape)
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise VlmcError(
            f"{rel} is not a readable sample file ({type(exc).__name__}); re-export the package"
        ) from None
    names = [i["name"] for i in pkg.info(graph)["inputs"]]
    if sorted(names) != sorted(out):
        return None
    return out


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
