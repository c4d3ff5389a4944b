"""BLIP-2 family exporter (Blip2ForConditionalGeneration: ViT -> Q-Former + projection -> OPT decoder)."""

from __future__ import annotations

import logging

import torch

from vlmc import samples
from vlmc.errors import VlmcError
from vlmc.exporters import base, streaming, zoo
from vlmc.exporters._facts import (
    CLIP_MEAN,
    CLIP_STD,
    image_processor_config,
    kv_facts,
    normalization,
    text_facts,
)
from vlmc.package import Package

logger = logging.getLogger(__name__)

MODEL_TYPES = ("blip-2",)
ARCHITECTURES = ("Blip2ForConditionalGeneration",)
# The BLIP-2 processor puts the query placeholders ahead of the tokenized prompt (before BOS); the
# template only states that the image comes first, the manifest's image_tokens_first places it.
BLIP2_TEMPLATE = "<image>{prompt}"
DECODER_TEXT_TYPES = ("opt",)


def model_class():
    from transformers import Blip2ForConditionalGeneration

    return Blip2ForConditionalGeneration


def stream_depths(config) -> dict:
    """Layer stacks a streaming export cuts (vlmc/exporters/streaming.py): the OPT decoder, the ViT and
    the Q-Former.

    The vision graph is the tower's ``last_hidden_state`` (the last layer, then post_layernorm): two
    layers. Q-Former layer i cross-attends to the image only when i % cross_attention_frequency == 0
    (transformers' Blip2QFormerLayer), so its layers are of two kinds and the trace holds one of each
    after layer 0.
    """
    qformer = config.qformer_config
    every = int(qformer.cross_attention_frequency)
    kinds = ["cross" if i % every == 0 else "self" for i in range(int(qformer.num_hidden_layers))]
    return {
        **streaming.decoder_depths(config),
        **streaming.uniform_depth(config, "vision_config", "num_hidden_layers", streaming.TRACED_LAYERS),
        **streaming.uniform_depth(
            config, "qformer_config", "num_hidden_layers", streaming.TRACED_LAYERS, kinds=kinds
        ),
    }


class VisionWrapper(torch.nn.Module):
    """pixel_values [images, 3, H, W] -> vision_hidden_states [images, patches + 1, vision_hidden]."""

    def __init__(self, model) -> None:
        super().__init__()
        self.vision_model = model.vision_model

    def forward(self, pixel_values):
        return self.vision_model(pixel_values, return_dict=True).last_hidden_state


class FusionWrapper(torch.nn.Module):
    """vision_hidden_states -> image_features [images, num_query_tokens, text_hidden].

    Mirrors Blip2ForConditionalGeneration.get_image_features after the vision tower: the learned
    queries cross-attend to every vision token (all-ones mask), then the language projection.
    """

    def __init__(self, model) -> None:
        super().__init__()
        self.query_tokens = model.query_tokens
        self.qformer = model.qformer
        self.language_projection = model.language_projection

    def forward(self, vision_hidden_states):
        mask = torch.ones(vision_hidden_states.shape[:-1], dtype=torch.long)
        queries = self.query_tokens.expand(vision_hidden_states.shape[0], -1, -1)
        out = self.qformer(
            query_embeds=queries,
            encoder_hidden_states=vision_hidden_states,
            encoder_attention_mask=mask,
            return_dict=True,
        ).last_hidden_state
        return self.language_projection(out)


def preprocess_facts(config, directory) -> dict:
    """BlipImageProcessor: resize straight to (height, width), no crop; its settings win when the source has them."""
    size = int(config.vision_config.image_size)
    facts = {
        "kind": "resize",
        "size": [size, size],
        "mean": CLIP_MEAN,
        "std": CLIP_STD,
        "rescale_factor": 1 / 255,
        "resample": "bicubic",
    }
    pc = image_processor_config(directory)
    if pc is not None:
        s = pc.get("size", size)
        if isinstance(s, dict):
            facts["size"] = [
                int(s.get("height", s.get("shortest_edge", size))),
                int(s.get("width", s.get("shortest_edge", size))),
            ]
        else:
            facts["size"] = [int(s), int(s)]
        facts.update(normalization(pc))
    return facts


def _check_supported(source) -> None:
    cfg = source.config
    if (
        not getattr(cfg, "use_decoder_only_language_model", False)
        or cfg.text_config.model_type not in DECODER_TEXT_TYPES
    ):
        raise VlmcError(
            f"{source.name}: BLIP-2 with a {cfg.text_config.model_type} language model is not supported; "
            f"vlmc exports BLIP-2 with a decoder-only {'/'.join(DECODER_TEXT_TYPES)} language model"
        )
    if cfg.image_token_index is None:
        raise VlmcError(
            f"{source.name}: config has no image_token_index, so the query tokens have no placeholder id; "
            "set it in config.json to the id of the processor's <image> token"
        )


