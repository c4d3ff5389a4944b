"""Write a random-weight Hugging Face checkpoint of any size, one shard at a time (for benchmarks).

``save_pretrained`` needs the whole model in memory (28 GB for a 7 B model in FP32, 14 GB in
bf16). This writes the same files (config.json, safetensors shards under the key names
save_pretrained uses, model.safetensors.index.json) from a model built on the meta device, so at
most one shard is ever in memory. Values: norms 1, biases 0, everything else N(0, 0.02) (windows
into one pool of samples, see write()).

    python scripts/make_checkpoint.py llava-1.5-7b /tmp/ckpt   # the hub config of llava-1.5-7b-hf
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def llava_15_7b_config():
    """llava-hf/llava-1.5-7b-hf's config.json: Vicuna-7B text (Llama, hidden 4096, 32 layers, 32 heads,
    intermediate 11008, vocab 32064), CLIP ViT-L/14-336 vision (24 layers, hidden 1024), feature layer
    -2, image token 32000."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        pad_token_id=32001,
        tie_word_embeddings=False,
    )
    vision = CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=32000,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


CONFIGS = {"llava-1.5-7b": llava_15_7b_config}


def write(
    config, out: Path, model_class=None, shard_bytes: int = 2 << 30, seed: int = 0, dtype="bfloat16"
) -> int:
    """Write the checkpoint; returns the parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    out.mkdir(parents=True, exist_ok=True)
    cls = model_class or AutoModelForImageTextToText
    with torch.device("meta"):
        model = cls.from_config(config) if cls is AutoModelForImageTextToText else cls._from_config(config)
    # the key names save_pretrained writes (transformers reverts its load-time renames on save)
    shapes = revert_weight_conversion(model, dict(model.state_dict()))
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    # Drawing 7 B normal samples takes half an hour on two busy cores; every weight is instead a
    # window at a random offset into one pool of 2**26 samples (different values per tensor, same
    # distribution), which is as fast as the disk.
    pool = (torch.randn(1 << 26, generator=gen) * 0.02).to(tdtype)

    def window(n: int) -> torch.Tensor:
        start = int(torch.randint(0, pool.numel(), (1,), generator=gen))
        reps = -(-(start + n) // pool.numel())
        return (pool.repeat(reps) if reps > 1 else pool)[start : start + n].clone()

    weight_map: dict[str, str] = {}
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in shapes.items():
        n = t.numel() * torch.empty((), dtype=tdtype).element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    total = 0
    params = 0
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key in keys:
            shape = tuple(shapes[key].shape)
            leaf = key.rsplit(".", 1)[-1]
            if leaf == "bias":
                v = torch.zeros(shape, dtype=tdtype)
            elif "norm" in key and leaf == "weight":
                v = torch.ones(shape, dtype=tdtype)
            else:
                v = window(math.prod(shape)).reshape(shape)
            tensors[key] = v
            weight_map[key] = name
            total += v.numel() * v.element_size()
            params += v.numel()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    )
    config.save_pretrained(out)
    return params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", choices=list(CONFIGS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--shard-gib", type=float, default=2.0)
    ap.add_argument("--text-layers", type=int, help="decoder depth instead of the config's")
    ap.add_argument("--vision-layers", type=int, help="vision tower depth instead of the config's")
    args = ap.parse_args()
    cfg = CONFIGS[args.config]()
    if args.text_layers:
        cfg.text_config.num_hidden_layers = args.text_layers
    if args.vision_layers:
        cfg.vision_config.num_hidden_layers = args.vision_layers
    n = write(cfg, args.out, shard_bytes=int(args.shard_gib * 2**30))
    print(f"wrote {args.out}: {n / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
