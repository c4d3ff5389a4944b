"""What the native rebuilds of remote-code repos (qwen_vl, phi3_v) share: the hub checkpoint under the model's
own names, loading it on the meta device one tensor at a time, the layer stacks a streamed export reads, and
greedy generation for their references."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from vlmc.errors import VlmcError
from vlmc.exporters import checkpoint, streaming

logger = logging.getLogger(__name__)

# model key -> (checkpoint key, rows of it or None): a family's ``hub_key``
Locate = Callable[[str], tuple[str, tuple[int, int] | None]]


def mapped_checkpoint(
    path: Path,
    held: dict,
    expected: dict,
    locate: Locate,
    fused_rows: Callable[[str], int],
    computed: frozenset[str] = frozenset(),
) -> streaming.Checkpoint:
    """The checkpoint's tensors for every weight of ``expected`` (a model's state dict, meta tensors), each
    checked against the shape the config implies: a row block of a fused projection against the whole
    tensor, whose row count is ``fused_rows(checkpoint key)``. Keys in ``computed`` may be absent (made by
    the family where a checkpoint leaves them out)."""
    files, rows = {}, {}
    for key, want in expected.items():
        name, span = locate(key)
        tensor = held.get(name)
        if tensor is None:
            if key in computed:
                continue
            missing = len({locate(k)[0] for k in expected if k not in computed} - set(held))
            raise VlmcError(f"{path}: the checkpoint has no weights for {name} ({missing} missing)")
        if tensor.dtype not in checkpoint.FLOAT_WEIGHTS:
            raise VlmcError(
                f"{path}: weight {name} is {tensor.dtype}, not a float ({', '.join(checkpoint.FLOAT_WEIGHTS)})"
            )
        implied = list(want.shape)
        if span is not None:
            rows[key] = span
            implied[0] = fused_rows(name)
        if list(tensor.shape) != implied:
            raise VlmcError(
                f"{path}: weight {name} has shape {list(tensor.shape)}, the config implies {implied}"
            )
        files[key] = (tensor.shard, name)
    return streaming.Checkpoint(path, files, rows)


def load(
    path: Path,
    model_class,
    config,
    built,
    checkpoint_for: Callable[[dict], streaming.Checkpoint],
    computed: dict[str, Callable[[], torch.Tensor]] | None = None,
    rebuild: Callable[[torch.nn.Module], None] | None = None,
):
    """Build the model of ``built`` (``config``, or a copy with its layer stacks cut) on the meta device and load
    its weights from the checkpoint one tensor at a time in FP32, reading only the rows each weight is.

    ``checkpoint_for`` maps the full model's meta state dict to its :class:`streaming.Checkpoint`; ``computed``
    makes the weights a checkpoint may leave out; ``rebuild`` makes the family's computed buffers (in no
    checkpoint) again off the meta device. The decoder's rotary table is made here. The model keeps its
    checkpoint as ``_vlmc_checkpoint`` (for :func:`stream_stacks`)."""
    computed = computed or {}
    with torch.device("meta"):
        full = model_class(config)
        model = full if built is config else model_class(built)
    ckpt = checkpoint_for(full.state_dict())
    state = {key: ckpt.tensor(key).float() if key in ckpt else computed[key]() for key in model.state_dict()}
    model.load_state_dict(state, strict=True, assign=True)
    lm = model.language_model
    lm.model.rotary_emb = type(lm.model.rotary_emb)(config=lm.config)
    if rebuild is not None:
        rebuild(model)
    left = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if left:
        raise VlmcError(f"{path}: {left[0]} was not loaded")
    model._vlmc_checkpoint = ckpt
    return model.eval()


def stream_stacks(model, stacks: list[tuple[str, torch.nn.ModuleList, int]]) -> None:
    """Mark each cut layer stack ``(checkpoint prefix, module list, full depth)`` deeper than what was built:
    the streamed export reads its other layers from the model's checkpoint (vlmc/exporters/streaming.py)."""
    for prefix, module, depth in stacks:
        if depth > len(module):
            module._vlmc_stack = streaming.Stack(
                prefix=prefix, depth=depth, checkpoint=model._vlmc_checkpoint
            )


@torch.no_grad()
def greedy(language_model, embeds, mask, input_ids, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """Greedy decoding with the KV cache from the prompt's embeddings (left-padded batches: ``mask`` marks the
    real tokens); returns prompt + new ids, as transformers' ``generate``."""
    from transformers import DynamicCache

    if eos_token_id is None:
        eos = set()
    else:
        eos = set(eos_token_id) if isinstance(eos_token_id, list) else {eos_token_id}
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, out, done = DynamicCache(), input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for _step in range(max_new_tokens):
        logits = language_model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        ).logits[:, -1]
        nxt = logits.argmax(-1)
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= torch.tensor([int(t) in eos for t in nxt])
        if bool(done.all()):
            break
        embeds = language_model.get_input_embeddings()(nxt[:, None])
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    return out
