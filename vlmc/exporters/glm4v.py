"""GLM-4.1V exporter: a Qwen2-VL-like packed ViT with bicubic position embeddings, a Conv2d downsample, M-RoPE.

The vision graph has Qwen2-VL's interface (``pixel_values`` [patches, C*T*P*P], ``image_grid_thw``) and reuses
its in-graph grid arithmetic and block-diagonal attention. What is GLM's own:

- RMS norms around the tower (after the patch embedding, after the last block);
- the learned square position table is resampled to each grid with ``F.grid_sample(bicubic, border,
  align_corners=False)`` in transformers. ATC parses no GridSample (vlmc/backends/ascend/data/onnx_ops.tsv, docs/atc-facts.md), so the graph
  takes the same 4x4 Keys-kernel (a = -0.75) taps and weights per patch with transformers' own per-axis helper
  (``padding="border"`` clamps the taps as grid_sample's border mode does) and sums 16 gathered rows;
- the 2x2 merge is a Conv2d (kernel = stride = merge) over each merge block, exported as one MatMul over the
  block's [C, merge, merge] values, then the gated MLP merger.

Images are wrapped ``<|begin_of_image|>`` + ``<|image|>`` x tokens + ``<|end_of_image|>`` (the manifest's
``vision.image_start_token_id`` / ``image_end_token_id``); positions follow ``Glm4vModel.get_rope_index``, which
for images is Qwen2-VL's rule (text continues at the image's largest position + 1). GLM's image processor has
its own smart resize (upscale below one factor; pixel bounds count the two temporal frames), recorded as
``vision.preprocess.resize: "temporal_pixels"``. Video inputs are out of scope (the processor is loaded images-only).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from vlmc.exporters import base, qwen2_vl, streaming, zoo
from vlmc.exporters._facts import CLIP_MEAN, CLIP_STD, image_processor_config, kv_facts, text_facts
from vlmc.package import Package

logger = logging.getLogger(__name__)

MODEL_TYPES = ("glm4v",)
ARCHITECTURES = ("Glm4vForConditionalGeneration",)
IMAGE_MARKER = "<image>"
# GLM-4.1V's chat layout (zai-org/GLM-4.1V-9B-Thinking chat template, one user turn).
GLM_TEMPLATE = "[gMASK]<sop><|user|>\n<|begin_of_image|>{marker}<|end_of_image|>{{prompt}}<|assistant|>\n"
# Glm4vImageProcessor's defaults (transformers image_processing_pil_glm4v.py).
GLM_MIN_PIXELS = 112 * 112
GLM_MAX_PIXELS = 28 * 28 * 15000


def model_class(config=None):
    from transformers import Glm4vForConditionalGeneration

    return Glm4vForConditionalGeneration


# ---- built-ins ---------------------------------------------------------------------------------


def stream_depths(config) -> dict:
    """Layer stacks a streaming export cuts (vlmc/exporters/streaming.py): the text decoder and the ViT,
    whose features are its last block's output (then post_layernorm, downsample and merger): two blocks."""
    return {
        **streaming.decoder_depths(config),
        **streaming.uniform_depth(config, "vision_config", "depth", streaming.TRACED_LAYERS),
    }


def tiny_glm4v_config(vision_over: dict | None = None, **text_over):
    """A small GLM-4.1V: patch 14 (the real one), merge 2, a 4x4 position table (image_size 56); a 112x84 image
    gives 8x6 patches, 12 tokens. Text: partial rotary 0.5 over head_dim 16 -> M-RoPE sections sum to 4."""
    from transformers import Glm4vConfig

    text = dict(
        vocab_size=zoo.TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        initializer_range=0.2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
        },
    )
    text.update(text_over)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,
        image_size=56,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=0.2,
    )
    vision.update(vision_over or {})
    return Glm4vConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=zoo.TINY_IMAGE_TOKEN,
        video_token_id=zoo.TINY_IMAGE_TOKEN - 1,
        image_start_token_id=zoo.TINY_IMAGE_TOKEN - 2,
        image_end_token_id=zoo.TINY_IMAGE_TOKEN - 3,
        video_start_token_id=zoo.TINY_IMAGE_TOKEN - 4,
        video_end_token_id=zoo.TINY_IMAGE_TOKEN - 5,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )


