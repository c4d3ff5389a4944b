"""Manifest facts several family exporters write the same way: CLIP normalization and the KV cache."""

from __future__ import annotations

import logging

from vlmc import paths

logger = logging.getLogger(__name__)

# OPENAI CLIP image statistics: the processors' defaults when a source has no image processor settings.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def kv_facts(text_config) -> dict:
    """The manifest's ``kv`` section for a transformers text config: a contiguous float32 cache.

    Configs without ``num_key_value_heads`` (e.g. OPT) have no grouped-query attention, and those
    without ``head_dim`` split the hidden size evenly over the heads.
    """
    heads = int(text_config.num_attention_heads)
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return {
        "layers": int(text_config.num_hidden_layers),
        "kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "layout": "contiguous",
        "block_size": None,
        "dtype": "float32",
    }


def text_facts(config, text_config, **family) -> dict:
    """The manifest's ``text`` section from a VLM config and its text config; ``family`` adds or
    overrides the family's own facts (prompt template, image marker, position kind...)."""
    t = text_config

    def token(name: str):
        # Some text configs (GLM-4.1V's) carry no special ids; the VLM config does.
        value = getattr(t, name, None)
        return value if value is not None else getattr(config, name, None)

    pad = t.pad_token_id if hasattr(t, "pad_token_id") else getattr(config, "pad_token_id", None)
    facts = {
        "vocab_size": int(t.vocab_size),
        "eos_token_id": token("eos_token_id"),
        # as before for text configs that have the field (even when it is None)
        "bos_token_id": t.bos_token_id if hasattr(t, "bos_token_id") else token("bos_token_id"),
        "pad_token_id": pad if pad is not None else 0,
        "max_positions": int(t.max_position_embeddings),
        "hidden_size": int(t.hidden_size),
        "intermediate_size": getattr(t, "intermediate_size", None),
        "tokenizer": "bytes",
        "position": "1d",
        "add_bos": True,
        **family,
    }
    notes = []
    facts["eos_token_id"] = usable_eos(facts["eos_token_id"], facts["vocab_size"], notes)
    bos = facts["bos_token_id"]
    if bos is not None and not _in_vocab(bos, facts["vocab_size"]):
        # A class default past a small vocabulary (Qwen2-VL's 151643): no tokenizer of this model emits it.
        notes.append(f"bos_token_id {bos} is outside the vocabulary: not used")
        facts["bos_token_id"] = None
    if notes:
        logger.warning("text config (vocabulary 0 to %d): %s", facts["vocab_size"] - 1, "; ".join(notes))
    return facts


def _in_vocab(token, vocab_size: int) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size


def usable_eos(eos, vocab_size: int, notes: list[str]):
    """The EOS ids generation can stop on: those of the vocabulary (a model never emits an id past its
    logits, so dropping one changes no generated token), or None when none is left: then generation stops
    at max_new_tokens, as transformers' does. ``notes`` gets what was dropped, for the export's warning."""
    ids = list(eos) if isinstance(eos, list | tuple) else ([] if eos is None else [eos])
    kept = [int(i) for i in ids if _in_vocab(i, vocab_size)]
    dropped = [i for i in ids if not _in_vocab(i, vocab_size)]
    if dropped:
        shown = dropped if len(dropped) > 1 else dropped[0]
        notes.append(f"eos_token_id {shown} is outside the vocabulary")
    if not kept:
        notes.append(f"{'no usable' if ids else 'no'} eos_token_id: generation stops at max_new_tokens")
        return None
    return kept if isinstance(eos, list | tuple) else kept[0]


# PILImageResampling's values as preprocessor_config.json writes them (transformers.image_utils)
PIL_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def normalization(pc: dict, mean=CLIP_MEAN, std=CLIP_STD, resample: int = 3) -> dict:
    """The mean, std, rescale factor and resampling an image processor config states (else the defaults)."""
    return {
        "mean": pc.get("image_mean", mean),
        "std": pc.get("image_std", std),
        "rescale_factor": pc.get("rescale_factor", 1 / 255),
        "resample": PIL_RESAMPLE.get(pc.get("resample", resample), PIL_RESAMPLE[resample]),
    }


def image_processor_config(directory) -> dict | None:
    """The source's image processor settings: preprocessor_config.json, or (transformers 5 saves processors
    that way) the ``image_processor`` entry of processor_config.json; None when it has neither."""
    if directory is None:
        return None
    settings = paths.model_json(directory, "preprocessor_config.json")
    if settings is not None:
        return settings
    processor = paths.model_json(directory, "processor_config.json")
    nested = None if processor is None else processor.get("image_processor")
    return nested if isinstance(nested, dict) else None
