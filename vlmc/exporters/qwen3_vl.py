"""Qwen3-VL exporter (dense): packed ViT with learned, bilinearly resampled position embeddings and deepstack.

What differs from Qwen2-VL (whose grid arithmetic, masked attention and patch-embedding MatMul this reuses):

- the patch embedding (Conv3d, patch 16, temporal 2) is followed by a learned square position table
  resampled bilinearly (align_corners) to each image's grid; the taps and weights are computed inside
  the graph from the grid, with transformers' own per-axis helper, so any grid works;
- **deepstack**: the outputs of some vision blocks go through their own mergers and are added to the
  hidden states of the first decoder layers at the image positions. The vision graph returns them as
  ``deepstack_features`` [deepstack layers, image_tokens, hidden] beside ``image_features``; the decoder
  takes ``visual_pos_masks`` (int64 [batch, sequence], 1 on image placeholders) and
  ``deepstack_visual_embeds`` [deepstack layers, visual_tokens, hidden]. The manifest's
  ``text.deepstack`` names the three tensors, so the runtime and passes never guess;
- the decoder's M-RoPE is interleaved (``mrope_interleaved``); the traced graph uses transformers' own
  rotary module, so the runtime only supplies the [3, batch, seq] positions (same rule as Qwen2-VL).

Out of scope: video inputs (the processor is loaded images-only) and the MoE variant
(``Qwen3VLMoeForConditionalGeneration``, model_type qwen3_vl_moe), which vlmc does not list.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from vlmc.errors import VlmcError
from vlmc.exporters import base, qwen2_vl, streaming, zoo
from vlmc.exporters._facts import image_processor_config, kv_facts, text_facts
from vlmc.package import Package

logger = logging.getLogger(__name__)

MODEL_TYPES = ("qwen3_vl",)
ARCHITECTURES = ("Qwen3VLForConditionalGeneration",)
# Interface names (docs/architecture.md, "Interfaces"); recorded in the manifest's text.deepstack.
DEEPSTACK_OUTPUT = "deepstack_features"
VISUAL_POS_MASKS = "visual_pos_masks"
DEEPSTACK_EMBEDS = "deepstack_visual_embeds"
VISUAL_TOKENS = "visual_tokens"  # symbolic dim: image tokens in the whole batch
# The Qwen3-VL image processor's statistics (Qwen/Qwen3-VL-*-Instruct preprocessor_config.json).
QWEN3_MEAN = [0.5, 0.5, 0.5]
QWEN3_STD = [0.5, 0.5, 0.5]
QWEN3_MAX_PIXELS = 16777216  # its size.longest_edge


def model_class(config=None):
    from transformers import AutoModelForImageTextToText, Qwen3VLForConditionalGeneration

    return AutoModelForImageTextToText if config is None else Qwen3VLForConditionalGeneration


def stream_depths(config) -> dict:
    """Layer stacks a streaming export cuts (vlmc/exporters/streaming.py): the decoder, deepstack included.

    The text model adds deepstack embedding k after decoder layer k (k < deepstack layers), outside the
    layers: layers 0..k are wired to the graph by their index, so they are traced as they are
    (``fixed``) with two plain layers after them; every further layer copies the last one.
    The vision tower is not cut: its deepstack taps read block outputs by index up to near its top
    (8, 16, 24 of Qwen3-VL-8B's 27 blocks), so a trace that keeps them fixed is nearly the whole tower
    (about 0.4 B params, loaded whole).
    """
    return streaming.decoder_depths(config, fixed=len(config.vision_config.deepstack_visual_indexes))


# ---- built-ins ---------------------------------------------------------------------------------


def tiny_qwen3_vl_config(vision_over: dict | None = None, **text_over):
    """A small Qwen3-VL: the real patch 16 / temporal 2 / merge 2, an 8x8 position table, deepstack after
    vision blocks 0 and 2 into decoder layers 0 and 1 (of 3); a 64x96 image gives 4x6 patches, 6 tokens."""
    from transformers import Qwen3VLConfig

    text = dict(
        vocab_size=zoo.TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
        # head_dim 16 -> the interleaved sections sum to 8 frequency bands
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    )
    text.update(text_over)
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0, 2],
        initializer_range=0.2,
    )
    vision.update(vision_over or {})
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=zoo.TINY_IMAGE_TOKEN,
        video_token_id=zoo.TINY_IMAGE_TOKEN - 1,
        vision_start_token_id=zoo.TINY_IMAGE_TOKEN - 2,
        vision_end_token_id=zoo.TINY_IMAGE_TOKEN - 3,
        tie_word_embeddings=False,
    )


def _build_qwen3_vl():
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config())


zoo.register_builtin("tiny-qwen3-vl", "qwen3_vl", _build_qwen3_vl)


# ---- vision graph ------------------------------------------------------------------------------


class VisionWrapper(qwen2_vl.VisionWrapper):
    """pixel_values, image_grid_thw -> image_features [image_tokens, hidden],
    deepstack_features [deepstack layers, image_tokens, hidden]."""

    def __init__(self, model) -> None:
        super().__init__(model)
        cfg = self.visual.config
        self.side = int(self.visual.num_grid_per_side)
        self.align_corners = bool(self.visual.interpolation_align_corners)
        self.mode = str(self.visual.interpolation_mode)
        self.deepstack = [int(i) for i in cfg.deepstack_visual_indexes]

    def _position_embeddings(self, grid_thw, hpos, wpos):
        # transformers' per-axis taps: the same float arithmetic as the model, on per-patch tensors
        from transformers.vision_utils import _interpolation_axis_taps_weights

        grid = grid_thw.to(torch.int64)
        n = hpos.shape[0]
        idx = torch.arange(n, dtype=torch.int64)
        ends = torch.cumsum(grid.prod(-1), 0)
        image = (idx.unsqueeze(1) >= ends.unsqueeze(0)).to(torch.int64).sum(1)
        heights, widths = grid[:, 1].gather(0, image), grid[:, 2].gather(0, image)
        h_taps, h_w = _interpolation_axis_taps_weights(
            hpos, heights, self.side, self.mode, self.align_corners
        )
        w_taps, w_w = _interpolation_axis_taps_weights(wpos, widths, self.side, self.mode, self.align_corners)
        taps = h_taps.shape[1]
        indices = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, taps * taps)
        weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, taps * taps)
        return (self.visual.pos_embed(indices) * weights[:, :, None]).sum(1)

    def forward(self, pixel_values, image_grid_thw):
        n = pixel_values.shape[0]
        segment, hpos, wpos = qwen2_vl.patch_coords(image_grid_thw, n, self.merge)
        hidden = torch.matmul(pixel_values.to(self.patch_weight.dtype), self.patch_weight)
        if self.patch_bias is not None:
            hidden = hidden + self.patch_bias
        hidden = hidden + self._position_embeddings(image_grid_thw, hpos, wpos)
        cos, sin = self.visual.rotary_pos_emb(hidden, torch.stack([hpos, wpos], dim=-1))
        mask = qwen2_vl._additive_mask(segment.unsqueeze(1) == segment.unsqueeze(0))
        deepstack = []
        for i, blk in enumerate(self.visual.blocks):
            hidden = qwen2_vl.vision_block(blk, hidden, cos, sin, mask, self.apply_rope)
            if i in self.deepstack:
                deepstack.append(self.visual.deepstack_merger_list[self.deepstack.index(i)](hidden))
        return self.visual.merger(hidden), torch.stack(deepstack, 0)


# ---- decoder graph -----------------------------------------------------------------------------


def _add_at_visual_positions(hidden, visual_pos_masks, visual_embeds):
    """hidden [B, S, H] plus visual_embeds [V, H] at the positions where visual_pos_masks is 1.

    transformers writes ``hidden[mask] += embeds`` (boolean indexing, NonZero + ScatterND in ONNX). Here the
    k-th masked position (row-major over the batch) gathers row k of the embeds from a table whose row 0
    is zeros, and every other position gathers that zero row: a Gather and an Add, static shapes, and
    V may be 0 (decode steps). Adding 0.0 leaves a value unchanged, so the result is bit-identical.
    """
    batch, seq, width = hidden.shape
    flat = visual_pos_masks.to(torch.int64).reshape(-1)
    rows = torch.cumsum(flat, 0) * flat
    table = torch.cat([torch.zeros(1, width, dtype=hidden.dtype), visual_embeds.to(hidden.dtype)], 0)
    return hidden + table[rows].reshape(batch, seq, width)


@contextlib.contextmanager
def _traceable_deepstack(text_model):
    """Swap the text model's deepstack step for the Gather form while tracing (put back afterwards)."""
    text_model._deepstack_process = _add_at_visual_positions
    try:
        yield
    finally:
        del text_model._deepstack_process


def _visual_sample(batch: int, seq: int) -> torch.Tensor:
    mask = torch.zeros(batch, seq, dtype=torch.int64)
    mask[0, 1:4] = 1
    mask[-1, seq - 1] = 1
    return mask


def _deepstack_inputs(hidden: int, layers: int) -> list[base.DecoderInput]:
    """The two deepstack decoder inputs (the shared decoder wrapper's extra inputs); their samples agree:
    as many rows as marked positions."""
    g = torch.Generator().manual_seed(1)

    def rows(batch: int, seq: int) -> torch.Tensor:
        return torch.randn(layers, int(_visual_sample(batch, seq).sum()), hidden, generator=g)

    return [
        base.DecoderInput(VISUAL_POS_MASKS, "deepstack", _visual_sample),
        base.DecoderInput(DEEPSTACK_EMBEDS, "deepstack", rows, axes={1: VISUAL_TOKENS}),
    ]


def _deepstack_kwargs(layers: int):
    def text_kwargs(text_model, inputs_embeds, attention_mask, position_ids, cache, **extras):
        stack = extras[DEEPSTACK_EMBEDS]
        return {
            "attention_mask": attention_mask,
            "visual_pos_masks": extras[VISUAL_POS_MASKS],
            "deepstack_visual_embeds": [stack[i] for i in range(layers)],
        }

    return text_kwargs


def export_decoder(pkg: Package, model, kv: dict, hidden: int, deepstack_layers: int) -> None:
    text_model = model.model.language_model
    with _traceable_deepstack(text_model):
        base.export_decoder(
            pkg,
            text_model,
            model.lm_head,
            kv["layers"],
            kv["kv_heads"],
            kv["head_dim"],
            hidden,
            position_axes=3,
            extra_inputs=_deepstack_inputs(hidden, deepstack_layers),
            text_kwargs=_deepstack_kwargs(deepstack_layers),
        )


# ---- manifest facts and export -----------------------------------------------------------------


def preprocess_facts(vcfg, directory) -> dict:
    """Qwen2-VL's smart-resize + patchify facts; without a saved processor, Qwen3-VL's 0.5 statistics."""
    facts = qwen2_vl.preprocess_facts(vcfg, directory)
    if directory is None or image_processor_config(directory) is None:
        facts["mean"], facts["std"] = list(QWEN3_MEAN), list(QWEN3_STD)
    return facts


def export(source, pkg: Package) -> None:
    model, cfg = source.model, source.config
    tcfg, vcfg = cfg.text_config, cfg.vision_config
    deepstack_layers = len(vcfg.deepstack_visual_indexes)
    if deepstack_layers > int(tcfg.num_hidden_layers):
        raise VlmcError(
            f"qwen3_vl: {deepstack_layers} deepstack vision layers but only {tcfg.num_hidden_layers} "
            "decoder layers to add them to"
        )
    marker = qwen2_vl._marker(source)
    m = pkg.manifest
    m["vision"] = qwen2_vl.packed_vision_facts(
        source,
        preprocess_facts(vcfg, source.directory),
        vision_start_token_id=int(cfg.vision_start_token_id),
        vision_end_token_id=int(cfg.vision_end_token_id),
        position_embedding={
            "table": int(vcfg.num_position_embeddings),
            "interpolation": "bilinear",
            "align_corners": True,
        },
        # Outputs of the vision graph laid out along image_features' token axis (name -> that axis):
        # whatever selects or reorders tokens (prune_visual_tokens) must do the same to these.
        token_aligned_outputs={DEEPSTACK_OUTPUT: 1},
    )
    m["text"] = text_facts(
        cfg,
        tcfg,
        prompt_template=qwen2_vl.QWEN_TEMPLATE.format(marker=marker),
        image_marker=marker,
        position="mrope",
        mrope_section=list(tcfg.rope_parameters.get("mrope_section", [])),
        mrope_interleaved=bool(tcfg.rope_parameters.get("mrope_interleaved", False)),
        token_type_ids="mm_token_type_ids",
        deepstack={
            "layers": deepstack_layers,
            "vision_layers": [int(i) for i in vcfg.deepstack_visual_indexes],
            "vision_output": DEEPSTACK_OUTPUT,
            "mask_input": VISUAL_POS_MASKS,
            "embeds_input": DEEPSTACK_EMBEDS,
            "rows_dim": VISUAL_TOKENS,
        },
    )
    m["kv"] = kv = kv_facts(tcfg)
    m["pipeline"] = {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}

    qwen2_vl.export_packed_vision(pkg, VisionWrapper(model), vcfg, {DEEPSTACK_OUTPUT: 1})
    base.export_embed(pkg, model.get_input_embeddings(), tcfg.vocab_size)
    export_decoder(pkg, model, kv, int(tcfg.hidden_size), deepstack_layers)


def tokens_per_image(config) -> int:
    """The most tokens one image gives under the Qwen3-VL processor's default pixel bound (`vlmc plan --config`).

    Qwen/Qwen3-VL-*-Instruct's preprocessor_config.json bounds images at ``longest_edge`` = 16777216 pixels
    (16384 tokens at patch 16, merge 2); a package's plan reads the bound its own processor saved.
    """
    v = config.vision_config
    factor = int(v.patch_size) * int(v.spatial_merge_size)
    return QWEN3_MAX_PIXELS // (factor * factor)