def _build_glm4v():
    from transformers import Glm4vForConditionalGeneration

    return Glm4vForConditionalGeneration(tiny_glm4v_config())


zoo.register_builtin("tiny-glm4v", "glm4v", _build_glm4v)


# ---- vision graph ------------------------------------------------------------------------------


class VisionWrapper(torch.nn.Module):
    """pixel_values [patches, C*T*P*P], image_grid_thw [images, 3] -> image_features [image_tokens, hidden]."""

    def __init__(self, model) -> None:
        super().__init__()
        visual = model.model.visual
        self.visual = visual
        self.merge = int(visual.config.spatial_merge_size)
        table = visual.embeddings.position_embedding.weight
        self.side = int(round(table.shape[0] ** 0.5))
        from transformers.models.glm4v import modeling_glm4v

        self.apply_rope = modeling_glm4v.apply_rotary_pos_emb_vision
        conv = visual.patch_embed.proj
        # Conv3d / Conv2d with stride == kernel over one flattened patch (or merge block) is a matmul.
        self.patch_weight = torch.nn.Parameter(
            conv.weight.detach().reshape(conv.weight.shape[0], -1).t().contiguous(), requires_grad=False
        )
        self.patch_bias = (
            None if conv.bias is None else torch.nn.Parameter(conv.bias.detach(), requires_grad=False)
        )
        down = visual.downsample
        self.down_weight = torch.nn.Parameter(
            down.weight.detach().reshape(down.weight.shape[0], -1).t().contiguous(), requires_grad=False
        )
        self.down_bias = (
            None if down.bias is None else torch.nn.Parameter(down.bias.detach(), requires_grad=False)
        )

    def _position_embeddings(self, grid_thw, hpos, wpos, dtype):
        from transformers.vision_utils import _interpolation_axis_taps_weights

        grid = grid_thw.to(torch.int64)
        idx = torch.arange(hpos.shape[0], dtype=torch.int64)
        ends = torch.cumsum(grid.prod(-1), 0)
        image = (idx.unsqueeze(1) >= ends.unsqueeze(0)).to(torch.int64).sum(1)
        heights, widths = grid[:, 1].gather(0, image), grid[:, 2].gather(0, image)
        h_taps, h_w = _interpolation_axis_taps_weights(hpos, heights, self.side, "bicubic", False, "border")
        w_taps, w_w = _interpolation_axis_taps_weights(wpos, widths, self.side, "bicubic", False, "border")
        n = h_taps.shape[1]
        indices = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, n * n)
        weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, n * n)
        table = self.visual.embeddings.position_embedding.weight.to(torch.float32)
        return (table[indices] * weights[:, :, None]).sum(1).to(dtype)

    def forward(self, pixel_values, image_grid_thw):
        v = self.visual
        n = pixel_values.shape[0]
        segment, hpos, wpos = qwen2_vl.patch_coords(image_grid_thw, n, self.merge)
        hidden = torch.matmul(pixel_values.to(self.patch_weight.dtype), self.patch_weight)
        if self.patch_bias is not None:
            hidden = hidden + self.patch_bias
        hidden = v.post_conv_layernorm(hidden)
        cos, sin = v.rotary_pos_emb(hidden, torch.stack([hpos, wpos], dim=-1))
        hidden = hidden + self._position_embeddings(image_grid_thw, hpos, wpos, hidden.dtype)
        mask = qwen2_vl._additive_mask(segment.unsqueeze(1) == segment.unsqueeze(0))
        for blk in v.blocks:
            hidden = qwen2_vl.vision_block(blk, hidden, cos, sin, mask, self.apply_rope)
        hidden = v.post_layernorm(hidden)
        # [tokens, merge, merge, C] -> [tokens, C, merge, merge] flattened: the Conv2d weight's layout
        width = hidden.shape[-1]
        blocks = hidden.reshape(-1, self.merge, self.merge, width).permute(0, 3, 1, 2)
        merged = torch.matmul(blocks.reshape(-1, width * self.merge * self.merge), self.down_weight)
        if self.down_bias is not None:
            merged = merged + self.down_bias
        return v.merger(merged)


