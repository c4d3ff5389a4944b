"""Stage tensor names that graphs, passes, the runtime and backends agree on, spelled once.

Every graph input/output name another module depends on is built or matched here (the KV names of
the contiguous and paged decoder interfaces, docs/architecture.md "Graph IO"); nothing else spells
them.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

KV_KINDS = ("key", "value")

# Contiguous KV interface: the decoder reads past_key_values.{i}.{key,value}, returns present.{i}.{...}.
PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."
PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
PRESENT_RE = re.compile(r"^present\.(\d+)\.(key|value)$")

# Paged KV interface v2 (docs/paged_kv.md): block pools in, this step's rows out.
CACHE_PREFIX = {"key": "key_cache.", "value": "value_cache."}
NEW_PREFIX = {"key": "new_key.", "value": "new_value."}
CACHE_RE = re.compile(r"^(key|value)_cache\.(\d+)$")
PAGED_INPUTS = ("block_tables", "slot_mapping", "context_lens")
# Paged interface v1 output names, refused with a hint to re-run paged_kv.
LEGACY_CACHE_OUT_PREFIX = "key_cache_out."

_LAYER_RE = re.compile(r"\.(\d+)(?:\.|$)")

# The stage interface merge and split compose and cut along (docs/architecture.md "Graph IO").
INPUT_IDS = "input_ids"
INPUTS_EMBEDS = "inputs_embeds"
IMAGE_FEATURES = "image_features"
LOGITS = "logits"
POSITION_IDS = "position_ids"
# The positions a merged pruned M-RoPE graph used in prefill (position_ids + kept tokens' offsets).
PREFILL_POSITIONS = "prefill_position_ids"
HIDDEN_PREFIX = "hidden_states."


def past(i: int, kind: str) -> str:
    """``past_key_values.{i}.{kind}``."""
    return f"{PAST_PREFIX}{i}.{kind}"


def present(i: int, kind: str) -> str:
    """``present.{i}.{kind}``."""
    return f"{PRESENT_PREFIX}{i}.{kind}"


def cache(i: int, kind: str) -> str:
    """The paged pool input of layer ``i``: ``key_cache.{i}`` / ``value_cache.{i}``."""
    return f"{CACHE_PREFIX[kind]}{i}"


def new_rows(i: int, kind: str) -> str:
    """The paged step's rows out of layer ``i``: ``new_key.{i}`` / ``new_value.{i}``."""
    return f"{NEW_PREFIX[kind]}{i}"


def hidden_states(layer: int) -> str:
    """The residual stream a decoder range hands to the range starting at ``layer``: ``hidden_states.{layer}``."""
    return f"{HIDDEN_PREFIX}{layer}"


def kv_names(layers: int) -> tuple[list[str], list[str]]:
    """Past and present KV tensor names in layer order (key then value)."""
    return (
        [past(i, k) for i in range(layers) for k in KV_KINDS],
        [present(i, k) for i in range(layers) for k in KV_KINDS],
    )


def is_past(name: str) -> bool:
    return name.startswith(PAST_PREFIX)


def is_cache(name: str) -> bool:
    """True for a paged pool input (``key_cache.{i}`` or ``value_cache.{i}``)."""
    return CACHE_RE.match(name) is not None


def is_paged_io(name: str) -> bool:
    """True for any name of the paged interface (pools, rows out, legacy pool outputs)."""
    return name.startswith(("key_cache", "value_cache", "new_key", "new_value"))


def cache_layers(names) -> list[int]:
    """Layer indices of the ``key_cache.{i}`` names among ``names``, in their order."""
    return [int(m[2]) for n in names if (m := CACHE_RE.match(n)) and m[1] == "key"]


def layer_of(name: str) -> int | None:
    """The layer index a KV tensor name carries (``past_key_values.3.key`` -> 3, ``key_cache.3`` -> 3)."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def with_layer(name: str, layer: int) -> str:
    """``name`` with the layer index it carries replaced (``past_key_values.3.key``, 0 -> ``past_key_values.0.key``)."""
    return _LAYER_RE.sub(lambda m: m.group(0).replace(m.group(1), str(layer), 1), name, count=1)


# Stacked KV inputs of an Ascend build (docs/ascend.md "Running on a 910B"): the per-layer past or pool
# inputs of layers 0..L-1 as one input [L, ...], so the build's dims vector does not grow with depth.
_STACKABLE_RE = re.compile(r"^(past_key_values)\.(\d+)\.(key|value)$|^(key|value)_cache\.(\d+)$")


def stack_group(name: str) -> tuple[str, int] | None:
    """(stacked input name, layer) of a per-layer KV input: ``past_key_values.3.key`` -> (``past_key_values.key``, 3),
    ``key_cache.3`` -> (``key_cache``, 3); None for any other name."""
    m = _STACKABLE_RE.match(name)
    if m is None:
        return None
    if m[1]:
        return f"{m[1]}.{m[3]}", int(m[2])
    return f"{m[4]}_cache", int(m[5])


def stack_members(stacked: str, layers: int) -> list[str]:
    """The per-layer names a stacked input holds, in layer order (the inverse of :func:`stack_group`)."""
    if stacked.startswith(PAST_PREFIX):
        kind = stacked[len(PAST_PREFIX) :]
        return [past(i, kind) for i in range(layers)]
    kind = stacked[: -len("_cache")]
    return [cache(i, kind) for i in range(layers)]


def is_stacked(name: str) -> bool:
    """True for a stacked KV input name (``past_key_values.key``, ``value_cache`` ...)."""
    return name in {f"{PAST_PREFIX}{k}" for k in KV_KINDS} | {f"{k}_cache" for k in KV_KINDS}


# Where the layers sit in a stacked tensor (vlmc/backends/ascend/stack_kv.py): the contiguous past and
# presents layer-major, the paged pools and new rows slot-major, so that a slot's rows of every layer are
# adjacent and a step's rows are stored with one copy for all layers.
_STACKED_OUTPUTS = {
    "present.key": (0, "key"),
    "present.value": (0, "value"),
    "new_key": (2, "key"),
    "new_value": (2, "value"),
}
# A rolled present (a contiguous decode build's) is [batch, kv_heads, total_sequence, head_dim] per layer
# with its first position dropped; its real length along that axis is the attention mask's width.
ROLLED_AXIS = 2
ROLLED_REAL = "total_sequence"


def layer_axis(stacked: str) -> int:
    """The axis that holds the layers in a stacked KV input or output."""
    if stacked in _STACKED_OUTPUTS:
        return _STACKED_OUTPUTS[stacked][0]
    return 2 if stacked.endswith("_cache") else 0


def is_stacked_output(name: str) -> bool:
    """True for a stacked KV output name (``present.key``, ``new_value`` ...)."""
    return name in _STACKED_OUTPUTS


def output_members(stacked: str, layers: int) -> list[str]:
    """The per-layer output names a stacked output holds, in layer order."""
    kind = _STACKED_OUTPUTS[stacked][1]
    make = present if stacked.startswith(PRESENT_PREFIX) else new_rows
    return [make(i, kind) for i in range(layers)]


def rolled_input(stacked: str) -> str | None:
    """The stacked past a stacked present is the next step's value of (``present.key`` ->
    ``past_key_values.key``); None for new rows."""
    if not stacked.startswith(PRESENT_PREFIX):
        return None
    return f"{PAST_PREFIX}{stacked[len(PRESENT_PREFIX) :]}"
