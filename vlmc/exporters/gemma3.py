"""Gemma3 (Gemma3ForConditionalGeneration) on the generic tier: the cost of a family that follows the interface.

Vision is the tier's default (``get_image_features``: SigLIP + average-pooling projector, a fixed
``mm_tokens_per_image`` per image). What is Gemma3's own:
- preprocessing: a plain resize to the tower size (kind ``resize``), Gemma's mean/std 0.5;
- prompt expansion: the prompt's ``<start_of_image>`` becomes
  ``"\\n\\n<start_of_image>" + "<image_soft_token>" x N + "<end_of_image>\\n\\n"`` (Gemma3Processor);
- one extra decoder input, ``token_type_ids`` (1 on image tokens): image tokens attend to each other
  bidirectionally. The mask mapping per attention type is built by transformers' own
  ``create_masks_for_vision_model`` inside the graph;
- sliding-window layers (``layer_types``): recorded in the manifest's kv section; masked in the graph.
Pan-and-scan crops (off by default in the processor) are refused.
"""

from __future__ import annotations

import logging

import torch

from vlmc.errors import VlmcError
from vlmc.exporters import attention, base, generic, streaming, zoo
from vlmc.exporters._facts import PIL_RESAMPLE, image_processor_config

logger = logging.getLogger(__name__)


def _token_types(batch: int, seq: int) -> torch.Tensor:
    t = torch.zeros(batch, seq, dtype=torch.int64)
    t[:, 1:3] = 1  # an image block inside the traced sample
    return t


