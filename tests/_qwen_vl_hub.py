"""Narrow random-weight copies of the Qwen/Qwen-VL-Chat hub repository, built in code (no hub access).

config.json is the published one (as mirrored on GitHub in x1ngzai/Qwen-VL-Chat-Int4, without its GPTQ
quantization_config, fp32 set instead of fp16) with the sizes narrowed; the weights are under the published names
(vlmc.exporters.qwen_vl.to_hub_state_dict); qwen.tiktoken is a small rank file trained here on a fixed text with
the published split pattern, so the special tokens (and visual.image_start_id) sit right after its ranks, as in the
real file. generation_config.json and tokenizer_config.json are the published ones.
"""

from __future__ import annotations

import base64
import collections
import json
import random
from pathlib import Path

import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is in this picture? Describe the image in detail. "
    "There is a cat on the table, and 12 apples next to 3 oranges. 图片里有什么？这是一只猫。你好，世界！ "
    "I'm sure you'll see it's there; they've said we'd go. Picture 1: <img> user assistant system\n\n"
    "You are a helpful assistant.\n    indented code = [1, 2, 3]\n\tTabs\tand  double  spaces!!! ok?"
)

PUBLISHED_CONFIG = {
    "architectures": ["QWenLMHeadModel"],
    "attn_dropout_prob": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_qwen.QWenConfig",
        "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
    },
    "bf16": False,
    "emb_dropout_prob": 0.0,
    "fp16": False,
    "fp32": True,
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 22016,
    "kv_channels": 128,
    "layer_norm_epsilon": 1e-06,
    "max_position_embeddings": 8192,
    "model_type": "qwen",
    "no_bias": True,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "onnx_safe": None,
    "rotary_emb_base": 10000,
    "rotary_pct": 1.0,
    "scale_attn_weights": True,
    "seq_length": 2048,
    "tie_word_embeddings": False,
    "tokenizer_type": "QWenTokenizer",
    "use_cache": True,
    "use_dynamic_ntk": True,
    "use_flash_attn": False,
    "use_logn_attn": True,
    "visual": {
        "heads": 16,
        "image_size": 448,
        "image_start_id": 151857,
        "layers": 48,
        "mlp_ratio": 4.9231,
        "output_dim": 4096,
        "patch_size": 14,
        "width": 1664,
    },
    "vocab_size": 151936,
}
GENERATION_CONFIG = {
    "chat_format": "chatml",
    "eos_token_id": 151643,
    "pad_token_id": 151643,
    "max_window_size": 6144,
    "max_new_tokens": 512,
    "do_sample": True,
    "top_k": 0,
    "top_p": 0.5,
}
TOKENIZER_CONFIG = {
    "model_max_length": 8192,
    "tokenizer_class": "QWenTokenizer",
    "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]},
}


def train_ranks(text: str = CORPUS, merges: int = 300, seed: int = 0) -> dict[bytes, int]:
    """A byte-level BPE rank table trained on ``text`` with Qwen's split pattern; the 256 single bytes get their
    ranks in a shuffled order (as in real tiktoken files, where rank != byte value)."""
    import regex

    from vlmc.exporters.qwen_vl_tokenizer import PAT_STR

    order = list(range(256))
    random.Random(seed).shuffle(order)
    ranks = {bytes([b]): i for i, b in enumerate(order)}
    words = [[bytes([b]) for b in w.encode("utf-8")] for w in regex.findall(PAT_STR, text)]
    for _ in range(merges):
        counts = collections.Counter(p for w in words for p in zip(w, w[1:]))
        if not counts:
            break
        (a, b), _n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return ranks


def ranks_file(ranks: dict[bytes, int]) -> bytes:
    return b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for t, r in ranks.items())


def narrow_config(n_ranks: int, layers: int = 2, vision_layers: int = 2) -> dict:
    cfg = json.loads(json.dumps(PUBLISHED_CONFIG))
    cfg.update(
        hidden_size=256,
        intermediate_size=512,
        kv_channels=64,
        num_attention_heads=4,
        num_hidden_layers=layers,
    )
    cfg["initializer_range"] = 0.2
    # tokenization_qwen: <img> is special token 214 (3 + 205 extras + 6 ref/box/quad tags) after the ranks
    cfg["visual"].update(
        heads=4, layers=vision_layers, output_dim=256, width=64, image_start_id=n_ranks + 214
    )
    # no padding rows past the last special token (the published 151936 pads 151860 ids): a random-weight model
    # may emit any id, and the remote tokenizer's decode (in model.chat) fails on an id it does not know
    cfg["vocab_size"] = n_ranks + 217
    return cfg


def write_hub_copy(
    out: Path,
    seed: int = 0,
    layers: int = 2,
    vision_layers: int = 2,
    dtype: torch.dtype | None = None,
    shards: int = 1,
) -> Path:
    """Write a narrow random-weight copy of the repository (config, generation and tokenizer files, weights).

    ``layers`` / ``vision_layers``: the decoder's and the ViT's depth; ``dtype``: the weights' (the published
    checkpoint is bf16); ``shards`` > 1 splits the weights over that many files with a
    ``model.safetensors.index.json``, as the hub's are."""
    from safetensors.torch import save_file

    from vlmc.exporters import qwen_vl

    out.mkdir(parents=True, exist_ok=True)
    ranks = train_ranks()
    cfg = narrow_config(len(ranks), layers, vision_layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    (out / "qwen.tiktoken").write_bytes(ranks_file(ranks))
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = qwen_vl.build_tiny(qwen_vl.QwenVLConfig(**{k: v for k, v in cfg.items() if k != "auto_map"}))
    finally:
        torch.random.set_rng_state(state)
    weights = qwen_vl.to_hub_state_dict(model)
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    names = sorted(weights)
    weight_map = {}
    for n in range(shards):
        shard = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        part = names[n::shards]
        save_file({k: weights[k] for k in part}, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in weights.values())}}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({**index, "weight_map": weight_map}, indent=2)
    )
    return out
