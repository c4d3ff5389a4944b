"""vlmc verify: run the source model in transformers and the package on onnxruntime on the same inputs.

Reports prefill logits max |diff| and greedy token agreement over N new tokens, writes verify.json.
Exact packages must be token-exact with logits within 1e-4; lossy packages (pruned, quantized) report
fidelity numbers and are held to thresholds only when they are given.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from vlmc import metrics, pass_api, pruning, ui
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import Pipeline
from vlmc.runtime.pipeline import Inputs

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = ["Describe the image."]
DEFAULT_MAX_LOGIT_DIFF = 1e-4


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

    def to_dict(self) -> dict:
        return asdict(self)


def is_lossy(pkg: Package) -> bool:
    """True if a pass that changes numerics on purpose (pruning, quantization) modified the package."""
    reg = pass_api.registry()
    return any(
        h.get("modified") and getattr(reg.get(h["pass"]), "lossy", False) for h in pkg.manifest["history"]
    )


def reference_model(pkg: Package, trust_remote_code: bool = False, allow_pickle: bool = False):
    """Load the package's source model in transformers and check it is the one that was exported."""
    from vlmc.exporters import load_source

    src = pkg.manifest["model"]["source"]
    source = load_source(src, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    if source.config_hash != pkg.manifest["model"]["config_hash"]:
        raise VlmcError(
            f"source {src} has a different config than the one exported "
            f"({source.config_hash} vs {pkg.manifest['model']['config_hash']})"
        )
    return source.model


def reference_generate(model, inp: Inputs, max_new_tokens: int, eos, pad: int):
    """Prefill logits at the last position and greedy tokens from transformers."""
    import torch

    feeds = {
        "input_ids": torch.from_numpy(inp.input_ids),
        "attention_mask": torch.from_numpy(inp.attention_mask),
    }
    feeds.update({k: torch.from_numpy(v) for k, v in inp.vision.items()})
    feeds.update({k: torch.from_numpy(v) for k, v in inp.extra.items()})
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
    new = gen[:, inp.input_ids.shape[1] :].numpy()
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
    p = pruning.facts(pkg)
    if not p:
        return None
    vision = dict(
        pkg.manifest["vision"], tokens_per_image=p.get("unpruned_tokens_per_image", p["tokens_before"])
    )
    return Pipeline(pruning.variant(pkg, vision=vision)).prepare(prompts, images)


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
    pipe = Pipeline(pkg)
    inp = pipe.prepare(prompts, images)
    ref_inp = reference_inputs(pkg, prompts, images) or inp
    with ui.progress("verify: loading the source model in transformers"):
        model = reference_model(pkg, trust_remote_code, allow_pickle)
    t = pkg.manifest["text"]
    with ui.progress(f"verify: transformers generate ({max_new_tokens} tokens)"):
        ref_logits, ref_tokens = reference_generate(
            model, ref_inp, max_new_tokens, t.get("eos_token_id"), int(t.get("pad_token_id") or 0)
        )
    with ui.progress(f"verify: package generate on onnxruntime ({max_new_tokens} tokens)"):
        got = pipe.generate_from(inp, max_new_tokens)
    c = metrics.generation_agreement(ref_logits, ref_tokens, got.prefill_logits, got.tokens)
    image_id = int(pkg.manifest["vision"]["image_token_id"])
    n_images = max(sum(inp.image_counts), 1)
    tokens = {
        "package": int((inp.input_ids == image_id).sum()) // n_images,
        "reference": int((ref_inp.input_ids == image_id).sum()) // n_images,
    }
    exact = not is_lossy(pkg)
    if exact:
        max_logit_diff = DEFAULT_MAX_LOGIT_DIFF if max_logit_diff is None else max_logit_diff
        min_token_agreement = 1.0 if min_token_agreement is None else min_token_agreement
    ok = True
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
    )
    return res


def write(pkg: Package, result: VerifyResult) -> None:
    """Store verify.json in the package directory (a report file, not part of the manifest)."""
    if pkg.root is not None:
        from vlmc import report

        # The digest ties the numbers to this exact package, so a later optimize does not inherit them.
        data = dict(result.to_dict(), manifest_sha256=report.manifest_digest(pkg.manifest))
        (pkg.root / "verify.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        pkg.report["verify"] = data  # report.md shows parity/fidelity numbers: keep it in step
        report.write(pkg, pkg.root)
