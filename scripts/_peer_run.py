"""Run one built model for scripts/bench_peers.py and print its figures as one JSON line.

    python scripts/_peer_run.py vlmc     PATH --image IMG --prompt P --tokens N --threads T --logits F
    python scripts/_peer_run.py openvino DIR  --image IMG --prompt P --tokens N --threads T --logits F [--hint f32]
    python scripts/_peer_run.py ortgenai DIR  --ids IDS.npy          --tokens N --threads T --logits F

Each tool runs in its own venv (vlmc in the project's, the peers in out/peers/venv-*), so this file
imports only the standard library and numpy at the top and each tool's package inside its runner.
Every runner generates ``--tokens`` greedy tokens (eos ignored, so each decodes the same count) and
reports the time to first token (``ttft_s``: from the call to the first token, vision and prefill
included), the decode rate over the remaining tokens (``decode_tok_s``), the first token, and writes
the first token's logits (float32, over the vocabulary) to ``--logits`` for the INT4-vs-FP32 cosine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def run_vlmc(args) -> dict:
    from vlmc import runtime

    pipe = runtime.open(args.path, threads=args.threads)
    stamps: list[float] = []
    step = pipe.step

    def timed_step(*a, **kw):  # the loop's decode call: a time stamp after each token's logits
        out = step(*a, **kw)
        stamps.append(time.perf_counter())
        return out

    # Pipeline.generate stops at eos; a random-weight model may emit it early, so eos is emptied.
    pipe.eos_ids = lambda: set()
    try:
        pipe.generate([args.prompt], [[args.image]], max_new_tokens=2)  # warm: sessions, arenas
        stamps.clear()
        pipe.step = timed_step
        t0 = time.perf_counter()
        res = pipe.generate([args.prompt], [[args.image]], max_new_tokens=args.tokens)
        end = time.perf_counter()
    finally:
        pipe.close()
    np.save(args.logits, res.prefill_logits[0].astype(np.float32))
    n = len(res.tokens[0])
    return {
        "ttft_s": stamps[0] - t0,
        "decode_tok_s": (n - 1) / (end - stamps[0]) if n > 1 else None,
        "tokens": res.tokens[0],
        "prompt_tokens": None,
    }


def _image(path: str):
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def run_openvino(args) -> dict:
    """Timing through openvino_genai.VLMPipeline (its perf metrics); logits through optimum-intel."""
    import openvino as ov
    import openvino_genai as ovg

    props = {"INFERENCE_NUM_THREADS": args.threads}
    if args.hint:
        props["INFERENCE_PRECISION_HINT"] = args.hint
    t = time.perf_counter()
    pipe = ovg.VLMPipeline(args.path, "CPU", **props)
    load_s = time.perf_counter() - t
    image = ov.Tensor(_image(args.image)[None])
    cfg = ovg.GenerationConfig()
    cfg.max_new_tokens = args.tokens
    cfg.min_new_tokens = args.tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    pipe.generate(args.prompt, images=[image], generation_config=cfg)  # warm
    res = pipe.generate(args.prompt, images=[image], generation_config=cfg)
    pm = res.perf_metrics
    out = {
        "ttft_s": pm.get_ttft().mean / 1e3,
        "decode_tok_s": 1e3 / pm.get_tpot().mean,
        "load_s": load_s,
        "prompt_tokens": int(pm.get_num_input_tokens()),
        "generated_text": res.texts[0][:80],
    }
    del pipe
    # the first token's logits, from the same files through optimum-intel (VLMPipeline does not expose them)
    import torch
    from optimum.intel import OVModelForVisualCausalLM
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(args.path)
    model = OVModelForVisualCausalLM.from_pretrained(
        args.path, ov_config={k: str(v) for k, v in props.items()}, compile=True
    )
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": args.prompt}]}]
    text = proc.apply_chat_template(conv, add_generation_prompt=True) if proc.chat_template else args.prompt
    inputs = proc(images=Image.open(args.image).convert("RGB"), text=text, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(
            **inputs, max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    logits = gen.logits[0][0].float().numpy()
    np.save(args.logits, logits.astype(np.float32))
    out["tokens"] = [int(logits.argmax())]
    out["logits_prompt_tokens"] = int(inputs["input_ids"].shape[1])
    return out


def run_ortgenai(args) -> dict:
    """The text decoder alone (the builder refuses LLaVA): prefill of ``--ids``, then decode."""
    import onnxruntime_genai as og

    cfg_path = f"{args.path}/genai_config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    opts = cfg["model"]["decoder"].setdefault("session_options", {})
    opts["intra_op_num_threads"] = args.threads
    opts["inter_op_num_threads"] = 1
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=4)
    ids = np.load(args.ids).astype(np.int32)
    model = og.Model(args.path)

    def generate(n: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)  # the prefill: runs the model over the prompt
        gen.generate_next_token()  # picks the first token from the prefill's logits
        first = time.perf_counter()
        logits = np.array(gen.get_output("logits"))
        toks = [int(gen.get_next_tokens()[0])]
        for _ in range(n - 1):  # one decode step each
            gen.generate_next_token()
            toks.append(int(gen.get_next_tokens()[0]))
        end = time.perf_counter()
        return t0, first, end, logits, toks

    generate(2)  # warm
    t0, first, end, logits, toks = generate(args.tokens)
    np.save(args.logits, logits.reshape(-1, logits.shape[-1])[-1].astype(np.float32))
    return {
        "ttft_s": first - t0,
        "decode_tok_s": (len(toks) - 1) / (end - first),
        "tokens": toks,
        "prompt_tokens": len(ids),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tool", choices=["vlmc", "openvino", "ortgenai"])
    ap.add_argument("path")
    ap.add_argument("--image")
    ap.add_argument("--prompt", default="Describe the image.")
    ap.add_argument("--ids", help="ortgenai: the prompt's token ids (.npy)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hint", help="openvino: INFERENCE_PRECISION_HINT (default: the device's)")
    ap.add_argument("--logits", required=True)
    args = ap.parse_args()
    res = {"vlmc": run_vlmc, "openvino": run_openvino, "ortgenai": run_ortgenai}[args.tool](args)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
