"""Qwen2-VL and Qwen2.5-VL exporter: dynamic-resolution ViT with packed patches, M-RoPE causal LM.

The vision graph takes the processor's patchified ``pixel_values`` [patches, C*T*P*P] and
``image_grid_thw`` [images, 3] and returns the merged features of all images, packed in image order
(``image_features`` [image_tokens, hidden]). Everything transformers computes from the grid on the host
with Python loops (rotary position ids, ``cu_seqlens``, Qwen2.5-VL's window index) is computed inside
the graph with integer arithmetic, comparisons and Where, so one graph serves any number of images of any
resolution the processor produces:

- each patch's image, frame, row and column come from its index and the cumulative patch counts;
- per-image (and, for Qwen2.5-VL, per-window) attention is a block-diagonal additive mask built with
  Equal/Where instead of splitting the sequence at ``cu_seqlens``;
- Qwen2.5-VL's window reordering is not needed: attention under the window mask is permutation-equivariant
  and the merger groups the same 2x2 patch units in either order, so the features come out in the
  processor's order directly (transformers permutes, then un-permutes).
"""

from __future__ import annotations

import importlib
import logging

import torch

from vlmc import samples
from vlmc.exporters import attention, base, streaming, zoo
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

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
IMAGE_MARKER = "<image>"
# Qwen chat layout; each image is wrapped in vision_start/vision_end like the Qwen processor does, which
# also keeps two images' placeholder runs apart (transformers' rope index groups adjacent image tokens).
QWEN_TEMPLATE = (
    "<|im_start|>user\n<|vision_start|>{marker}<|vision_end|>{{prompt}}<|im_end|>\n<|im_start|>assistant\n"
)
IMAGE_TOKENS = "image_tokens"  # symbolic dim of the packed features


def model_class(config=None):
    """The transformers class for a config; without one, the auto class that picks it from config.json.

    load_source calls ``model_class().from_pretrained(dir)`` for every family; the auto class maps
    model_type qwen2_vl / qwen2_5_vl to the two classes in ARCHITECTURES, so one family serves both.
    """
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    if config is None:
        return AutoModelForImageTextToText
    if getattr(config, "model_type", None) == "qwen2_5_vl":
        return Qwen2_5_VLForConditionalGeneration
    return Qwen2VLForConditionalGeneration


def stream_depths(config) -> dict:
    """Layer stacks a streaming export cuts (vlmc/exporters/streaming.py): the M-RoPE decoder and the ViT.

    The ViT's features are its last block's output (then the merger): two blocks. Qwen2.5-VL's blocks
    are of two kinds, windowed attention and the full-attention ones (``fullatt_block_indexes``, every
    8th in the real checkpoints): the trace holds one of each after block 0 (8 of 32).
    """
    vcfg = config.vision_config
    full = getattr(vcfg, "fullatt_block_indexes", None)
    kinds = None if full is None else ["full" if i in full else "window" for i in range(int(vcfg.depth))]
    return {
        **streaming.decoder_depths(config),
        **streaming.uniform_depth(config, "vision_config", "depth", streaming.TRACED_LAYERS, kinds=kinds),
    }


# ---- built-ins ---------------------------------------------------------------------------------


def _tiny_text(**over) -> dict:
    # head_dim 16 -> mrope_section must sum to 8 (temporal, height, width frequency bands)
    kw = dict(
        vocab_size=zoo.TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    kw.update(over)
    return kw


def _special_ids() -> dict:
    # Ids above the byte range of the fallback tokenizer; only the image id ever appears in prompts.
    return dict(
        image_token_id=zoo.TINY_IMAGE_TOKEN,
        video_token_id=zoo.TINY_IMAGE_TOKEN - 1,
        vision_start_token_id=zoo.TINY_IMAGE_TOKEN - 2,
        vision_end_token_id=zoo.TINY_IMAGE_TOKEN - 3,
    )


def tiny_qwen2_vl_config(vision_over: dict | None = None, **text_over):
    """A small Qwen2-VL config (patch 8, merge 2: a 96x96 image gives 12x12 patches, 36 tokens)."""
    from transformers import Qwen2VLConfig

    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=64,
        mlp_ratio=2,
        num_heads=4,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=0.2,
    )
    vision.update(vision_over or {})
    return Qwen2VLConfig(
        text_config=_tiny_text(**text_over), vision_config=vision, tie_word_embeddings=False, **_special_ids()
    )


