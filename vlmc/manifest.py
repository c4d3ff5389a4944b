"""The vlmc.json manifest: the single source of truth about a package, and its validation.

Layout (format version 1; ``?`` marks keys only some packages have)::

    {
      "format_version": 1,
      "vlmc_version": "0.1.0",
      "model":  {"family", "architecture", "source", "config_hash"},
      "vision": {"image_size": [h, w] | null, "tokens_per_image": int | null (the image grid decides),
                 "image_token_id": int,
                 "preprocess": {"kind": "clip" | "resize" | "packed_patches" | "tiles" | ..., "mean", "std",
                                "rescale_factor", "resample", ...kind's settings},
                 "hidden_size", "patch_grid"?, "has_cls_token"?, "spatial_merge_size"?,
                 "packed_features"?, "dynamic_resolution"?, ...family facts passes read,
                 "tiled"?: true,   # tokens_per_image counts per tile; an image is several vision rows
                 "attention_note"?: str,  # why "attention" is null (prune names it when refusing)
                 "attention"?: {"graph", "layer", "layers", "probs", "query", "key_t", "scale",
                                "masked", "query_index", "token_offset", "keys_per_image",
                                "merge_group"?} | null,       # written by exporters, read by pruning
                 "pruning"?: {"method", "keep", "tokens_before", "unpruned_tokens_per_image",
                              "graph", "indices_output", "score_source", "seed",
                              "positions": "original" | "contiguous"}},   # after prune_visual_tokens
      "text":   {"vocab_size", "eos_token_id", "pad_token_id", "bos_token_id", "max_positions",
                 "hidden_size", "intermediate_size", "tokenizer": "source" | "bytes",
                 "prompt_template": str, "image_marker": str, "add_bos": bool,
                 "tokenizer_file"?: str,        # the source processor's tokenizer (tokenizers JSON)
                 "chat_template"?: str,         # its chat template (a file in the package)
                 "special_tokens"?: {name: str},  # bos_token, eos_token... for the chat template
                 "position": "1d" | "mrope", "mrope_section"?: [t, h, w],
                 "image_tokens_first"?: bool,   # placeholders lead the sequence, ahead of BOS
                 "token_type_ids"?: str},       # the source model's input marking placeholders (verify)
      "kv":     {"layers", "kv_heads", "head_dim", "layout": "contiguous" | "paged",
                 "block_size": int | null, "dtype",
                 "num_blocks": int | "num_blocks", "padding_slot": str,
                 "context_lens": str},   # num_blocks and the two rules only when paged
      "graphs": {name: {"file", "role", "precision", "inputs": [...], "outputs": [...],
                        "quantization"?: {"mode", ...},       # quantize: what lowering needs
                        "weights_file"?: str,                 # merge: the shared weights file
                        "stages"?: [...], "pipeline"?: {...}, # merge: the stages inside a vlm graph
                        "kv_layers"?: [first, end],           # split: a decoder range's layers
                        "rank"?: int, "segment"?: int}},      # tensor_parallel: a rank-local segment
      "pipeline": {"image": [graph, ...], "embed": graph, "decoder": [graph, ...],
                   "vlm"?: graph},   # merge: one prefill graph; "image" is then absent
      "tensor_parallel"?: {"size", "heads", "heads_per_rank", "kv_heads", "kv_heads_per_rank",
                           "kv": "split" | "replicated", "kv_heads_of_rank", "intermediate_per_rank",
                           "replicated", "source_graph", "collective",
                           "plan": [{"step": "segment", "index", "kind", "layer", "graphs": [per rank]}
                                    | {"step": "all_reduce", "op": "sum", "input", "output", "after"}]},
      "history": [{"pass", "index", "options", "modified", "report"}]
    }

Timings live only in report.json / report.md so that two builds of one recipe give identical
manifests.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from vlmc import __version__, limits, manifest_schema, parsing
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "vlmc.json"

# Roles a graph can play; the runtime and backends dispatch on these, never on file names.
ROLES = ("vision", "fusion", "embed", "decoder", "vlm")
KV_LAYOUTS = ("contiguous", "paged")
PRECISIONS = ("fp32", "fp16", "int8", "int8_weight_only", "int4_weight_only", "mixed")

_REQUIRED = {
    "model": ("family", "architecture", "source", "config_hash"),
    "vision": ("image_size", "tokens_per_image", "image_token_id", "preprocess"),
    "text": ("vocab_size", "eos_token_id"),
    "kv": ("layers", "kv_heads", "head_dim", "layout"),
}


def new(family: str, architecture: str, source: str, config_hash: str) -> dict:
    """An empty manifest for an exporter to fill in."""
    return {
        "format_version": FORMAT_VERSION,
        "vlmc_version": __version__,
        "model": {
            "family": family,
            "architecture": architecture,
            "source": source,
            "config_hash": config_hash,
        },
        "vision": {},
        "text": {},
        "kv": {},
        "graphs": {},
        "pipeline": {},
        "history": [],
    }


def validate(m: Any, where: str = "vlmc.json") -> dict:
    """Check a manifest's structure and internal consistency; raise a one-line VlmcError if broken."""
    try:
        return _validate(m, where)
    except VlmcError as exc:
        text = str(exc)
        if "\n" in text or "\r" in text:  # a key with a line break: keep the error on one line
            raise VlmcError(text.replace("\r", "\\r").replace("\n", "\\n")) from None
        raise


