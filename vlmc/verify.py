"""vlmc verify: the package on onnxruntime against the source model in transformers, from raw inputs.

The transformers side starts from the image files and the prompt text and goes through the source
directory's own processor (AutoProcessor, with its chat template for a plain prompt); no vlmc preprocessing
or tokenization is involved there. Reported separately, written to verify.json:
(a) input ids and pixel values / image grids, the runtime's against the processor's;
(b) prefill logits; (c) greedy tokens over N new tokens.
Exact packages must have identical (a), be token-exact and have logits within 1e-4; lossy packages (pruned,
quantized) report fidelity numbers and are held to thresholds only when they are given.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from vlmc import exporters, metrics, outdir, pass_api, report, runtime, ui
from vlmc.errors import VlmcError
from vlmc.exporters import load_source, processor
from vlmc.package import Package
from vlmc.passes.prune_visual_tokens import measure
from vlmc.runtime import preprocess
from vlmc.runtime.pipeline import Inputs

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = ["Describe the image."]
DEFAULT_MAX_LOGIT_DIFF = 1e-4
# Pixel values are float32 from the same PIL resize and normalization on both sides (a few ulp apart);
# anything larger is a different preprocessing.
MAX_PIXEL_DIFF = 1e-5


@dataclass
class VerifyResult:
    source: str
    prompts: int
    max_new_tokens: int
    prefill_logits_max_abs_diff: float
    prefill_logits_cosine: float
    top1_agreement: float
    token_agreement: float
    common_prefix: list[int]
    tokens_package: list[list[int]]
    tokens_reference: list[list[int]]
    exact_package: bool
    passed: bool
    thresholds: dict
    prefill_logits_kl: float | None = None  # KL(reference || package) of the first-token distribution, nats
    top5_agreement: float | None = (
        None  # share of the reference's 5 best first tokens the package also ranks top-5
    )
    visual_tokens: dict | None = None  # per image, package vs reference (differs for pruned packages)
    # (a): the runtime's ids / pixel values / grids against the source processor's (see compare_inputs)
    inputs: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def is_lossy(pkg: Package) -> bool:
    """True if a pass that changes numerics on purpose (pruning, quantization) modified the package."""
    reg = pass_api.registry()
    return any(
        h.get("modified") and getattr(reg.get(h["pass"]), "lossy", False) for h in pkg.manifest["history"]
    )


def reference_source(pkg: Package, trust_remote_code: bool = False, allow_pickle: bool = False):
    """Load the package's source in transformers and check it is the one that was exported."""
    src = pkg.manifest["model"]["source"]
    source = load_source(src, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    if source.config_hash != pkg.manifest["model"]["config_hash"]:
        raise VlmcError(
            f"source {src} has a different config than the one exported "
            f"({source.config_hash} vs {pkg.manifest['model']['config_hash']})"
        )
    return source


def reference_model(pkg: Package, trust_remote_code: bool = False, allow_pickle: bool = False):
    return reference_source(pkg, trust_remote_code, allow_pickle).model


def _pil(ref):
    """A raw image for the processor: a file path as given (transformers opens it), pictures as PIL images."""
    from pathlib import Path

    import numpy as np
    from PIL import Image

    if isinstance(ref, np.ndarray):
        return Image.fromarray(ref)
    if Path(str(ref)).is_file():
        preprocess.load_image(
            ref
        )  # the same checks (pixel bound from the header) before transformers opens it
        return str(ref)
    # 'demo:N' is vlmc's synthetic picture (uint8 pixels); making it is not preprocessing.
    return Image.fromarray(preprocess.load_image(ref))


def processor_inputs(pkg: Package, proc, prompts: list[str], images: list[list]):
    """The source processor's model inputs (torch) for raw prompts and images, as a transformers user
    makes them.

    A prompt with the image marker is given to the processor as is; a plain prompt is first rendered with
    the processor's chat template (images first, then the text; apply_chat_template's rule for BOS), or,
    without one, filled into the manifest's prompt_template. A processor that puts its image tokens first by
    itself (text.image_tokens_first: BLIP-2) gets the text without the marker.
    """
    t = pkg.manifest["text"]
    marker = t.get("image_marker", "<image>")
    template = processor.chat_template(proc)
    tok = processor.tokenizer_of(proc)
    texts, add_special = [], True
    for prompt, per in zip(prompts, images):
        if marker in prompt:
            text = prompt
        elif template is not None:
            conv = [
                {
                    "role": "user",
                    "content": [{"type": "image"}] * len(per) + [{"type": "text", "text": prompt}],
                }
            ]
            text = proc.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            if tok.bos_token is not None and text.startswith(tok.bos_token):
                add_special = False
        else:
            fill = t.get("prompt_template", "{prompt}")
            text = (fill if per else fill.replace(marker, "")).replace("{prompt}", prompt)
        if t.get("image_tokens_first"):
            text = text.replace(marker, "")
        texts.append(text)
    flat = [_pil(i) for per in images for i in per]
    if flat and pkg.manifest["vision"].get("processor_images") == "per_prompt":
        # processors that take a batch's images as one list per prompt (Gemma3Processor)
        flat = [[_pil(i) for i in per] for per in images]
    tok.padding_side = "left"  # batched generation with a decoder-only model
    return proc(
        images=flat or None, text=texts, padding=True, add_special_tokens=add_special, return_tensors="pt"
    )


def _free_rows(pkg: Package) -> int | None:
    """The image token id when the manifest says the ids at image rows carry nothing (text.image_row_ids
    "free": the features replace them; Qwen-VL's processor writes the picture's path bytes there)."""
    if pkg.manifest["text"].get("image_row_ids") == "free":
        return int(pkg.manifest["vision"]["image_token_id"])
    return None


def compare_inputs(runtime: Inputs, ref: dict, free_rows: int | None = None) -> dict:
    """(a): each prompt's unpadded ids and the vision inputs, runtime against processor.

    The first difference is named, e.g. "token ids differ at position 581: processor 29871, vlmc 13".
    ``free_rows``: an image token id whose rows in the runtime's ids are not compared (see :func:`_free_rows`).
    """
    import numpy as np

    out = {"checked": True, "ids_equal": True, "first_difference": None, "pixel_max_abs_diff": None}
    ref_ids, ref_mask = ref["input_ids"].numpy(), ref["attention_mask"].numpy()
    for b in range(max(len(ref_ids), len(runtime.input_ids))):
        if b >= len(ref_ids) or b >= len(runtime.input_ids):
            out.update(
                ids_equal=False,
                first_difference=(
                    f"batch sizes differ: processor {len(ref_ids)}, vlmc {len(runtime.input_ids)}"
                ),
            )
            break
        want = ref_ids[b][ref_mask[b] == 1].tolist()
        got = runtime.input_ids[b][runtime.attention_mask[b] == 1].tolist()
        if free_rows is not None and len(want) == len(got):
            want = [g if g == free_rows else w for w, g in zip(want, got)]
        if want == got:
            continue
        where = f"prompt {b}: " if len(ref_ids) > 1 else ""
        i = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)
        if i is None:
            msg = (
                f"{where}token ids differ in length: processor {len(want)}, vlmc {len(got)} "
                f"(equal for the first {min(len(want), len(got))})"
            )
        else:
            msg = f"{where}token ids differ at position {i}: processor {want[i]}, vlmc {got[i]}"
        out.update(ids_equal=False, first_difference=msg)
        break
    for key, value in runtime.vision.items():
        if key not in ref:
            out.setdefault("vision_difference", f"the processor gives no {key}, which the runtime feeds")
            continue
        want = ref[key].numpy()
        if want.shape != value.shape:
            out.setdefault(
                "vision_difference",
                f"{key} shapes differ: processor {list(want.shape)}, vlmc {list(value.shape)}",
            )
            out[f"{key}_equal"] = False
        elif np.issubdtype(want.dtype, np.floating):
            d = float(np.abs(want.astype(np.float64) - value.astype(np.float64)).max()) if want.size else 0.0
            out["pixel_max_abs_diff"] = max(d, out["pixel_max_abs_diff"] or 0.0)
            out[f"{key}_equal"] = d <= MAX_PIXEL_DIFF
            if d > MAX_PIXEL_DIFF:
                out.setdefault("vision_difference", f"{key} differ: max |diff| {d:.3g}")
        else:
            eq = bool(np.array_equal(want, value))
            out[f"{key}_equal"] = eq
            if not eq:
                out.setdefault(
                    "vision_difference", f"{key} differ: processor {want.tolist()}, vlmc {value.tolist()}"
                )
    out["passed"] = out["ids_equal"] and "vision_difference" not in out
    return out