# ---- decoder graph -----------------------------------------------------------------------------


@contextlib.contextmanager
def _traceable_rotary(rotary):
    """While tracing, GLM's M-RoPE recomposition without ``repeat_interleave``.

    The TorchScript exporter records a wrong rank for ``freq.repeat_interleave(2, dim=-1)`` here, and the
    partial-rotary ``cat`` after it then fails to export. Duplicating each frequency with
    unsqueeze/expand/reshape gives the same tensor (the sections are picked exactly as transformers does).
    """
    sections = list(rotary.mrope_section)

    def recompose(freq):
        picked = torch.cat([m[i % 3] for i, m in enumerate(freq.split(sections, dim=-1))], dim=-1)
        return picked.unsqueeze(-1).expand(*picked.shape, 2).flatten(-2)

    rotary.recomposition_frequencies = recompose
    try:
        yield
    finally:
        del rotary.recomposition_frequencies


# ---- manifest facts ----------------------------------------------------------------------------


def preprocess_facts(vcfg, directory) -> dict:
    """GLM's smart resize + Qwen-style patchify; the saved processor's settings override the defaults."""
    facts = qwen2_vl.preprocess_facts(vcfg, None)
    facts.update(
        {
            "resize": "temporal_pixels",
            "min_pixels": GLM_MIN_PIXELS,
            "max_pixels": GLM_MAX_PIXELS,
            "mean": CLIP_MEAN,
            "std": CLIP_STD,
        }
    )
    if image_processor_config(directory) is not None:
        facts.update(qwen2_vl.preprocess_facts(vcfg, directory))
        facts["resize"] = "temporal_pixels"
    return facts


def _marker(source) -> str:
    has_tok = source.directory is not None and (source.directory / "tokenizer.json").is_file()
    return "<|image|>" if has_tok else IMAGE_MARKER


def tokens_per_image(config) -> int:
    """The most tokens one image gives under Glm4vImageProcessor's default bound (``vlmc plan --config``):
    the bound counts both temporal frames, so an image gets max_pixels / 2 pixels."""
    v = config.vision_config
    factor = int(v.patch_size) * int(v.spatial_merge_size)
    return GLM_MAX_PIXELS // int(v.temporal_patch_size) // (factor * factor)


def export(source, pkg: Package) -> None:
    model, cfg = source.model, source.config
    tcfg, vcfg = cfg.text_config, cfg.vision_config
    marker = _marker(source)
    m = pkg.manifest
    m["vision"] = qwen2_vl.packed_vision_facts(
        source,
        preprocess_facts(vcfg, source.directory),
        image_start_token_id=int(cfg.image_start_token_id),
        image_end_token_id=int(cfg.image_end_token_id),
        position_embedding={
            "table": int(model.model.visual.embeddings.position_embedding.weight.shape[0]),
            "interpolation": "bicubic",
            "align_corners": False,
        },
    )
    m["text"] = text_facts(
        cfg,
        tcfg,
        prompt_template=GLM_TEMPLATE.format(marker=marker),
        image_marker=marker,
        position="mrope",
        mrope_section=list(tcfg.rope_parameters.get("mrope_section", [])),
        token_type_ids="mm_token_type_ids",
        add_bos=False,  # GLM's template writes [gMASK]<sop> itself; its tokenizer adds nothing
    )
    m["kv"] = kv = kv_facts(tcfg)
    m["pipeline"] = {"image": ["vision_encoder"], "embed": "embed_tokens", "decoder": ["decoder"]}

    qwen2_vl.export_packed_vision(pkg, VisionWrapper(model), vcfg)
    base.export_embed(pkg, model.get_input_embeddings(), tcfg.vocab_size)
    with _traceable_rotary(model.model.language_model.rotary_emb):
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
