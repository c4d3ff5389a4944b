"""Narrow random-weight copies of the microsoft/Phi-3-vision-128k-instruct hub repository, built in code (no hub).

config.json is the published one (as listed in sdpython/onnx-diagnostic's untrained-model configs, which cite
huggingface.co/microsoft/Phi-3-vision-128k-instruct/blob/main/config.json) with the sizes narrowed and the long-rope
factors cut to the narrow head_dim / 2; the CLIP tower's widths, which the remote code takes from a constant
(ViT-L/14-336), are narrowed through vlmc's ``img_processor.vision_config`` key. preprocessor_config.json is the
published one (the g1y5x3/vlm-study copy) with num_crops 4 instead of 16. The tokenizer is a Llama-style
SentencePiece BPE trained here (tests/_real_tokenizers.py) with Phi-3's chat tokens added after it, and a
tokenizer_config.json in the published form (LlamaTokenizer, add_bos_token, the chat template). The weights are
under the published names (vlmc.exporters.phi3_v.to_hub_state_dict).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vlmc.exporters import phi3_v

PUBLISHED_CONFIG = {
    "_name_or_path": "Phi-3-vision-128k-instruct",
    "architectures": ["Phi3VForCausalLM"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_phi3_v.Phi3VConfig",
        "AutoModelForCausalLM": "modeling_phi3_v.Phi3VForCausalLM",
    },
    "bos_token_id": 1,
    "embd_layer": {
        "embedding_cls": "image",
        "hd_transform_order": "sub_glb",
        "projection_cls": "mlp",
        "use_hd_transform": True,
        "with_learnable_separator": True,
    },
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "img_processor": {
        "image_dim_out": 1024,
        "model_name": "openai/clip-vit-large-patch14-336",
        "name": "clip_vision_model",
        "num_img_tokens": 144,
    },
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "model_type": "phi3_v",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    # the published 48 factors each; the first 8 (narrow head_dim 16 / 2) are kept below
    "rope_scaling": {
        "long_factor": list(phi3_v.PUBLISHED_LONG),
        "short_factor": list(phi3_v.PUBLISHED_SHORT),
        "type": "su",
    },
    "rope_theta": 10000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.38.1",
    "use_cache": True,
    "vocab_size": 32064,
    "_attn_implementation": "flash_attention_2",
}
NARROW = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "torch_dtype": "float32",
    "_attn_implementation": "eager",
}
NARROW_CLIP = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 3,
    "projection_dim": 32,
}
PREPROCESSOR_CONFIG = {
    "auto_map": {
        "AutoProcessor": "processing_phi3_v.Phi3VProcessor",
        "AutoImageProcessor": "image_processing_phi3_v.Phi3VImageProcessor",
    },
    "num_crops": 4,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "Phi3VImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "Phi3VProcessor",
    "num_img_tokens": 144,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt and messages[-1]['role'] != 'assistant' %}{{- '<|assistant|>\n' -}}"
    "{% endif %}"
)
PHI_TOKENS = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]


def tokenizer():
    """The trained Llama-style tokenizer (tokenizers object) with Phi-3's chat tokens after its vocabulary."""
    from _real_tokenizers import llama_tokenizer
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(llama_tokenizer().backend_tokenizer.to_str())
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in PHI_TOKENS])
    return tok


def _legacy_merges(text: str) -> str:
    """tokenizer.json with its BPE merges as "a b" strings, the form of the published file: the tokenizers 0.19
    that transformers 4.44 pins (the remote-reference venv) reads no other, and today's reads both."""
    data = json.loads(text)
    data["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return json.dumps(data, ensure_ascii=False)


def write_hub_copy(
    path: Path,
    seed: int = 3,
    vision_layers: int = NARROW_CLIP["num_hidden_layers"],
    dtype: torch.dtype | None = None,
    shards: int = 1,
    **config_over,
) -> Path:
    """A directory laid out as the hub repository (without its Python files), narrow random weights.

    ``vision_layers``: the CLIP tower's depth (its last layer, past ``layer_idx`` -2, is unused); ``dtype``: the
    weights' (the published checkpoint is bf16); ``shards`` > 1 splits the weights over that many files with a
    ``model.safetensors.index.json``, as the hub's are; ``config_over``: config.json keys."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    (path / "tokenizer.json").write_text(_legacy_merges(tok.to_str()))
    specials = {t: tok.token_to_id(t) for t in PHI_TOKENS}
    cfg = json.loads(json.dumps(PUBLISHED_CONFIG))
    cfg.update(NARROW)
    cfg["img_processor"]["image_dim_out"] = NARROW_CLIP["hidden_size"]
    cfg["img_processor"]["vision_config"] = {**NARROW_CLIP, "num_hidden_layers": vision_layers}
    cfg["vocab_size"] = tok.get_vocab_size() + 8  # padded past the tokenizer, as 32064 is past 32011
    cfg.update(config_over)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": "<s>",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<unk>",
                "legacy": False,
                "model_max_length": 131072,
                "padding_side": "right",
                "tokenizer_class": "LlamaTokenizer",
                "processor_class": "Phi3VProcessor",
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 1,
                "eos_token_id": [specials["<|endoftext|>"], specials["<|end|>"]],
                "pad_token_id": specials["<|endoftext|>"],
            }
        )
    )
    config = phi3_v.Phi3VConfig(**{k: v for k, v in cfg.items() if k not in ("auto_map", "architectures")})
    config.image_token_id = 0
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = phi3_v.build_tiny(config)
    finally:
        torch.random.set_rng_state(state)
    weights = phi3_v.to_hub_state_dict(model, full_depth=vision_layers)
    if dtype is not None:
        weights = {k: v.to(dtype) for k, v in weights.items()}
    if shards <= 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(weights)
    weight_map = {}
    for n in range(shards):
        shard = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        part = names[n::shards]
        save_file({k: weights[k] for k in part}, str(path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(v.numel() * v.element_size() for v in weights.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return path
