"""Visual-token pruning support shared by the pass, verify and inspect: fidelity, cost model and the picture.

The graph rewrite itself lives in the package (``passes/prune_visual_tokens/__init__.py``); this module holds what other
commands also need: which tokens a pruned package keeps for an image, how close a pruned package's
outputs stay to the unpruned ones, what the pruning saves, and a PNG of the kept patches.
"""

from __future__ import annotations

import copy
import io
import logging

import numpy as np

from vlmc import metrics
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.report import kv_bytes_per_token

logger = logging.getLogger(__name__)

INDICES_OUTPUT = "image_token_indices"
DEFAULT_PROMPT = "Describe the image."


def facts(pkg: Package) -> dict | None:
    """The manifest's ``vision.pruning`` section, or None for an unpruned package."""
    return pkg.manifest.get("vision", {}).get("pruning")


def variant(pkg: Package, graphs: dict | None = None, vision: dict | None = None) -> Package:
    """An in-memory copy of a package sharing its files, with some graphs and vision facts replaced.

    Unchanged graphs stay on disk (or shared in memory), so building variants is cheap.
    """
    out = pkg.snapshot()
    if vision is not None:
        out.manifest["vision"] = copy.deepcopy(vision)
    for name, model in (graphs or {}).items():
        out.set_graph(name, model)
    return out


def prefill_flops(layers: int, hidden: int, intermediate: int, tokens: int) -> float:
    """FastV's prefill cost of a decoder: layers × (4nd² + 2n²d + 2ndm) for n tokens."""
    n, d, m = float(tokens), float(hidden), float(intermediate)
    return layers * (4 * n * d * d + 2 * n * n * d + 2 * n * d * m)


def savings(manifest: dict, tokens_before: int, tokens_after: int, text_tokens: int) -> dict:
    """Visual tokens, KV bytes per image and FastV prefill FLOPs before and after pruning."""
    per_token = kv_bytes_per_token(manifest)
    out = {
        "visual_tokens_before": tokens_before,
        "visual_tokens_after": tokens_after,
        "kv_bytes_per_image_before": per_token * tokens_before,
        "kv_bytes_per_image_after": per_token * tokens_after,
    }
    t, kv = manifest["text"], manifest["kv"]
    inter = t.get("intermediate_size")
    if t.get("hidden_size") and inter:
        before = prefill_flops(
            int(kv["layers"]), int(t["hidden_size"]), int(inter), text_tokens + tokens_before
        )
        after = prefill_flops(
            int(kv["layers"]), int(t["hidden_size"]), int(inter), text_tokens + tokens_after
        )
        out.update(
            {
                "prefill_text_tokens": text_tokens,
                "prefill_flops_before": before,
                "prefill_flops_after": after,
                "prefill_flops_saved": 1.0 - after / before,
            }
        )
    else:
        out["prefill_flops_saved"] = None  # the manifest lacks text.intermediate_size
    return out


def fidelity(
    reference: Package,
    variants: dict[str, Package],
    images: list,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = 8,
) -> dict:
    """Run the unpruned package and each pruned variant on the same images; compare first-token logits and greedy text.

    Every image is one prompt of a batch. Sessions of graphs the variants share with the reference
    are reused so a large decoder is loaded once.
    """
    from vlmc.runtime import Pipeline

    ref_pipe = Pipeline(reference)
    prompts = [prompt] * len(images)
    per = [[img] for img in images]
    ref = ref_pipe.generate(prompts, per, max_new_tokens)
    out = {}
    for name, pkg in variants.items():
        pipe = Pipeline(pkg)
        for g in pkg.graph_names:
            if not pkg.is_loaded(g) or (reference.is_loaded(g) and reference.model(g) is pkg.model(g)):
                pipe._sessions[g] = ref_pipe.session(g)  # same graph: reuse the loaded session
        got = pipe.generate(prompts, per, max_new_tokens)
        row = metrics.logits_agreement(ref.prefill_logits, got.prefill_logits)
        prefix = metrics.common_prefix(ref.tokens, got.tokens)
        row.update(
            {
                "common_prefix": prefix,
                "common_prefix_mean": float(np.mean(prefix)),
                "visual_tokens": got.image_tokens // max(len(images), 1),
            }
        )
        out[name] = row
    out["reference_visual_tokens"] = ref.image_tokens // max(len(images), 1)
    return out