def tiny_qwen2_5_vl_config(vision_over: dict | None = None, **text_over):
    """A small Qwen2.5-VL config; window 32 px = 2x2 merged tokens, so a 96x96 image has 9 windows."""
    from transformers import Qwen2_5_VLConfig

    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=32,
        fullatt_block_indexes=[1],
        initializer_range=0.2,
    )
    vision.update(vision_over or {})
    return Qwen2_5_VLConfig(
        text_config=_tiny_text(**text_over), vision_config=vision, tie_word_embeddings=False, **_special_ids()
    )


def _build_qwen2_vl():
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration(tiny_qwen2_vl_config())


def _build_qwen2_5_vl():
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config())


zoo.register_builtin("tiny-qwen2-vl", "qwen2_vl", _build_qwen2_vl)
zoo.register_builtin("tiny-qwen2.5-vl", "qwen2_vl", _build_qwen2_5_vl)


# ---- vision graph ------------------------------------------------------------------------------


def _idiv(a: torch.Tensor, b) -> torch.Tensor:
    # All operands are non-negative, so truncating division is floor division and exports as a plain Div.
    return torch.div(a, b, rounding_mode="trunc")


def patch_coords(grid_thw: torch.Tensor, n_patches, merge: int):
    """Per patch: attention segment (one per image frame), row and column in its image's patch grid.

    Mirrors transformers' ``get_vision_position_ids`` / ``get_vision_cu_seqlens`` (block-major order over
    merge x merge units) without loops: a patch's image is the number of images that end at or before it.
    """
    grid = grid_thw.to(torch.int64)
    t, h, w = grid[:, 0], grid[:, 1], grid[:, 2]
    per_image = t * h * w
    end = torch.cumsum(per_image, 0)
    idx = torch.arange(n_patches, dtype=torch.int64)
    image = (idx.unsqueeze(1) >= end.unsqueeze(0)).to(torch.int64).sum(1)
    hi, wi = h.gather(0, image), w.gather(0, image)
    local = idx - (end - per_image).gather(0, image)
    frame_size = hi * wi
    frame = _idiv(local, frame_size)
    r = local - frame * frame_size
    unit = _idiv(r, merge * merge)
    j = r - unit * (merge * merge)
    units_w = _idiv(wi, merge)
    row_unit = _idiv(unit, units_w)
    col_unit = unit - row_unit * units_w
    j_row = _idiv(j, merge)
    hpos = row_unit * merge + j_row
    wpos = col_unit * merge + (j - j_row * merge)
    first_frame = torch.cumsum(t, 0) - t
    segment = first_frame.gather(0, image) + frame
    return segment, hpos, wpos


def _additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(allowed, zero, torch.tensor(torch.finfo(torch.float32).min))