def _validate(m: Any, where: str) -> dict:
    if not isinstance(m, dict):
        raise VlmcError(f"{where}: manifest must be a JSON object")
    version = m.get("format_version")
    if not isinstance(version, int):
        raise VlmcError(f"{where}: missing integer format_version")
    if version > FORMAT_VERSION:
        raise VlmcError(
            f"{where}: format version {version} is newer than this vlmc supports ({FORMAT_VERSION}); upgrade vlmc"
        )
    for section, keys in _REQUIRED.items():
        sec = m.get(section)
        if not isinstance(sec, dict):
            raise VlmcError(f"{where}: section {section!r} is missing or not an object")
        for k in keys:
            if k not in sec:
                raise VlmcError(f"{where}: {section}.{k} is missing")
    graphs = m.get("graphs")
    if not isinstance(graphs, dict) or not graphs:
        raise VlmcError(f"{where}: 'graphs' must name at least one graph")
    for name, g in graphs.items():
        if not isinstance(g, dict):
            raise VlmcError(f"{where}: graphs.{name} must be an object")
        for k in ("file", "role", "inputs", "outputs", "precision"):
            if k not in g:
                raise VlmcError(f"{where}: graphs.{name}.{k} is missing")
        if g["role"] not in ROLES:
            raise VlmcError(f"{where}: graphs.{name}.role {g['role']!r} is not one of {', '.join(ROLES)}")
        if (
            not isinstance(g["file"], str)
            or "/" in g["file"]
            or "\\" in g["file"]
            or g["file"].startswith(".")
        ):
            raise VlmcError(f"{where}: graphs.{name}.file must be a plain file name inside the package")
        for io in ("inputs", "outputs"):
            if not isinstance(g[io], list) or not all(isinstance(e, dict) and "name" in e for e in g[io]):
                raise VlmcError(f"{where}: graphs.{name}.{io} must be a list of {{name, dtype, shape}}")
    kv = m["kv"]
    if kv["layout"] not in KV_LAYOUTS:
        raise VlmcError(f"{where}: kv.layout {kv['layout']!r} is not one of {', '.join(KV_LAYOUTS)}")
    if kv["layout"] == "paged" and not isinstance(kv.get("block_size"), int):
        raise VlmcError(f"{where}: kv.layout is paged but kv.block_size is not set")
    pipeline = m.get("pipeline")
    if not isinstance(pipeline, dict):
        raise VlmcError(f"{where}: 'pipeline' must be an object")
    for key, value in pipeline.items():
        names = value if isinstance(value, list) else [value]
        for n in names:
            if n is not None and not isinstance(n, str):
                raise VlmcError(f"{where}: pipeline.{key} must name graphs (strings), got {type(n).__name__}")
            if n is not None and n not in graphs:
                raise VlmcError(
                    f"{where}: pipeline.{key} names graph {n!r}, which the manifest does not list"
                )
    if not isinstance(m.get("history", []), list):
        raise VlmcError(f"{where}: 'history' must be a list")
    # Every field typed and bounded (vlmc/manifest_schema.py, docs/manifest.schema.json).
    manifest_schema.check(m, where)
    return m


def dumps(m: dict) -> str:
    """Serialize deterministically (sorted keys, fixed indentation)."""
    return json.dumps(m, indent=2, sort_keys=True) + "\n"


def loads(text: str, where: str = "vlmc.json") -> dict:
    if len(text) > limits.MAX_MANIFEST_BYTES:
        raise VlmcError(f"{where}: {len(text)} characters, above the {limits.MAX_MANIFEST_BYTES} limit")
    m = parsing.load_json(text, where)  # depth, integer digits, NaN (vlmc/parsing.py)
    return validate(m, where)
