"""A model directory's safetensors checkpoint, checked before any library reads it (docs/security.md).

A model directory is untrusted input like a package. Before transformers or safetensors opens a shard:

- ``model.safetensors.index.json``'s ``weight_map`` names plain relative files resolving inside the model's
  fence (vlmc/paths.py: the directory, or a hub snapshot's repo cache folder), each a regular file;
- every shard's header is read by :func:`read_header`, which holds it to the format
  (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length within the file
  and under safetensors' own 100 MB bound, a UTF-8 JSON object, every tensor with a known dtype, a shape of
  non-negative integers and ``data_offsets`` that tile the data area exactly (``dtype size x shape`` bytes
  each, no gap, no overlap, nothing past the end);
- :func:`check_weights` compares what the checkpoint holds with the model the config describes (built on
  the meta device, no storage): the shape the config implies, and a floating-point dtype for every float
  weight (an ``I16`` tensor where a ``BF16`` weight belongs is not loaded as integers).

Each refusal is one line naming the file and the tensor (exit 2).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from vlmc import paths
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
# safetensors' dtype names and their sizes in bytes (the Dtype enum of the safetensors crate).
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
# The dtypes a float weight may be stored in: converted to FP32 exactly. (FP8 needs the scales of a quantized
# checkpoint, which vlmc does not read; loaded plainly its values would be wrong.)
FLOAT_WEIGHTS = ("F16", "BF16", "F32", "F64")
# safetensors refuses larger headers itself (MAX_HEADER_SIZE in the safetensors crate).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class Tensor:
    """One tensor of a shard, as its header describes it."""

    shard: str  # file name relative to the model directory
    dtype: str
    shape: tuple[int, ...]


def _bad(path: Path, why: str) -> VlmcError:
    return VlmcError(
        f"{path}: not a valid safetensors file ({why}); the checkpoint is damaged, re-download it"
    )


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:80]!r}")
        out[k] = v
    return out


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A shard's tensors as {name: (dtype, shape)}, after checking the header against the file.

    Raises:
        VlmcError: one line naming the file, for any header safetensors would refuse or misread.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise _bad(path, "the file is empty")
        if size < 8:
            raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise _bad(path, f"header length {n} is above safetensors' {MAX_HEADER_BYTES}-byte limit")
        if 8 + n > size:
            raise _bad(path, f"header length {n} runs past the end of the {size}-byte file")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("the header is not a JSON object")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as exc:
        raise _bad(path, f"the header is not UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise _bad(path, "the header is nested too deeply") from None
    except ValueError as exc:
        raise _bad(path, f"the header is not JSON: {str(exc).splitlines()[0][:120]}") from None
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    data_bytes = size - 8 - n
    spans = []
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise _bad(path, "__metadata__ is not a mapping of strings")
            continue
        label = repr(name[:80])
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {label} is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise _bad(
                path, f"tensor {label} has dtype {str(dtype)[:20]!r}, which safetensors does not define"
            )
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise _bad(path, f"tensor {label} has shape {str(shape)[:60]}, not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets):
            raise _bad(path, f"tensor {label} has data_offsets {str(offsets)[:60]}, not [begin, end]")
        begin, end = offsets
        if not begin <= end <= data_bytes:
            raise _bad(
                path, f"tensor {label} has data_offsets [{begin}, {end}] past the {data_bytes} data bytes"
            )
        numel = 1
        for d in shape:
            numel *= d
        if numel * DTYPE_BYTES[dtype] != end - begin:
            raise _bad(
                path,
                f"tensor {label} is {dtype} {shape}: {numel * DTYPE_BYTES[dtype]} bytes, "
                f"but its data_offsets span {end - begin}",
            )
        spans.append((begin, end, label))
        out[name] = (dtype, tuple(shape))
    at = 0
    for begin, end, label in sorted(spans):
        if begin != at:
            raise _bad(
                path, f"tensor {label} starts at byte {begin} of the data, not at {at} (a gap or overlap)"
            )
        at = end
    if at != data_bytes:
        raise _bad(path, f"its tensors end at data byte {at}, the file at {data_bytes} (truncated or padded)")
    return out


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def tensors(directory: str | Path) -> dict[str, Tensor]:
    """Every tensor the checkpoint of a model directory holds, by checkpoint key, all headers checked.

    With ``model.safetensors.index.json``, the shards are the files its ``weight_map`` names (each a plain
    relative name resolving inside the model's fence, a regular file), and each key it maps must be in that
    shard; without one, every ``*.safetensors`` file of the directory.
    """
    directory = Path(directory)
    fence = paths.model_fence(directory)
    index = paths.model_json(directory, INDEX)
    where = str(directory / INDEX)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise VlmcError(f"{where}: weight_map must be a non-empty mapping of tensor names to shard files")
        shards = []
        for key, shard in weight_map.items():
            label = f"weight_map[{key[:80]!r}]"
            paths.regular_file(directory, shard, label, where, fence)
            if not shard.endswith(".safetensors"):
                raise VlmcError(f"{where}: {label} {shard[:80]!r} is not a .safetensors file")
            shards.append(shard)
        shards = sorted(set(shards))
    else:
        weight_map = None
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
    out: dict[str, Tensor] = {}
    for shard in shards:
        target = paths.regular_file(directory, shard, "file", str(directory), fence)
        for key, (dtype, shape) in read_header(target).items():
            if key in out:
                raise VlmcError(f"{directory}: tensor {key[:80]!r} is in both {out[key].shard} and {shard}")
            out[key] = Tensor(shard, dtype, shape)
    if weight_map is not None:
        for key, shard in weight_map.items():
            if key not in out or out[key].shard != shard:
                raise VlmcError(
                    f"{where}: weight_map puts {key[:80]!r} in {shard[:80]}, which does not hold it"
                )
    return out


def check_weights(directory, meta_sd: dict, files: dict, converted: dict, held: dict[str, Tensor]) -> None:
    """Refuse a checkpoint tensor whose shape or dtype is not what the config's model needs, naming it.

    ``meta_sd``: the state dict of the model the config describes (meta device); ``files``: model key ->
    (shard, checkpoint key) for tensors loaded as they are; ``converted``: model key -> checkpoint keys that
    transformers combines into it (only their dtype can be compared).
    """
    for mkey, (_, ckey) in sorted(files.items()):
        _check_one(directory, meta_sd[mkey], mkey, held[ckey], ckey, compare_shape=True)
    for mkey, ckeys in sorted(converted.items()):
        if mkey in meta_sd:
            for ckey in ckeys:
                _check_one(directory, meta_sd[mkey], mkey, held[ckey], ckey, compare_shape=False)


def _check_one(directory, param, mkey: str, t: Tensor, ckey: str, compare_shape: bool) -> None:
    where = Path(directory) / t.shard
    if param.is_floating_point() and t.dtype not in FLOAT_WEIGHTS:
        raise VlmcError(
            f"{where}: tensor {ckey} is {t.dtype}, but {mkey} is a float weight "
            f"({', '.join(FLOAT_WEIGHTS)}); the checkpoint is damaged or not this model's"
        )
    if compare_shape and tuple(param.shape) != t.shape:
        raise VlmcError(
            f"{where}: tensor {ckey} has shape {list(t.shape)}, but config.json implies "
            f"{list(param.shape)} for {mkey}; the checkpoint and config.json do not belong together"
        )


def refuse_missing(directory, info: dict, ignore: set | frozenset = frozenset()) -> None:
    """Refuse a load that transformers completed with weights missing (``output_loading_info``), naming the
    first: transformers would have filled it with random values."""
    missing = sorted(set(info.get("missing_keys") or ()) - set(ignore))
    if missing:
        raise VlmcError(
            f"{directory}: the checkpoint has no tensor for {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + ", which the model config.json describes needs; the checkpoint is incomplete or not this model's"
        )
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, have, want = mismatched[0]
        raise VlmcError(
            f"{directory}: tensor {key} has shape {list(have)}, but config.json implies {list(want)}; "
            "the checkpoint and config.json do not belong together"
        )
