"""Real-format tokenizers and processors for the generic-tier families (test helper), built offline.

Like tests/_real_tokenizers.py: a small BPE trained with `tokenizers`, the transformers tokenizer class
the hub checkpoints use, their special tokens and processor settings (scaled down with the tiny models):

- LLaVA-NeXT (llava-hf/llava-v1.6-vicuna-7b-hf): LlamaTokenizerFast with <image>; LlavaNextProcessor with
  LlavaNextImageProcessor (shortest edge + center crop to the tile, grid pinpoints of 1x2, 2x1, 2x2, 3x1,
  1x3 tiles, CLIP statistics, bicubic), patch size, "default" features with one extra (CLS) token.
- LLaVA-OneVision (llava-hf/llava-onevision-qwen2-0.5b-ov-hf): Qwen2TokenizerFast with <image>/<video>;
  LlavaOnevisionImageProcessor (tiles resized to h x w, no crop, 0.5 statistics, pinpoints up to 3x3),
  num_image_tokens per tile, "full" features, vision_aspect_ratio anyres_max_N. The processor's video half
  needs torchvision: files are saved one by one as the hub has them (vlmc loads it images-only).
- Gemma3 (google/gemma-3-4b-it): GemmaTokenizer (SentencePiece-style BPE, byte fallback, <bos> 2,
  <start_of_turn>/<end_of_turn>, boi/eoi/image soft tokens as the tokenizer's extra special tokens);
  Gemma3Processor with Gemma3ImageProcessor (resize to the tower size, bilinear, 0.5 statistics), image_seq_length.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import _real_tokenizers

logger = logging.getLogger(__name__)

# llava-hf/llava-onevision-qwen2-*-ov-hf's chat template (images, then videos, then text, per turn).
ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}{{'<|im_end|>'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# google/gemma-3-*-it's chat template, shortened to user/model turns with images and text.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\\n' }}{% if message['content'] is string %}"
    "{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "{{ '<start_of_image>' }}{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}"
    "{% endif %}"
)

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def gemma_tokenizer():
    """A Gemma-style BPE (spaces as '▁', byte fallback, no dummy prefix) as transformers' GemmaTokenizer.

    Ids as in Gemma 3: 0 <pad>, 1 <eos>, 2 <bos>, 3 <unk>, 4 <mask>, then <start_of_turn>, <end_of_turn>, the
    byte pieces and merges; <start_of_image>, <end_of_image> and <image_soft_token> come last (the
    tokenizer's boi_token / eoi_token / image_token).
    """
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import GemmaTokenizer

    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainee = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trainee.normalizer = normalizers.Replace(" ", "▁")
    trainee.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    vocab, merges = _real_tokenizers._train_bpe(trainee, 440, GEMMA_SPECIALS + bytes_)
    tok = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        padding_side="left",
    )
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken(t, normalized=False, special=True) for t in GEMMA_SPECIALS[5:]
            ]
        }
    )
    return tok


def _text_ids(tok) -> dict:
    return dict(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


def llava_next_dir(path: Path, seed: int = 1) -> Path:
    import torch
    from transformers import LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil, LlavaNextProcessor

    from vlmc.exporters.llava_next import tiny_llava_next_config

    tok = _real_tokenizers.llama_tokenizer()
    cfg = tiny_llava_next_config(**_text_ids(tok))
    cfg.image_token_index = tok.convert_tokens_to_ids("<image>")
    cfg.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    LlavaNextForConditionalGeneration(cfg).save_pretrained(path)
    tile = cfg.vision_config.image_size
    proc = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(
            size={"shortest_edge": tile},
            crop_size={"height": tile, "width": tile},
            image_grid_pinpoints=cfg.image_grid_pinpoints,
            # not CLIP's: the package must take them from the source processor
            image_mean=[0.5, 0.45, 0.4],
            image_std=[0.25, 0.3, 0.35],
            resample=3,
        ),
        tokenizer=tok,
        patch_size=cfg.vision_config.patch_size,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        num_additional_image_tokens=1,
        chat_template=_real_tokenizers.LLAVA_CHAT_TEMPLATE,
    )
    proc.save_pretrained(path)
    return path


def onevision_tokenizer():
    from tokenizers import AddedToken

    tok = _real_tokenizers.qwen2_tokenizer()
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken(t, normalized=False, special=True) for t in ("<image>", "<video>")
            ]
        }
    )
    return tok


def llava_onevision_dir(path: Path, seed: int = 1, max_tiles: int = 4) -> Path:
    import torch
    from transformers import LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessorPil

    from vlmc.exporters.llava_onevision import tiny_llava_onevision_config

    tok = onevision_tokenizer()
    ids = _text_ids(tok)
    ids["eos_token_id"] = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = tiny_llava_onevision_config(**ids)
    cfg.vision_aspect_ratio = f"anyres_max_{max_tiles}"
    cfg.image_token_index = tok.convert_tokens_to_ids("<image>")
    cfg.video_token_index = tok.convert_tokens_to_ids("<video>")
    torch.manual_seed(seed)
    LlavaOnevisionForConditionalGeneration(cfg).save_pretrained(path)
    tile = cfg.vision_config.image_size
    LlavaOnevisionImageProcessorPil(
        size={"height": tile, "width": tile},
        image_grid_pinpoints=cfg.image_grid_pinpoints,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        resample=3,
    ).save_pretrained(path)
    tok.save_pretrained(path)
    pc = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(
        json.dumps(dict(pc, processor_class="LlavaOnevisionProcessor"))
    )
    side = tile // cfg.vision_config.patch_size
    (path / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "LlavaOnevisionProcessor",
                "num_image_tokens": side * side,
                "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
                "vision_aspect_ratio": cfg.vision_aspect_ratio,
            }
        )
    )
    (path / "chat_template.json").write_text(json.dumps({"chat_template": ONEVISION_CHAT_TEMPLATE}))
    return path


def gemma3_dir(path: Path, seed: int = 1) -> Path:
    import torch
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    from vlmc.exporters import gemma3 as G3

    tok = gemma_tokenizer()
    cfg = G3.tiny_gemma3_config(**_text_ids(tok))
    cfg.image_token_id = tok.image_token_id
    cfg.boi_token_id = tok.boi_token_id
    cfg.eoi_token_id = tok.eoi_token_id
    torch.manual_seed(seed)
    G3.build_tiny(cfg).save_pretrained(path)
    size = cfg.vision_config.image_size
    proc = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(
            size={"height": size, "width": size},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
            resample=2,
        ),
        tokenizer=tok,
        image_seq_length=cfg.mm_tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    proc.save_pretrained(path)
    return path