# ---- kept tokens and the picture ----------------------------------------------------------------
def kept_indices(pkg: Package, image) -> tuple[np.ndarray, dict]:
    """Run a pruned package's image chain on one image: (kept token indices [k], preprocessed inputs)."""
    from vlmc.runtime import Pipeline, preprocess

    p = facts(pkg)
    if p is None:
        raise VlmcError(
            "the package is not pruned (no vision.pruning in vlmc.json); run the prune_visual_tokens pass first"
        )
    pipe = Pipeline(pkg)
    vision = preprocess.preprocess([image], pkg.manifest["vision"]["preprocess"])
    out = pipe.run_chain(pkg.manifest["pipeline"]["image"], vision)
    name = p.get("indices_output", INDICES_OUTPUT)
    if name not in out:
        raise VlmcError(f"the image chain does not output {name!r}; the package's pruning facts are stale")
    return np.asarray(out[name]).reshape(-1, int(p["keep"]))[0], vision


def token_grid(vision_facts: dict) -> tuple[int, int] | None:
    """Rows and columns of visual tokens over the image, from the manifest (None if unknown)."""
    if vision_facts.get("token_grid"):
        return tuple(int(x) for x in vision_facts["token_grid"])  # type: ignore[return-value]
    grid = vision_facts.get("patch_grid")
    if not grid:
        return None
    merge = int(vision_facts.get("spatial_merge_size", 1) or 1)
    return int(grid[0]) // merge, int(grid[1]) // merge


def _display_image(image, vision: dict, vfacts: dict) -> np.ndarray:
    """The picture the vision tower saw (uint8 HWC): de-normalized pixel_values when they are NCHW."""
    from vlmc.runtime import preprocess

    pix = vision.get("pixel_values")
    pre = vfacts.get("preprocess", {})
    if pix is not None and pix.ndim == 4 and "mean" in pre and "std" in pre:
        x = pix[0].transpose(1, 2, 0) * np.array(pre["std"], np.float32) + np.array(pre["mean"], np.float32)
        x = x / float(pre.get("rescale_factor", 1 / 255))
        return np.clip(np.rint(x), 0, 255).astype(np.uint8)
    return preprocess.load_image(image)


def picture(pkg: Package, image, scale_to: int = 336) -> bytes:
    """PNG of the image with the kept patches outlined and the dropped ones dimmed."""
    from PIL import Image, ImageDraw

    vfacts = pkg.manifest["vision"]
    idx, vision = kept_indices(pkg, image)
    grid = token_grid(vfacts)
    if grid is None and vision.get("image_grid_thw") is not None:
        # Dynamic resolution: this image's own grid; tokens of the first frame cover it row-major.
        merge = int(vfacts.get("spatial_merge_size", 1) or 1)
        _, h, w = (int(x) for x in np.asarray(vision["image_grid_thw"])[0])
        grid = (h // merge, w // merge)
    if grid is None:
        raise VlmcError(
            "the manifest gives no patch grid (vision.patch_grid / token_grid); cannot draw the kept patches"
        )
    rows, cols = grid
    p = facts(pkg)
    offset = (
        int(p.get("tokens_before") or rows * cols) - rows * cols
    )  # a leading CLS feature token has no patch
    img = Image.fromarray(_display_image(image, vision, vfacts)).convert("RGB")
    side = max(scale_to, img.width, img.height)
    img = img.resize((side * cols // max(rows, cols), side * rows // max(rows, cols)), Image.BICUBIC)
    ch, cw = img.height / rows, img.width / cols
    kept = {int(i) - offset for i in idx if int(i) >= offset}
    shade = Image.new("RGBA", img.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(shade)
    for t in range(rows * cols):
        r, c = divmod(t, cols)
        box = (round(c * cw), round(r * ch), round((c + 1) * cw) - 1, round((r + 1) * ch) - 1)
        if t in kept:
            draw.rectangle(box, outline=(255, 215, 0, 255))
        else:
            draw.rectangle(box, fill=(0, 0, 0, 170))
    out = Image.alpha_composite(img.convert("RGBA"), shade).convert("RGB")
    buf = io.BytesIO()
    out.save(buf, format="PNG")
    return buf.getvalue()
