"""Real-format tokenizers and processors built offline, saved beside random-weight models (test helper).

Each builder trains a small BPE with the `tokenizers` library on a fixed corpus, wraps it in the transformers
tokenizer class the real checkpoints use, and saves the family's processor with it, so the directories look
like hub checkpoints (tokenizer.json, tokenizer_config.json, processor/preprocessor configs, chat template).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

# Text the tokenizers are trained on: chat words, newlines and punctuation, so prompts split into real merges.
CORPUS = [
    "USER: What is shown in this picture? ASSISTANT: A red circle on a blue square.",
    "Describe the image in detail.\nThe image shows a green triangle and a yellow circle.",
    "What colour is the large circle here? It is red, the small one is blue.",
    "Compare the two pictures.\nThe first one is brighter than the second one.",
    "Question: how many shapes are there? Answer: there are three shapes.",
    "system\nYou are a helpful assistant.\nuser\nWhat is in the image?\nassistant\nA picture.",
] * 4

# The LLaVA-1.5 chat template (llava-hf/llava-1.5-7b-hf): images first, then text, "ASSISTANT:" to answer.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != "
    "'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# The Qwen2-VL chat template, shortened to images and text (Qwen/Qwen2-VL-2B-Instruct has the same layout).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and "
    "message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or "
    "'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def _train_bpe(tok, vocab_size: int, specials: list[str], **trainer_kw):
    from tokenizers import trainers

    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False, **trainer_kw
    )
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    return data["model"]["vocab"], [
        tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]
    ]


def llama_tokenizer(legacy: bool = False, metaspace: str | None = None):
    """A Llama-style SentencePiece BPE (byte fallback, '▁' for spaces), as LlamaTokenizerFast.

    Ids follow Llama: 0 <unk>, 1 <s>, 2 </s>, 3..258 the byte-fallback pieces, then merges; LLaVA-1.5 adds
    <image> and <pad> after the vocabulary. ``legacy`` is LlamaTokenizer's flag (tokenizer_config.json).

    tokenizer.json comes in llava-1.5-7b-hf's format by default: a Prepend('▁') + Replace(' ', '▁')
    normalizer, which prepends '▁' to the text after *every* special token (the legacy behaviour: the lone
    '▁', 29871, between <image> and '\n'), while its tokenizer_config says ``legacy: false``. transformers
    runs the file as it is when it loads the model directory, but the LlamaTokenizer class, which takes
    over where the directory has no config.json, rebuilds a Metaspace pipeline from the flag and drops that
    '▁'. ``metaspace`` ("always" / "first") writes the newer format instead, a Metaspace pre-tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import LlamaTokenizerFast

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainee = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Trained split at '▁' (SentencePiece pieces never span words); "\n" is left out of the vocabulary so it
    # falls back to its byte piece <0x0A> (13 in Llama), as in the real one.
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    vocab, merges = _train_bpe(trainee, 420, specials)
    merges = [m for m in merges if "\n" not in m[0] + m[1]]
    kept = sorted((i, t) for t, i in vocab.items() if "\n" not in t)
    vocab = {t: n for n, (_, t) in enumerate(kept)}
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    if metaspace is None:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=metaspace, split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.add_special_tokens([AddedToken("<image>", normalized=False, special=True)])
    tok.add_special_tokens([AddedToken("<pad>", normalized=False, special=True)])
    return LlamaTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        legacy=legacy,
        add_bos_token=True,
        add_eos_token=False,
        padding_side="left",
    )


# Qwen2's pre-tokenizer split (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and InternVL's Qwen2 tokenizer use it).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def byte_level_bpe(split: str, vocab_size: int):
    """A byte-level BPE (``split`` regex, then ByteLevel) trained on the corpus, as a tokenizers.Tokenizer
    with its decoder and no special tokens yet: the model part of the Qwen- and GLM-style tokenizers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainee = Tokenizer(models.BPE())
    trainee.pre_tokenizer = pre
    vocab, merges = _train_bpe(trainee, vocab_size, [], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    return tok


def qwen2_tokenizer():
    """A Qwen2-style byte-level BPE with Qwen2-VL's special tokens, as Qwen2TokenizerFast."""
    from tokenizers import AddedToken
    from transformers import Qwen2TokenizerFast

    tok = byte_level_bpe(QWEN_SPLIT, 420)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN_SPECIALS])
    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        padding_side="left",
    )