def export(source, pkg: Package) -> None:
    _check_supported(source)
    model, cfg = source.model, source.config
    tcfg, vcfg = cfg.text_config, cfg.vision_config
    # OPT may embed at word_embed_proj_dim and project in/out inside the decoder; the embedding graph's
    # width is what the image features are written into.
    embed_dim = int(tcfg.word_embed_proj_dim or tcfg.hidden_size)
    size = int(vcfg.image_size)
    patch = int(vcfg.patch_size)
    n_query = int(cfg.num_query_tokens)

    m = pkg.manifest
    m["vision"] = {
        "image_size": [size, size],
        "tokens_per_image": n_query,
        "image_token_id": int(cfg.image_token_index),
        "preprocess": preprocess_facts(cfg, source.directory),
        "patch_grid": [size // patch] * 2,
        "has_cls_token": True,
        "vision_hidden_size": int(vcfg.hidden_size),
        "num_query_tokens": n_query,
        "hidden_size": embed_dim,
    }
    m["text"] = text_facts(
        cfg,
        tcfg,
        eos_token_id=tcfg.eos_token_id,
        hidden_size=embed_dim,
        intermediate_size=int(tcfg.ffn_dim),
        prompt_template=BLIP2_TEMPLATE,
        image_marker="<image>",
        image_tokens_first=True,
    )
    m["kv"] = kv = kv_facts(tcfg)
    m["pipeline"] = {"image": ["vision_encoder", "fusion"], "embed": "embed_tokens", "decoder": ["decoder"]}

    _, pixels = base.export_square_vision(pkg, VisionWrapper(model), size, "vision_hidden_states")

    with torch.no_grad():
        hidden = VisionWrapper(model).eval()(pixels)

    def static_queries(fusion):
        # The Q-Former slices its query rows with a traced length, so the exporter names that dim; it is
        # always num_query_tokens, and a static dim lets backends plan the fusion output without a gear.
        fusion.graph.output[0].type.tensor_type.shape.dim[1].dim_value = n_query

    base.export_stage(
        pkg,
        "fusion",
        FusionWrapper(model),
        [hidden],
        ["vision_hidden_states"],
        ["image_features"],
        {"vision_hidden_states": {0: base.IMAGES}, "image_features": {0: base.IMAGES}},
        role="fusion",
        edit=static_queries,
    )
    samples.store(pkg, "fusion", {"vision_hidden_states": hidden.numpy()})

    lm = model.language_model
    base.export_embed(pkg, model.get_input_embeddings(), tcfg.vocab_size)
    # OPTDecoder takes position_ids and adds its learned-position offset (2) itself, so the graph keeps
    # the standard 0-based position interface.
    base.export_decoder(
        pkg, lm.model.decoder, lm.lm_head, kv["layers"], kv["kv_heads"], kv["head_dim"], embed_dim
    )


def tiny_blip2_config(
    num_query_tokens: int = 8,
    qformer_layers: int = 2,
    text_layers: int = 2,
    text_hidden: int = 64,
    image_size: int = 32,
):
    """A small BLIP-2 + OPT config that fits the byte tokenizer (vocab 320, image token 319)."""
    from transformers import Blip2Config, Blip2QFormerConfig, Blip2VisionConfig, OPTConfig

    # std 0.2 everywhere keeps greedy argmax away from ties, so token-exact checks are meaningful.
    vision = Blip2VisionConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=8,
        initializer_range=0.2,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=qformer_layers,
        num_attention_heads=4,
        cross_attention_frequency=1,
        vocab_size=zoo.TINY_VOCAB,
        initializer_range=0.2,
    )
    text = OPTConfig(
        vocab_size=zoo.TINY_VOCAB,
        hidden_size=text_hidden,
        ffn_dim=2 * text_hidden,
        num_hidden_layers=text_layers,
        num_attention_heads=4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        init_std=0.2,
        word_embed_proj_dim=text_hidden,
        tie_word_embeddings=False,
    )
    return Blip2Config(
        vision_config=vision,
        qformer_config=qformer,
        text_config=text,
        num_query_tokens=num_query_tokens,
        image_token_index=zoo.TINY_IMAGE_TOKEN,
        initializer_range=0.2,
    )


def build_tiny(config=None):
    """Instantiate a tiny BLIP-2 with non-zero query tokens (transformers initializes them to zeros)."""
    from transformers import Blip2ForConditionalGeneration

    model = Blip2ForConditionalGeneration(config if config is not None else tiny_blip2_config())
    with torch.no_grad():
        model.query_tokens.normal_(std=0.2)
    return model.eval()


zoo.register_builtin("tiny-blip2", "blip2", build_tiny)
