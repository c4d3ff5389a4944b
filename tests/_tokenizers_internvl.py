"""An InternVL "-hf" model directory built offline: random weights, real-format tokenizer and processor files.

The tokenizer is what OpenGVLab/InternVL3-1B-hf ships: Qwen2.5-VL's byte-level BPE (Qwen2Tokenizer) with its
special tokens, then InternVL's <img>, </img>, <IMG_CONTEXT>, <quad>... and the processor's named tokens
(``extra_special_tokens``: start/end/context image token, video token), as transformers'
convert_internvl_weights_to_hf.py writes them. The image processor is GotOcr2's with the checkpoints'
ImageNet statistics; tiles are 64 px here (the model's tile size) but the tiling rule is the real one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import _real_tokenizers

logger = logging.getLogger(__name__)

# Qwen2.5-VL's special tokens (ids 151643.. in the real vocabulary), then InternVL's additions.
QWEN25_SPECIALS = _real_tokenizers.QWEN_SPECIALS + [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
INTERNVL_SPECIALS = [
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
]
NAMED_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

# The -hf checkpoints' chat template (convert_internvl_weights_to_hf.py): one "<IMG_CONTEXT>\n" per image.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['content'] is "
    "string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] "
    "== 'image' %}{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif "
    "content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)


def internvl_tokenizer():
    """Qwen2Tokenizer (the class InternVL3-hf's tokenizer_config names) with InternVL's special tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    tok = _real_tokenizers.byte_level_bpe(_real_tokenizers.QWEN_SPLIT, 420)
    specials = QWEN25_SPECIALS + INTERNVL_SPECIALS + ["<video>"]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return Qwen2Tokenizer(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=8192,
        extra_special_tokens=dict(NAMED_TOKENS),
    )


def internvl_dir(path: Path, seed: int = 1, max_patches: int = 6, tie: bool = False) -> Path:
    """InternVLForConditionalGeneration (64 px tiles, 16 tokens a tile) with InternVLProcessor files.

    Saved file by file as the hub checkpoints are (InternVLProcessor cannot be built here: its video
    processor needs torchvision; vlmc loads it images-only). preprocessor_config.json says
    GotOcr2ImageProcessorFast and crop_to_patches false, as the hub's does; the processor's own default
    (crop_to_patches true) is what applies.
    """
    import torch
    from transformers import GotOcr2ImageProcessorPil, InternVLForConditionalGeneration

    from vlmc.exporters import internvl

    tok = internvl_tokenizer()
    cfg = internvl.tiny_internvl_config(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=tie,
    )
    cfg.image_token_id = tok.convert_tokens_to_ids("<IMG_CONTEXT>")
    cfg.tie_word_embeddings = tie
    torch.manual_seed(seed)
    InternVLForConditionalGeneration(cfg).save_pretrained(path)
    tile = cfg.vision_config.image_size[0]
    tok.save_pretrained(path)
    GotOcr2ImageProcessorPil(
        size={"height": tile, "width": tile},
        image_mean=internvl.IMAGENET_MEAN,
        image_std=internvl.IMAGENET_STD,
        max_patches=max_patches,
        min_patches=1,
    ).save_pretrained(path)
    pc = json.loads((path / "preprocessor_config.json").read_text())
    pc.update(
        processor_class="InternVLProcessor",
        image_processor_type="GotOcr2ImageProcessorFast",
        crop_to_patches=False,
    )
    (path / "preprocessor_config.json").write_text(json.dumps(pc, indent=2))
    (path / "processor_config.json").write_text(
        json.dumps(
            {"processor_class": "InternVLProcessor", "image_seq_length": cfg.image_seq_length}, indent=2
        )
    )
    (path / "chat_template.json").write_text(json.dumps({"chat_template": INTERNVL_CHAT_TEMPLATE}))
    return path