def reference_generate(model, inp, max_new_tokens: int, eos, pad: int):
    """Prefill logits at the last position and greedy tokens from transformers.

    ``inp`` is the processor's output (a dict of tensors), or runtime Inputs for a built-in (no processor).
    """
    import torch

    if isinstance(inp, Inputs):
        feeds = {
            "input_ids": torch.from_numpy(inp.input_ids),
            "attention_mask": torch.from_numpy(inp.attention_mask),
        }
        feeds.update({k: torch.from_numpy(v) for k, v in inp.vision.items()})
        feeds.update({k: torch.from_numpy(v) for k, v in inp.extra.items()})
    else:
        feeds = dict(inp)
    with torch.no_grad():
        logits = model(**feeds).logits[:, -1, :].float().numpy()
        gen = model.generate(
            **feeds,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    new = gen[:, feeds["input_ids"].shape[1] :].numpy()
    eos_ids = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    tokens = []
    for row in new:
        seq = []
        for t in row.tolist():
            seq.append(int(t))
            if t in eos_ids:
                break
        tokens.append(seq)
    return logits, tokens


def reference_inputs(pkg: Package, prompts: list[str], images: list[list]) -> Inputs | None:
    """Inputs for the source model when a pass changed the placeholder count (pruning), else None.

    The source model expects every visual token, so its prompts are expanded with the unpruned
    count that ``vision.pruning`` records.
    """
    p = measure.facts(pkg)
    if not p:
        return None
    vision = dict(
        pkg.manifest["vision"], tokens_per_image=p.get("unpruned_tokens_per_image", p["tokens_before"])
    )
    return runtime.prepare(measure.variant(pkg, vision=vision), prompts, images)


def verify(
    pkg: Package,
    max_new_tokens: int = 20,
    prompts: list[str] | None = None,
    images: list[list] | None = None,
    max_logit_diff: float | None = None,
    min_token_agreement: float | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> VerifyResult:
    """Compare the package against transformers on the same inputs (see module docstring)."""
    prompts = prompts or DEFAULT_PROMPTS
    if images is None:
        images = [[f"demo:{i}"] for i in range(len(prompts))]
    inp = runtime.prepare(pkg, prompts, images)
    # For a pruned package the source model (and its processor) see every visual token.
    runtime_ref = reference_inputs(pkg, prompts, images) or inp
    with ui.progress("verify: loading the source model in transformers"):
        source = reference_source(pkg, trust_remote_code, allow_pickle)
    model = source.model
    family = exporters.families().get(pkg.manifest["model"]["family"])
    if source.directory is not None and hasattr(family, "reference_inputs"):
        # a natively rebuilt remote-code family: its processor is code vlmc does not run, so the family
        # writes the processor's inputs as that code does (from outside vlmc's runtime)
        ref_inp = family.reference_inputs(
            source.directory, pkg.manifest, prompts, [[_pil(i) for i in per] for per in images]
        )
        checked = compare_inputs(runtime_ref, ref_inp, _free_rows(pkg))
        checked["processor"] = f"{pkg.manifest['model']['family']}.reference_inputs"
    elif source.directory is not None and pkg.manifest["text"].get("tokenizer") == "source":
        proc = processor.load(source.directory, trust_remote_code)
        ref_inp = processor_inputs(pkg, proc, prompts, images)
        checked = compare_inputs(runtime_ref, ref_inp)
        checked["processor"] = type(proc).__name__
    else:
        # A built-in (or a source without tokenizer files) has no processor: both sides use the runtime's
        # byte-tokenizer inputs, and (a) is not checked.
        ref_inp = runtime_ref
        checked = {"checked": False, "passed": True, "reason": "no source processor (byte tokenizer)"}
    t = pkg.manifest["text"]
    with ui.progress(f"verify: transformers generate ({max_new_tokens} tokens)"):
        ref_logits, ref_tokens = reference_generate(
            model, ref_inp, max_new_tokens, t.get("eos_token_id"), int(t.get("pad_token_id") or 0)
        )
    with ui.progress(f"verify: package generate on onnxruntime ({max_new_tokens} tokens)"):
        # What `vlmc run` runs: a Pipeline, or for a sharded package its rank processes joined by gloo
        # (docs/tensor_parallel.md), chosen by the runtime's one dispatch.
        runnable = runtime.open(pkg)
        try:
            got = runnable.generate_from(inp, max_new_tokens)
        finally:
            runnable.close()
    c = metrics.generation_agreement(ref_logits, ref_tokens, got.prefill_logits, got.tokens)
    image_id = int(pkg.manifest["vision"]["image_token_id"])
    n_images = max(sum(inp.image_counts), 1)
    tokens = {
        "package": int((inp.input_ids == image_id).sum()) // n_images,
        "reference": int((runtime_ref.input_ids == image_id).sum()) // n_images,
    }
    exact = not is_lossy(pkg)
    if exact:
        max_logit_diff = DEFAULT_MAX_LOGIT_DIFF if max_logit_diff is None else max_logit_diff
        min_token_agreement = 1.0 if min_token_agreement is None else min_token_agreement
    ok = bool(checked["passed"]) or not exact
    if max_logit_diff is not None and c["max_abs_diff"] > max_logit_diff:
        ok = False
    if min_token_agreement is not None and c["token_agreement"] < min_token_agreement:
        ok = False
    res = VerifyResult(
        source=pkg.manifest["model"]["source"],
        prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        prefill_logits_max_abs_diff=c["max_abs_diff"],
        prefill_logits_cosine=c["cosine"],
        top1_agreement=c["top1"],
        token_agreement=c["token_agreement"],
        common_prefix=c["common_prefix"],
        tokens_package=got.tokens,
        tokens_reference=ref_tokens,
        exact_package=exact,
        passed=ok,
        thresholds={"max_logit_diff": max_logit_diff, "min_token_agreement": min_token_agreement},
        prefill_logits_kl=c["kl"],
        top5_agreement=c["top5"],
        visual_tokens=tokens,
        inputs=checked,
    )
    return res


def write(pkg: Package, result: VerifyResult) -> None:
    """Store verify.json in the package directory (a report file, not part of the manifest)."""
    if pkg.root is not None:
        # The digest ties the numbers to this exact package, so a later optimize does not inherit them.
        data = dict(result.to_dict(), manifest_sha256=report.manifest_digest(pkg.manifest))
        # Through the one output writer: atomic, and a link at the name is replaced, never followed.
        outdir.write_file(pkg.root, "verify.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
        pkg.report["verify"] = data  # report.md shows parity/fidelity numbers: keep it in step
        report.write(pkg, pkg.root)