def _vision_attention(attn, hidden: torch.Tensor, cos, sin, mask: torch.Tensor, apply_rope) -> torch.Tensor:
    """transformers' VisionAttention with a block-diagonal mask in place of the cu_seqlens split."""
    seq = hidden.shape[0]
    q, k, v = attn.qkv(hidden).reshape(seq, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rope(q, k, cos, sin)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * attn.scaling + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(0, 1).reshape(seq, -1)
    return attn.proj(out)


def vision_block(block, hidden: torch.Tensor, cos, sin, mask: torch.Tensor, apply_rope) -> torch.Tensor:
    """One ViT block: masked attention (:func:`_vision_attention`) and MLP, both with their residual.

    Run as the block's own call (its forward swapped for this one while it runs), so the tracer scopes
    every node of it, the attention math included, to the block (``/visual/blocks.N/...``): that is how
    the streaming export's stitcher (vlmc/exporters/streaming.py) tells one block's subgraph from the
    next. The block itself is unchanged afterwards.
    """

    def forward(hidden, cos, sin, mask):
        hidden = hidden + _vision_attention(block.attn, block.norm1(hidden), cos, sin, mask, apply_rope)
        return hidden + block.mlp(block.norm2(hidden))

    block.forward = forward
    try:
        return block(hidden, cos, sin, mask)
    finally:
        del block.forward


class VisionWrapper(torch.nn.Module):
    """pixel_values [patches, C*T*P*P], image_grid_thw [images, 3] -> image_features [image_tokens, hidden]."""

    def __init__(self, model) -> None:
        super().__init__()
        visual = model.model.visual
        self.visual = visual
        cfg = visual.config
        self.merge = int(cfg.spatial_merge_size)
        full = getattr(cfg, "fullatt_block_indexes", None)
        # Qwen2.5-VL: blocks not listed as full attention attend within windows of `window` merged tokens.
        self.window = int(cfg.window_size) // self.merge // int(cfg.patch_size) if full is not None else None
        self.full_blocks = set(full) if full is not None else set(range(len(visual.blocks)))
        # each family's modeling module has its own copy of the vision rotary helper
        self.apply_rope = importlib.import_module(type(visual).__module__).apply_rotary_pos_emb_vision
        conv = visual.patch_embed.proj
        # Conv3d with stride == kernel over one flattened patch is a matmul; MatMul is what every backend
        # handles best, and the patch layout [C, T, P, P] is exactly the weight's flattening order.
        self.patch_weight = torch.nn.Parameter(
            conv.weight.detach().reshape(conv.weight.shape[0], -1).t().contiguous(), requires_grad=False
        )
        self.patch_bias = (
            None if conv.bias is None else torch.nn.Parameter(conv.bias.detach(), requires_grad=False)
        )

    def forward(self, pixel_values, image_grid_thw):
        n = pixel_values.shape[0]
        segment, hpos, wpos = patch_coords(image_grid_thw, n, self.merge)
        hidden = torch.matmul(pixel_values.to(self.patch_weight.dtype), self.patch_weight)
        if self.patch_bias is not None:
            hidden = hidden + self.patch_bias
        cos, sin = self.visual.rotary_pos_emb(hidden, torch.stack([hpos, wpos], dim=-1))
        same = segment.unsqueeze(1) == segment.unsqueeze(0)
        full_mask = _additive_mask(same)
        window_mask = full_mask
        if self.window is not None:
            span = self.window * self.merge  # window edge in patches
            wh, ww = _idiv(hpos, span), _idiv(wpos, span)
            window_mask = _additive_mask(
                same & (wh.unsqueeze(1) == wh.unsqueeze(0)) & (ww.unsqueeze(1) == ww.unsqueeze(0))
            )
        for i, blk in enumerate(self.visual.blocks):
            mask = full_mask if i in self.full_blocks else window_mask
            hidden = vision_block(blk, hidden, cos, sin, mask, self.apply_rope)
        return self.visual.merger(hidden)


# ---- manifest facts ----------------------------------------------------------------------------


def preprocess_facts(vcfg, directory) -> dict:
    """Smart-resize + patchify settings: the source processor's, else Qwen's defaults scaled to the patch."""
    patch, merge = int(vcfg.patch_size), int(vcfg.spatial_merge_size)
    factor = patch * merge
    facts = {
        "kind": "packed_patches",
        "patch_size": patch,
        "merge_size": merge,
        "temporal_patch_size": int(vcfg.temporal_patch_size),
        "min_pixels": 4 * factor * factor,
        "max_pixels": 1280 * factor * factor,
        "mean": CLIP_MEAN,
        "std": CLIP_STD,
        "rescale_factor": 1 / 255,
        "resample": "bicubic",
    }
    pc = image_processor_config(directory)
    if pc is not None:
        size = pc.get("size") or {}
        facts["min_pixels"] = int(pc.get("min_pixels", size.get("shortest_edge", facts["min_pixels"])))
        facts["max_pixels"] = int(pc.get("max_pixels", size.get("longest_edge", facts["max_pixels"])))
        facts.update(normalization(pc))
        for key, name in (
            ("patch_size", "patch_size"),
            ("merge_size", "merge_size"),
            ("temporal_patch_size", "temporal_patch_size"),
        ):
            if name in pc:
                facts[key] = int(pc[name])
    return facts


def attention_facts(vision_graph, vcfg) -> dict | None:
    """The last full-attention block's attention (read by prune_visual_tokens' attention_received).

    Qwen2-VL has no CLS token; each merged token owns merge² consecutive patches (block-major order),
    so token scores are patch scores averaged over those groups. The attention is masked (block
    diagonal per image), which the pass needs to know before recomputing it from Q and K.
    """
    merge = int(vcfg.spatial_merge_size)
    blocks = int(vcfg.depth)
    full = getattr(vcfg, "fullatt_block_indexes", None)
    layer = max(full) if full else blocks - 1
    # The graph has exactly one Softmax per block, in block order (each in its block's scope).
    nodes = attention.softmax_nodes(vision_graph)
    if len(nodes) != blocks:
        logger.warning(
            "qwen2_vl: %d Softmax nodes for %d vision blocks; attention facts not written", len(nodes), blocks
        )
        return None
    facts = attention.locate(vision_graph, nodes[layer])
    facts.update(
        {
            "graph": "vision_encoder",
            "layer": layer,
            "layers": blocks,
            "query_index": None,
            "token_offset": 0,
            "merge_group": merge * merge,
            "keys_per_image": None,
        }
    )
    return facts


def _marker(source) -> str:
    # The byte tokenizer maps "<image>" to the image id; a real Qwen tokenizer has <|image_pad|>.
    has_tok = source.directory is not None and any(
        (source.directory / f).is_file() for f in ("tokenizer.json", "vocab.json")
    )
    return "<|image_pad|>" if has_tok else IMAGE_MARKER


def export(source, pkg: Package) -> None:
    model, cfg = source.model, source.config
    tcfg, vcfg = cfg.text_config, cfg.vision_config
    windowed = getattr(vcfg, "fullatt_block_indexes", None) is not None
    marker = _marker(source)

    m = pkg.manifest
    m["vision"] = packed_vision_facts(
        source,
        preprocess_facts(vcfg, source.directory),
        vision_start_token_id=int(cfg.vision_start_token_id),
        vision_end_token_id=int(cfg.vision_end_token_id),
        window_attention=(
            {"window_size": int(vcfg.window_size), "full_attention_blocks": list(vcfg.fullatt_block_indexes)}
            if windowed
            else None
        ),
    )
    m["text"] = text_facts(
        cfg,
        tcfg,
        prompt_template=QWEN_TEMPLATE.format(marker=marker),
        image_marker=marker,
        position="mrope",
        mrope_section=list(tcfg.rope_parameters.get("mrope_section", [])),
        token_type_ids="mm_token_type_ids",
    )
    m["kv"] = kv = kv_facts(tcfg)
    m["pipeline"] = {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}

    export_packed_vision(pkg, VisionWrapper(model), vcfg)
    base.export_embed(pkg, model.get_input_embeddings(), tcfg.vocab_size)
    base.export_decoder(
        pkg,
        model.model.language_model,
        model.lm_head,
        kv["layers"],
        kv["kv_heads"],
        kv["head_dim"],
        tcfg.hidden_size,
        mrope=True,
    )


def packed_vision_facts(source, preprocess: dict, **family) -> dict:
    """The manifest ``vision`` section of a packed-patch ViT (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V):
    the facts they share, with the family's ``preprocess`` facts and its own (begin/end tokens, position table, windows)."""
    cfg = source.config
    tcfg, vcfg = cfg.text_config, cfg.vision_config
    return {
        "image_size": None,
        "tokens_per_image": None,
        "dynamic_resolution": True,
        "image_token_id": int(cfg.image_token_id),
        "video_token_id": int(cfg.video_token_id),
        "spatial_merge_size": int(vcfg.spatial_merge_size),
        "patch_size": int(vcfg.patch_size),
        "temporal_patch_size": int(vcfg.temporal_patch_size),
        "packed_features": True,
        "preprocess": preprocess,
        "hidden_size": int(tcfg.hidden_size),
        "window_attention": None,
        # no single CLS attention row to score tokens with (read by prune_visual_tokens)
        "attention": None,
        **family,
    }


def export_packed_vision(pkg: Package, wrapper, vcfg, token_aligned: dict[str, int] | None = None) -> None:
    """Export a packed-patch vision graph (``pixel_values`` [patches, dim], ``image_grid_thw``) and its sample.

    Traced with two images of different sizes so nothing about one grid can be baked in.
    ``token_aligned``: further outputs after ``image_features`` (name -> their image-token axis).
    """
    merge = int(vcfg.spatial_merge_size)
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 2 * merge, 3 * merge], [1, 3 * merge, 2 * merge]], dtype=torch.int64)
    dim = int(vcfg.in_channels) * int(vcfg.temporal_patch_size) * int(vcfg.patch_size) ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), dim, generator=g)
    extra = dict(token_aligned or {})
    vision = base.export_stage(
        pkg,
        "vision_encoder",
        wrapper,
        [pixels, grid],
        ["pixel_values", "image_grid_thw"],
        ["image_features", *extra],
        {
            "pixel_values": {0: base.PATCHES},
            "image_grid_thw": {0: base.IMAGES},
            "image_features": {0: IMAGE_TOKENS},
            **{name: {axis: IMAGE_TOKENS} for name, axis in extra.items()},
        },
        role="vision",
    )
    pkg.manifest["vision"]["attention"] = attention_facts(vision, vcfg)
    samples.store(pkg, "vision_encoder", {"pixel_values": pixels.numpy(), "image_grid_thw": grid.numpy()})