def opt_tokenizer():
    """A GPT-2/OPT byte-level BPE (OPT: </s> is BOS and EOS, <pad> 1), as GPT2TokenizerFast."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import GPT2TokenizerFast

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainee = Tokenizer(models.BPE())
    trainee.pre_tokenizer = pre
    vocab, merges = _train_bpe(
        trainee, 400, ["<s>", "<pad>", "</s>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in ("<s>", "<pad>", "</s>", "<unk>")]
    )
    return GPT2TokenizerFast(
        tokenizer_object=tok,
        bos_token="</s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        add_bos_token=True,
        padding_side="left",
    )


def image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A random uint8 RGB picture (HWC)."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def save_image(path: Path, h: int, w: int, seed: int = 0) -> str:
    from PIL import Image

    Image.fromarray(image(h, w, seed)).save(path)
    return str(path)


# ---- model directories: random weights + real-format tokenizer and processor -------------------


def llava_dir(
    path: Path,
    legacy: bool = False,
    metaspace: str | None = None,
    hidden: int = 64,
    seed: int = 1,
    text_layers: int | None = None,
    vision_layers: int | None = None,
    save_kwargs: dict | None = None,
    qwen2_text: bool = False,
) -> Path:
    """LlavaForConditionalGeneration (CLIP 64 px, patch 8: 64 image tokens) with LlavaProcessor files.

    The tokenizer files are llava-1.5-7b-hf's format by default (see llama_tokenizer). ``text_layers``
    and ``vision_layers`` change the depths; ``save_kwargs`` go to save_pretrained (max_shard_size),
    with ``dtype`` applied to the model before saving. ``qwen2_text``: the text config is a Qwen2Config
    with no eos_token_id (its class default, None)."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaForConditionalGeneration, LlavaProcessor

    from vlmc.exporters import zoo

    tok = llama_tokenizer(legacy, metaspace)
    image_id = tok.convert_tokens_to_ids("<image>")
    cfg = zoo.tiny_llava_config(
        vocab_size=len(tok),
        hidden_size=hidden,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    if qwen2_text:
        from transformers import Qwen2Config

        text = zoo._text_kwargs(
            vocab_size=len(tok),
            hidden_size=hidden,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
        )
        del text["eos_token_id"]
        cfg.text_config = Qwen2Config(**text)
        assert cfg.text_config.eos_token_id is None
    cfg.image_token_index = image_id
    cfg.pad_token_id = tok.pad_token_id
    if text_layers:
        cfg.text_config.num_hidden_layers = text_layers
    if vision_layers:
        cfg.vision_config.num_hidden_layers = vision_layers
    torch.manual_seed(seed)
    save_kwargs = dict(save_kwargs or {})
    dtype = save_kwargs.pop("dtype", None)
    model = LlavaForConditionalGeneration(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, **save_kwargs)
    size = cfg.vision_config.image_size
    # Not the defaults vlmc would assume (resize to the tower size, CLIP statistics, bicubic): the package
    # must take them from processor_config.json, where transformers 5 saves them.
    proc = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": size + 8},
            crop_size={"height": size, "width": size},
            image_mean=[0.5, 0.45, 0.4],
            image_std=[0.25, 0.3, 0.35],
            resample=2,
        ),
        tokenizer=tok,
        patch_size=cfg.vision_config.patch_size,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    proc.save_pretrained(path)
    cfg_path = path / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), legacy=legacy), indent=2))
    return path


def qwen2_vl_dir(path: Path, qwen25: bool = False, seed: int = 1, class_eos: bool = False) -> Path:
    """Qwen2-VL / Qwen2.5-VL (patch 8, merge 2) with Qwen2VLProcessor files (min 8, max 64 merged tokens).

    ``class_eos``: the text config keeps the class's bos/eos defaults (151643/151645), which lie outside
    this small vocabulary."""
    import torch
    from transformers import Qwen2VLImageProcessorPil

    from vlmc.exporters import qwen2_vl

    tok = qwen2_tokenizer()
    ids = {
        "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_token_id": tok.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>"),
    }
    text = dict(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    if class_eos:
        del text["eos_token_id"], text["bos_token_id"]
    cfg = (qwen2_vl.tiny_qwen2_5_vl_config if qwen25 else qwen2_vl.tiny_qwen2_vl_config)(**text)
    if class_eos:
        default = type(cfg.text_config)()
        cfg.text_config.eos_token_id, cfg.text_config.bos_token_id = (
            default.eos_token_id,
            default.bos_token_id,
        )
        assert cfg.text_config.eos_token_id == 151645
    for k, v in ids.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    qwen2_vl.model_class(cfg)(cfg).save_pretrained(path)
    v = cfg.vision_config
    factor = v.patch_size * v.spatial_merge_size
    image_proc = Qwen2VLImageProcessorPil(
        patch_size=v.patch_size,
        merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        min_pixels=8 * factor * factor,
        max_pixels=64 * factor * factor,
    )
    # Saved file by file as the hub checkpoints are: Qwen2VLProcessor cannot be built here, its video
    # processor needs torchvision (vlmc.exporters.processor loads it images-only).
    tok.save_pretrained(path)
    image_proc.save_pretrained(path)
    pc = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(
        json.dumps(dict(pc, processor_class="Qwen2_5_VLProcessor" if qwen25 else "Qwen2VLProcessor"))
    )
    (path / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_CHAT_TEMPLATE}))
    return path


def blip2_dir(path: Path, seed: int = 1) -> Path:
    """BLIP-2 + OPT (8 query tokens, 32 px images) with Blip2Processor files (GPT-2 byte-level BPE)."""
    import torch
    from transformers import Blip2Processor, BlipImageProcessorPil

    from vlmc.exporters import blip2

    tok = opt_tokenizer()
    cfg = blip2.tiny_blip2_config()
    proc = Blip2Processor(
        image_processor=BlipImageProcessorPil(
            size={"height": 32, "width": 32},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
            resample=2,
        ),
        tokenizer=tok,
        num_query_tokens=cfg.num_query_tokens,
    )
    tok = proc.tokenizer  # the processor adds <image> to the vocabulary
    cfg.text_config.vocab_size = len(tok)
    cfg.text_config.bos_token_id = tok.bos_token_id
    cfg.text_config.eos_token_id = tok.eos_token_id
    cfg.text_config.pad_token_id = tok.pad_token_id
    cfg.image_token_index = tok.convert_tokens_to_ids("<image>")
    torch.manual_seed(seed)
    blip2.build_tiny(cfg).save_pretrained(path)
    proc.save_pretrained(path)
    return path