class Gemma3(generic.Family):
    name = "gemma3"
    model_types = ("gemma3",)
    architectures = ("Gemma3ForConditionalGeneration",)

    def model_class(self, config=None):
        from transformers import Gemma3ForConditionalGeneration

        return Gemma3ForConditionalGeneration

    def tokens_per_image(self, config) -> int:
        return int(config.mm_tokens_per_image)

    def stream_depths(self, config) -> dict:
        """The layer stacks a streaming export cuts (vlmc/exporters/streaming.py): the SigLIP tower, whose
        ``last_hidden_state`` (after its post-layernorm) reads only the last layer: two layers.

        The decoder is not cut: Gemma3's RMSNorm multiplies by ``1 + weight``, which torch's exporter
        folds into an unnamed constant per norm, so a layer's graph holds values that are no checkpoint
        tensor and the stitcher cannot bind a copied layer to its weights (it refuses such a layer).
        It loads whole (the sliding / full ``layer_types`` themselves would stitch: one traced layer of
        each kind, see streaming.Cut.kinds).
        """
        return streaming.uniform_depth(config, "vision_config", "num_hidden_layers", streaming.TRACED_LAYERS)

    def vision_facts(self, source) -> dict:
        cfg = source.config
        size = int(cfg.vision_config.image_size)
        pc = image_processor_config(source.directory) or {}
        if pc.get("do_pan_and_scan"):
            raise VlmcError(f"{source.name}: gemma3 pan-and-scan crops (do_pan_and_scan) are not supported")
        s = pc.get("size") or {"height": size, "width": size}
        return {
            "image_size": [int(s["height"]), int(s["width"])],
            "tokens_per_image": self.tokens_per_image(cfg),
            "image_token_id": int(cfg.image_token_id),
            "boi_token_id": int(cfg.boi_token_id),
            "eoi_token_id": int(cfg.eoi_token_id),
            "has_cls_token": False,
            # the pooled tokens run row-major over the image (the pruning picture draws them)
            "token_grid": [int(round(self.tokens_per_image(cfg) ** 0.5))] * 2,
            "processor_images": "per_prompt",  # Gemma3Processor takes a batch's images per prompt
            "preprocess": {
                "kind": "resize",
                "size": [int(s["height"]), int(s["width"])],
                "mean": pc.get("image_mean", [0.5, 0.5, 0.5]),
                "std": pc.get("image_std", [0.5, 0.5, 0.5]),
                "rescale_factor": pc.get("rescale_factor", 1 / 255),
                "resample": PIL_RESAMPLE.get(pc.get("resample", 2), "bilinear"),
            },
            # Pruning needs nothing more: the runtime's token_type_ids mark the k kept placeholders, so the
            # image block the decoder attends bidirectionally is the kept tokens' run.
        }

    def after_export(self, source, pkg, vision_graph) -> None:
        """The last encoder layer's attention; a token scores the patches its average pool covers."""
        v = source.config.vision_config
        side = int(v.image_size) // int(v.patch_size)
        tokens_side = int(round(self.tokens_per_image(source.config) ** 0.5))
        kernel = side // tokens_side
        groups = [
            [(ti * kernel + a) * side + tj * kernel + b for a in range(kernel) for b in range(kernel)]
            for ti in range(tokens_side)
            for tj in range(tokens_side)
        ]
        layers = int(v.num_hidden_layers)
        facts = attention.grouped_facts(
            vision_graph, f"/encoder/layers.{layers - 1}/", side * side, None, groups, "gemma3"
        )
        if facts:
            facts.update({"layer": layers - 1, "layers": layers})
        pkg.manifest["vision"]["attention"] = facts

    def text_facts(self, source) -> dict:
        return {
            "prompt_template": "<start_of_turn>user\n<start_of_image>{prompt}<end_of_turn>\n<start_of_turn>model\n",
            "image_marker": "<start_of_image>",
            "image_token": "<image_soft_token>",
            "image_expansion": "\n\n<start_of_image>{tokens}<end_of_image>\n\n",
            "token_type_ids": "token_type_ids",
        }

    def decoder_inputs(self, config) -> list[base.DecoderInput]:
        return [base.DecoderInput("token_type_ids", "image_tokens", _token_types)]

    @staticmethod
    def text_kwargs(text_model, inputs_embeds, attention_mask, position_ids, cache, token_type_ids):
        """The mask mapping Gemma3Model builds with ``create_masks_for_vision_model``, written out.

        transformers composes full layers as OR(causal, same image block) and sliding layers as
        AND(window, OR(causal, same image block)), both AND padding. Its sliding mask goes through
        ``torch.vmap`` (custom and/or mask functions), which the ONNX tracer cannot export, so the same
        boolean algebra is written here on broadcast index tensors. The image blocks are those of
        ``get_block_sequence_ids_for_mask`` (transformers' own function) over this step's tokens; past
        positions belong to no block, which is exact for a prefill from an empty cache and for decode steps
        (their token is text, so no query is in a block).
        """
        from transformers.models.gemma3 import modeling_gemma3

        q_len, kv_len = inputs_embeds.shape[1], attention_mask.shape[1]
        past = kv_len - q_len
        q = torch.arange(q_len).unsqueeze(1) + past  # [Q, 1]
        k = torch.arange(kv_len).unsqueeze(0)  # [1, K]
        causal = (k <= q).unsqueeze(0)  # [1, Q, K]
        blocks = modeling_gemma3.get_block_sequence_ids_for_mask(token_type_ids)  # [B, Q]
        kv_blocks = torch.cat([torch.full_like(attention_mask[:, :past], -1), blocks], dim=1)  # [B, K]
        same = (blocks.unsqueeze(2) == kv_blocks.unsqueeze(1)) & (blocks.unsqueeze(2) >= 0)  # [B, Q, K]
        padding = attention_mask.bool().unsqueeze(1)  # [B, 1, K]
        full = (causal | same) & padding
        # transformers' window is by cache index (kv_idx > q_idx - window). In a left-padded contiguous
        # cache the index distance of two real tokens is their distance in real tokens, which is what is
        # counted here, so the window also holds where the past has masked holes (the paged_kv layout).
        count = torch.cumsum(attention_mask, dim=1)  # [B, K]: real tokens up to each slot
        q_count = count[:, past:]  # [B, Q]
        window = count.unsqueeze(1) > q_count.unsqueeze(2) - int(text_model.config.sliding_window)
        sliding = (causal | same) & window & padding
        zero = torch.zeros((), dtype=inputs_embeds.dtype)
        low = torch.tensor(torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype)
        return {
            "attention_mask": {
                "full_attention": torch.where(full, zero, low).unsqueeze(1),
                "sliding_attention": torch.where(sliding, zero, low).unsqueeze(1),
            }
        }


globals().update(generic.module_api(Gemma3()))


def tiny_gemma3_config(**text_over):
    """A small Gemma3 (SigLIP 32 px, patch 8, pooled to 4 tokens; layers sliding, full; window 8)."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    kw = zoo._text_kwargs(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    kw.update(text_over)
    vision = SiglipVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        initializer_range=0.2,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=Gemma3TextConfig(**kw),
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=zoo.TINY_IMAGE_TOKEN,
        boi_token_index=zoo.TINY_IMAGE_TOKEN - 1,
        eoi_token_index=zoo.TINY_IMAGE_TOKEN - 2,
        initializer_range=0.2,
    )


def build_tiny(config):
    """A random Gemma3 whose image features are not all zero.

    transformers initializes ``mm_input_projection_weight`` to zeros (trained checkpoints load theirs),
    which would make every image feature 0 and the image (and its bidirectional mask) invisible.
    """
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    return model


def _build():
    return build_tiny(tiny_gemma3_config())


zoo.register_builtin("tiny-gemma3", "gemma3", _build)
