"""Real-format Qwen3-VL and GLM-4.1V model directories built offline (test helper).

Each directory is a random-weight model saved beside a tokenizer trained here with `tokenizers` in the hub
checkpoint's format (class, special tokens and their ids order, chat template) and the family's image
processor settings, so vlmc loads it through the directory's own AutoProcessor like a downloaded one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from _real_tokenizers import QWEN_SPECIALS, QWEN_SPLIT, byte_level_bpe

logger = logging.getLogger(__name__)

# Qwen3's added tokens after Qwen2-VL's (Qwen/Qwen3-VL-*-Instruct tokenizer_config.json): tool and FIM
# markers, and the thinking tags, which are added tokens but not special ones.
QWEN3_EXTRA_SPECIALS = [
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
QWEN3_NON_SPECIAL = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# Qwen3-VL's chat template shortened to images and text: unlike Qwen2-VL's, no default system turn.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- for message in messages %}"
    "{%- if message['role'] == 'system' and message['content'] is string %}"
    "{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}{%- if message['content'] is string %}"
    "{{- message['content'] }}{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2 / Qwen3 pre-tokenizer split (tokenizer.json of the Qwen checkpoints).


def qwen3_tokenizer():
    """A Qwen3-style byte-level BPE (NFC, Qwen split, ByteLevel) with Qwen3-VL's added tokens, as
    Qwen2TokenizerFast (the class Qwen3-VL's tokenizer_config names): eos <|im_end|>, pad <|endoftext|>."""
    from tokenizers import AddedToken, normalizers
    from transformers import Qwen2TokenizerFast

    tok = byte_level_bpe(QWEN_SPLIT, 420)
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN_SPECIALS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN3_NON_SPECIAL[:2]])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN3_EXTRA_SPECIALS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN3_NON_SPECIAL[2:]])
    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        padding_side="left",
        errors="replace",
    )


def qwen3_vl_dir(path: Path, seed: int = 1, config=None) -> Path:
    """Qwen3-VL (patch 16, merge 2: 32 px per token) with Qwen3VLProcessor files (8..64 merged tokens)."""
    import torch
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

    from vlmc.exporters import qwen3_vl

    tok = qwen3_tokenizer()
    cfg = config or qwen3_vl.tiny_qwen3_vl_config(
        vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    for key, token in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        setattr(cfg, key, tok.convert_tokens_to_ids(token))
    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(cfg).save_pretrained(path)
    v = cfg.vision_config
    factor = v.patch_size * v.spatial_merge_size
    # Qwen3-VL's processor settings (0.5 statistics, pixel bounds as `size`), bounds scaled down.
    image_proc = Qwen2VLImageProcessorPil(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        size={"shortest_edge": 8 * factor * factor, "longest_edge": 64 * factor * factor},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    # Saved file by file as the hub checkpoints are (Qwen3VLProcessor's video half needs torchvision).
    tok.save_pretrained(path)
    image_proc.save_pretrained(path)
    pc = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(dict(pc, processor_class="Qwen3VLProcessor")))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": QWEN3_VL_CHAT_TEMPLATE}))
    return path


# ---- GLM-4.1V ------------------------------------------------------------------------------------

# GLM-4's special tokens in their id order (zai-org/GLM-4.1V-9B-Thinking tokenizer_config.json, from 151329).
GLM_SPECIALS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<|begin_of_box|>",
    "<|end_of_box|>",
]

# GLM-4.1V's chat template shortened to images and text: [gMASK]<sop> once, role tags, no BOS from the
# tokenizer, the assistant turn opened with "<|assistant|>\n".
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}"
    "{%- elif msg.role == 'user' %}<|user|>{{ '\n' }}{%- if msg.content is string %}{{ msg.content }}{%- else %}"
    "{%- for item in msg.content %}{%- if item.type == 'image' or 'image' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- elif msg.role == 'assistant' %}<|assistant|>{{ '\n' + msg.content }}"
    "{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# GLM-4's pre-tokenizer split (tokenizer.json): digits in runs of up to three.
_GLM_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def glm4_tokenizer():
    """A GLM-4-style byte-level BPE with GLM-4.1V's special tokens, as PreTrainedTokenizerFast (the class the
    checkpoint names): eos and pad <|endoftext|>, no BOS (the chat template writes [gMASK]<sop>)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = byte_level_bpe(_GLM_SPLIT, 400)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in GLM_SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def glm4v_dir(path: Path, seed: int = 1) -> Path:
    """GLM-4.1V (patch 14, merge 2: 28 px per token) with Glm4vProcessor files (8..64 tokens per image)."""
    import torch
    from transformers import Glm4vForConditionalGeneration, Glm4vImageProcessorPil

    from vlmc.exporters import glm4v

    tok = glm4_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = glm4v.tiny_glm4v_config(vocab_size=len(tok), pad_token_id=eos)
    for key, token in (
        ("image_token_id", "<|image|>"),
        ("video_token_id", "<|video|>"),
        ("image_start_token_id", "<|begin_of_image|>"),
        ("image_end_token_id", "<|end_of_image|>"),
        ("video_start_token_id", "<|begin_of_video|>"),
        ("video_end_token_id", "<|end_of_video|>"),
    ):
        setattr(cfg, key, tok.convert_tokens_to_ids(token))
    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = eos, eos, None
    torch.manual_seed(seed)
    Glm4vForConditionalGeneration(cfg).save_pretrained(path)
    v = cfg.vision_config
    factor = v.patch_size * v.spatial_merge_size
    # The checkpoint's settings (CLIP statistics, bicubic, bounds counting both temporal frames), the upper
    # bound scaled down to 64 tokens.
    image_proc = Glm4vImageProcessorPil(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        size={"shortest_edge": 112 * 112, "longest_edge": 2 * 64 * factor * factor},
    )
    tok.save_pretrained(path)
    image_proc.save_pretrained(path)
    pc = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps(dict(pc, processor_class="Glm4vProcessor")))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": GLM4V_CHAT_TEMPLATE}))
    return path
