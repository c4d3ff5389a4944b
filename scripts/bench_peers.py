"""vlmc against OpenVINO GenAI and onnxruntime-genai on the same 512 M real-width LLaVA-1.5, same threads.

The model is scripts/bench.py's ``llava-1.5`` size (llava-1.5-7b-hf's widths, 1 decoder and 2 vision
layers, random weights). Each tool builds it FP32 and INT4 and runs what it built:

- vlmc: `vlmc export` (FP32 package) and `vlmc build` of the issue's quantized recipe (INT8-static
  vision, INT4 g128 decoder) with `target: {backend: ort}` (MatMulNBits); run with `vlmc.runtime.open`.
- OpenVINO: `optimum-cli export openvino --task image-text-to-text` at `--weight-format fp32` and
  `int4 --group-size 128` (optimum-intel + NNCF); run with `openvino_genai.VLMPipeline` (time to first
  token and decode rate from its perf metrics), the first token's logits through optimum-intel.
- onnxruntime-genai: its model builder (`onnxruntime_genai.models.builder`, `-p fp32` and `-p int4`
  with `block_size=128 accuracy_level=4`) on the text decoder alone, written as a LlamaForCausalLM
  checkpoint (the builder refuses LLaVA); run with `onnxruntime_genai` on prompt ids of vlmc's prompt
  length, so its time to first token is a text prefill without the vision tower.

The peers are installed by this script into their own venvs under ``--root`` (never the project
venv), versions pinned below, torch 2.13.0 first in each so no CUDA torch is pulled. The peers'
tokenizer is a byte-level BPE written here (the random model has none; every byte is one token, the
same count as vlmc's byte fallback), with ``<image>`` at the config's image token.

Rounds alternate the order of the builds and of the runs (reversed every other round). Per build:
wall time and peak RSS (scripts/_measure.py), bytes on disk; per run: time to first token, decode
tok/s over ``--tokens`` greedy tokens (eos ignored), and each INT4 model's first-token agreement and
logit cosine against its own FP32. Medians over rounds; ratios peer / vlmc paired within a round.

    .venv/bin/python scripts/bench_peers.py --root out/peers --rounds 2 --threads 2 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench  # noqa: E402  (scripts/ is not a package)

PEERS_HEADING = bench.PEERS_HEADING

# Each peer's venv: torch first (the CPU wheel; an unpinned torch pulls the CUDA build), then these.
# Current releases on PyPI when this was written; optimum-intel 2.2.0 requires transformers < 5.6.
TORCH = "torch==2.13.0"
VENVS = {
    "openvino": [
        "optimum-intel==2.2.0",
        "optimum==2.3.0",
        "openvino==2026.4.1",
        "openvino-tokenizers==2026.4.1.0",
        "openvino-genai==2026.4.1.0",
        "nncf==3.4.0",
        "transformers==5.5.4",
        "pillow",
    ],
    "ortgenai": [
        "onnxruntime-genai==0.18.0",
        "onnxruntime==1.32.0",
        "onnx==1.23.2",
        "onnx-ir==1.1.0",
        "transformers==5.24.0",
        "safetensors",
    ],
}

# Removed after the install: optimum-intel depends on torchvision, and PyPI's torchvision wheel is
# built against the CUDA torch; beside the CPU torch its ops do not load ("operator torchvision::nms
# does not exist"), which breaks transformers' imports. Nothing on the LLaVA path uses it (transformers
# falls back to its PIL image processors).
REMOVE = {"openvino": ["torchvision"]}

PROMPT = "Describe the image."
VLMC_INT4_RECIPE = bench.QUANT_PASSES + "target: {backend: ort}\n"


def venv_python(root: Path, name: str) -> Path:
    return root / f"venv-{name}" / "bin" / "python"


def setup_venvs(root: Path, names: list[str]) -> dict:
    """Create (or reuse) each peer's venv; returns the installed versions of the pinned packages."""
    versions = {}
    for name in names:
        pins = [TORCH, *VENVS[name]]
        stamp = root / f"venv-{name}" / ".bench-peers-pins"
        want = hashlib.sha256("\n".join(pins + REMOVE.get(name, [])).encode()).hexdigest()
        py = venv_python(root, name)
        if not (stamp.is_file() and stamp.read_text() == want):
            print(f"installing the {name} venv ({', '.join(pins)}) ...", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(root / f"venv-{name}")], check=True)
            pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            subprocess.run([*pip, TORCH], check=True)
            subprocess.run([*pip, TORCH, *VENVS[name]], check=True)
            if REMOVE.get(name):
                subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *REMOVE[name]], check=True)
            stamp.write_text(want)
        names_only = [p.split("==")[0] for p in pins]
        out = subprocess.run(
            [
                str(py),
                "-c",
                "import sys, importlib.metadata as m; print({n: m.version(n) for n in sys.argv[1:]})",
            ]
            + names_only,
            capture_output=True,
            text=True,
            check=True,
        )
        versions[name] = eval(out.stdout)  # noqa: S307  (a dict literal this script's child printed)
    return versions


def byte_tokenizer(vocab_size: int, image_token: int, pad_token: int):
    """A byte-level BPE with no merges (every UTF-8 byte one token), specials at the LLaVA ids.

    The random-weight model has no tokenizer and the peers' pipelines need one: ids 0 ``<unk>``, 1
    ``<s>``, 2 ``</s>``, 3..258 the bytes (vlmc's byte fallback layout), filler tokens up to
    ``vocab_size``, ``<image>`` and ``<pad>`` at the config's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c)):
        vocab[ch] = len(vocab)
    specials = {image_token: "<image>", pad_token: "<pad>"}
    for i in range(len(vocab), vocab_size):
        vocab[specials.get(i, f"<filler_{i}>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return fast


def _byte_of(ch: str) -> int:
    """The byte a GPT-2 byte-level alphabet character stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs[cs.index(ord(ch))]


# LLaVA-1.5's prompt form (content as a string, as openvino_genai passes it, or as typed parts)
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    " {% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def make_models(root: Path, size: str = "llava-1.5") -> dict:
    """The LLaVA checkpoint (vlmc's input; scripts/bench.py's ``size``), the same with tokenizer and
    processor files (the peers'), and its text decoder as a LlamaForCausalLM checkpoint
    (onnxruntime-genai's). Kept under ``root`` and reused."""
    import torch
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor

    peers_dir, text_dir = root / "model-peers", root / "model-text"
    done = root / "model" / ".made"
    if done.is_file() and json.loads(done.read_text())["size"] == size:
        return json.loads(done.read_text())
    for d in (root / "model", peers_dir, text_dir):
        shutil.rmtree(d, ignore_errors=True)
    model_dir, params = bench.make_model_dir(size, root / "model")
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    tok = byte_tokenizer(cfg.text_config.vocab_size, cfg.image_token_index, cfg.image_token_index + 1)
    v = cfg.vision_config
    image_proc = CLIPImageProcessor(
        size={"shortest_edge": v.image_size}, crop_size={"height": v.image_size, "width": v.image_size}
    )
    proc = LlavaProcessor(
        image_processor=image_proc,
        tokenizer=tok,
        patch_size=v.patch_size,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    shutil.rmtree(peers_dir, ignore_errors=True)
    peers_dir.mkdir(parents=True)
    for f in model_dir.iterdir():  # the same weights: hard links, no second copy on disk
        os.link(f, peers_dir / f.name)
    proc.save_pretrained(peers_dir)
    # the text decoder alone, for the onnxruntime-genai builder: the LLaVA's language model and LM head
    # under LlamaForCausalLM's key names, written as they are (no model built, no second init)
    from safetensors.torch import save_file

    text_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, t in model.state_dict().items():
        if k.startswith("model.language_model."):
            state["model." + k[len("model.language_model.") :]] = t.contiguous()
        elif k.startswith("lm_head."):
            state[k] = t.contiguous()
    save_file(state, str(text_dir / "model.safetensors"), metadata={"format": "pt"})
    tcfg = cfg.text_config
    tcfg.architectures = ["LlamaForCausalLM"]
    tcfg.tie_word_embeddings = False
    tcfg.pad_token_id = cfg.image_token_index + 1
    tcfg.bos_token_id, tcfg.eos_token_id = 1, 2
    tcfg.save_pretrained(text_dir)
    tok.save_pretrained(text_dir)
    del model, state
    image = root / "model" / "image.png"
    from PIL import Image

    from vlmc.runtime import preprocess

    Image.fromarray(preprocess.demo_image(size=v.image_size)).save(image)
    # the text-only decoder's prompt: the LLaVA prompt's length (vlmc's byte ids), with seeded random
    # byte ids where the image's 576 placeholders stand (the text decoder has no vision tower)
    n_image = (v.image_size // v.patch_size) ** 2
    rng = np.random.default_rng(0)
    ids = [1, *tok.encode("USER: ", add_special_tokens=False), *rng.integers(3, 259, n_image).tolist()]
    ids += tok.encode("\n" + PROMPT + " ASSISTANT:", add_special_tokens=False)
    np.save(root / "model" / "ids.npy", np.array(ids, np.int64))
    facts = {
        "size": size,
        "model_dir": str(model_dir),
        "peers_dir": str(peers_dir),
        "text_dir": str(text_dir),
        "image": str(image),
        "ids": str(root / "model" / "ids.npy"),
        "params": params,
        "fp32_weight_bytes": params * 4,
    }
    done.write_text(json.dumps(facts))
    return facts


def builds(root: Path, facts: dict, tools: list[str]) -> dict:
    """name -> (build command, output directory, the directory whose bytes count, run command stem)."""
    vlmc = str(Path(sys.executable).parent / "vlmc")
    out = root / "out"
    recipe = root / "vlmc-int4.yaml"
    recipe.write_text(f"model: {facts['model_dir']}\n" + VLMC_INT4_RECIPE)
    ov = str(venv_python(root, "openvino").parent / "optimum-cli")
    og = [str(venv_python(root, "ortgenai")), "-m", "onnxruntime_genai.models.builder"]
    cache = str(root / "og-cache")
    b = {}
    if "vlmc" in tools:
        b["vlmc fp32"] = (
            [vlmc, "-q", "export", facts["model_dir"], "-o", str(out / "vlmc-fp32"), "--force"],
            out / "vlmc-fp32",
            out / "vlmc-fp32",
        )
        b["vlmc int4"] = (
            [vlmc, "-q", "build", "--recipe", str(recipe), "-o", str(out / "vlmc-int4"), "--force"],
            out / "vlmc-int4" / "build",
            out / "vlmc-int4" / "build" / "package",
        )
    if "openvino" in tools:
        base = [ov, "export", "openvino", "--model", facts["peers_dir"], "--task", "image-text-to-text"]
        b["openvino fp32"] = (
            [*base, "--weight-format", "fp32", str(out / "ov-fp32")],
            out / "ov-fp32",
            out / "ov-fp32",
        )
        b["openvino int4"] = (
            [*base, "--weight-format", "int4", "--group-size", "128", str(out / "ov-int4")],
            out / "ov-int4",
            out / "ov-int4",
        )
    if "ortgenai" in tools:
        base = [*og, "-i", facts["text_dir"], "-e", "cpu", "-c", cache]
        b["ortgenai fp32"] = (
            [*base, "-p", "fp32", "-o", str(out / "og-fp32")],
            out / "og-fp32",
            out / "og-fp32",
        )
        b["ortgenai int4"] = (
            [
                *base,
                "-p",
                "int4",
                "-o",
                str(out / "og-int4"),
                "--extra_options",
                "block_size=128",
                "accuracy_level=4",
            ],
            out / "og-int4",
            out / "og-int4",
        )
    return b


def runs(root: Path, facts: dict, built: dict, tokens: int, threads: int, ov_f32: bool) -> dict:
    """name -> (run command, where it writes its first token's logits)."""
    runner = str(SCRIPTS / "_peer_run.py")
    common = ["--tokens", str(tokens), "--threads", str(threads)]
    img = ["--image", facts["image"], "--prompt", PROMPT]
    r = {}
    for name, (_, path, _) in built.items():
        tool = name.split()[0]
        variants = [(name, [])]
        if tool == "openvino" and ov_f32 and name.endswith("fp32"):  # the CPU's default may be bf16
            variants.append((name + " (f32 hint)", ["--hint", "f32"]))
        for run_name, extra in variants:
            logits = root / "logits" / (run_name.replace(" ", "-").replace("(", "").replace(")", "") + ".npy")
            if tool == "vlmc":
                cmd = [sys.executable, runner, "vlmc", str(path), *img]
            elif tool == "openvino":
                cmd = [str(venv_python(root, "openvino")), runner, "openvino", str(path), *img]
            else:
                cmd = [
                    str(venv_python(root, "ortgenai")),
                    runner,
                    "ortgenai",
                    str(path),
                    "--ids",
                    facts["ids"],
                ]
            r[run_name] = ([*cmd, *common, "--logits", str(logits), *extra], logits)
    return r


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def measure_all(
    root: Path,
    facts: dict,
    tools: list[str],
    rounds: int,
    tokens: int,
    threads: int,
    rss_limit: int,
    ov_f32: bool,
    res: dict | None = None,
    build_rounds: int | None = None,
) -> dict:
    """``rounds`` alternating rounds: each builds everything (the first ``build_rounds`` only; all by
    default), then runs every build. ``res``: an earlier run's figures to add rounds to (its builds
    are reused)."""
    built = builds(root, facts, tools)
    run_cmds = runs(root, facts, built, tokens, threads, ov_f32)
    (root / "logits").mkdir(exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if res is None:
        res = {"builds": {k: [] for k in built}, "runs": {k: [] for k in run_cmds}, "load": []}
    build_rounds = rounds if build_rounds is None else build_rounds
    first = len(res["load"])  # rounds already measured
    for r in range(first, first + rounds):
        res["load"].append(bench._load_average())
        if r - first < build_rounds:
            _build_round(root, r, built, res, rss_limit)
        _run_round(root, r, run_cmds, res)
        # after each round, so a run cut short still leaves its finished rounds (--from-json renders them)
        (root / "bench_peers.partial.json").write_text(
            json.dumps({"measure": res, "rounds": r + 1, "facts": facts}, indent=1)
        )
    res["load_end"] = bench._load_average()
    return res


def _build_round(root: Path, r: int, built: dict, res: dict, rss_limit: int) -> None:
    order = list(built) if r % 2 == 0 else list(reversed(built))
    for name in order:
        cmd, out, counted = built[name]
        shutil.rmtree(out if out.name != "build" else out.parent, ignore_errors=True)
        m = bench.measure(cmd, rss_limit, check=False, log=root / f"{name.replace(' ', '-')}.log")
        row = {"seconds": m["seconds"], "peak_rss_bytes": m["peak_rss_bytes"], "ok": m["returncode"] == 0}
        row["bytes"] = _du(counted) if row["ok"] and counted.exists() else None
        if not row["ok"]:
            row["error"] = m["last_line"]
        res["builds"][name].append(row)
        print(f"round {r} build {name}: {json.dumps(row)}", file=sys.stderr, flush=True)


def _run_round(root: Path, r: int, run_cmds: dict, res: dict) -> None:
    """Run every build once (order reversed every other round), then compare each INT4 run's first
    token and logits with its own FP32 run of this round. A run whose build failed gets a failed row,
    so rounds stay paired by index."""
    order = list(run_cmds) if r % 2 == 0 else list(reversed(run_cmds))
    for name in order:
        base = name.split(" (")[0]
        cmd, logits = run_cmds[name]
        if not res["builds"][base] or not res["builds"][base][-1]["ok"]:
            row = {"ok": False, "error": "its build failed"}
        else:
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                row = {"ok": False, "error": (p.stderr.strip().splitlines() or [""])[-1][:300]}
                (root / f"run-{name.replace(' ', '-')}.log").write_text(p.stderr)
            else:
                row = {
                    "ok": True,
                    **json.loads(p.stdout.strip().splitlines()[-1]),
                    "logits_file": str(logits),
                }
        row["round"] = r
        res["runs"][name].append(row)
        shown = {k: v for k, v in row.items() if k != "tokens"}
        print(f"round {r} run {name}: {json.dumps(shown)}", file=sys.stderr, flush=True)
    for tool in TOOLS:  # INT4 vs its own FP32, this round's logits (the files are rewritten each round)
        a, b = res["runs"].get(f"{tool} int4"), res["runs"].get(f"{tool} fp32")
        if not a or not b or not a[-1]["ok"] or not b[-1]["ok"]:
            continue
        la, lb = np.load(a[-1]["logits_file"]), np.load(b[-1]["logits_file"])
        a[-1]["cosine_vs_fp32"] = _cosine(la, lb)
        a[-1]["first_token_agrees"] = bool(la.argmax() == lb.argmax())
        a[-1]["tokens_agree"] = sum(x == y for x, y in zip(a[-1]["tokens"], b[-1]["tokens"]))


def _med(rows: list[dict], key: str):
    xs = [r[key] for r in rows if r.get("ok") and r.get(key) is not None]
    return statistics.median(xs) if xs else None


def _paired(res: dict, kind: str, a: str, b: str, key: str):
    """Median over rounds of a[key] / b[key], paired within a round (both ok)."""
    xa, xb = res[kind].get(a, []), res[kind].get(b, [])
    rs = [
        x[key] / y[key] for x, y in zip(xa, xb) if x.get("ok") and y.get("ok") and x.get(key) and y.get(key)
    ]
    return statistics.median(rs) if rs else None


def _fmt(x, spec: str, unit: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{unit}"


def _cell(res, rows, name, tool, prec, kind, key, spec, scale=1.0, unit="") -> str:
    """The median of ``key`` over ``rows``; for a peer, with its paired ratio to vlmc's same precision."""
    x = _med(rows, key)
    text = _fmt(None if x is None else x / scale, spec, unit)
    if tool != "vlmc" and x is not None:
        text += f" ({_fmt(_paired(res, kind, name, f'vlmc {prec}', key), '.2f', '×')})"
    return text


def _rounds_text(result: dict) -> str:
    runs, built = result["rounds"], result.get("build_rounds", result["rounds"])
    if built == runs:
        return f"{runs} alternating rounds"
    return f"{runs} alternating rounds of runs, the first {built} also building"


def section(result: dict, command: str) -> list[str]:
    res, ver = result["measure"], result["versions"]
    names = [n for n in ("vlmc", "openvino", "ortgenai") if any(k.startswith(n) for k in res["builds"])]
    title = {"vlmc": "vlmc", "openvino": "OpenVINO GenAI", "ortgenai": "onnxruntime-genai (text decoder)"}
    v = ver.get("openvino", {})
    g = ver.get("ortgenai", {})
    lines = [
        "",
        PEERS_HEADING,
        "",
        f"`{command}` (scripts/bench_peers.py): the 512 M real-width LLaVA-1.5 (llava-1.5-7b-hf's widths, "
        "1 decoder and 2 vision layers, random weights) built FP32 and INT4 by each tool and run at "
        f"{result['threads']} threads, {_rounds_text(result)}, {result['tokens']} greedy tokens "
        "(eos ignored). vlmc: `vlmc export` and `vlmc build` of the quantized recipe (INT8-static vision, "
        "INT4 g128 decoder) with `target: {backend: ort}`. OpenVINO: "
        f"optimum-intel {v.get('optimum-intel', '?')} / openvino-genai {v.get('openvino-genai', '?')} / "
        f"nncf {v.get('nncf', '?')} (`optimum-cli export openvino --weight-format fp32` and `int4 "
        "--group-size 128`, NNCF's defaults otherwise), run with `VLMPipeline` (its perf metrics); its "
        "logits through optimum-intel. onnxruntime-genai "
        f"{g.get('onnxruntime-genai', '?')}: its builder on the text decoder alone (it refuses LLaVA; `-p "
        "int4` with `block_size=128 accuracy_level=4`), prompt ids of vlmc's prompt length, so its time "
        "to first token is a text prefill without the vision tower. Ratios are peer / vlmc, paired within "
        "a round, medians over rounds. Load average (1, 5, 15 min) at the start of each round and at the "
        "end: "
        + "; ".join(
            ", ".join(f"{x:.1f}" for x in la) for la in [*res["load"], res.get("load_end") or []] if la
        )
        + ".",
        "",
        "| tool | precision | build s (× vlmc) | build peak RSS (× vlmc) | bytes on disk | time to first token s (× vlmc) | decode tok/s (× vlmc) | INT4 first token = FP32's | INT4 logit cosine vs FP32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tool in names:
        for prec in ("fp32", "int4"):
            name = f"{tool} {prec}"
            if name not in res["builds"]:
                continue
            bs = res["builds"][name]
            variants = [k for k in res["runs"] if k == name or k.startswith(name + " (")] or [name]
            for i, run in enumerate(variants):
                rs = res["runs"].get(run, [])

                def cell(
                    kind, key, spec, scale=1.0, unit="", _b=bs, _r=rs, _run=run, _name=name, _t=tool, _p=prec
                ):
                    return _cell(
                        res,
                        _b if kind == "builds" else _r,
                        _run if kind == "runs" else _name,
                        _t,
                        _p,
                        kind,
                        key,
                        spec,
                        scale,
                        unit,
                    )

                fails = [x.get("error") for x in (bs if i == 0 else []) + rs if not x.get("ok")]
                agree = [x["first_token_agrees"] for x in rs if "first_token_agrees" in x]
                cos = [x["cosine_vs_fp32"] for x in rs if "cosine_vs_fp32" in x]
                if i == 0:
                    build_cells = [
                        cell("builds", "seconds", ".1f"),
                        cell("builds", "peak_rss_bytes", ".2f", 2**30, " GiB"),
                        cell("builds", "bytes", ".0f", 1e6, " MB"),
                    ]
                else:  # another run of the same build
                    build_cells = ["(same build)"] * 3
                lines.append(
                    f"| {title[tool]} | {prec.upper() + run[len(name) :]} | "
                    + " | ".join(build_cells)
                    + f" | {cell('runs', 'ttft_s', '.2f')} | {cell('runs', 'decode_tok_s', '.2f')} | "
                    + (f"{sum(agree)}/{len(agree)} rounds" if agree else "–")
                    + f" | {_fmt(statistics.median(cos) if cos else None, '.4f')} |"
                    + (f" failed: `{fails[0]}`" if fails else "")
                )
    lines += [
        "",
        "Versions: "
        + "; ".join(f"{k}: " + ", ".join(f"{p} {x}" for p, x in d.items()) for k, d in ver.items())
        + ".",
    ]
    return lines


TOOLS = ("vlmc", "openvino", "ortgenai")


# Not named run(): bench.py runs every scripts/bench_*.py's run(rows, quick) as a pass benchmark.
def measure_peers(
    root: Path,
    rounds: int = 2,
    tokens: int = 32,
    threads: int = 2,
    tools=TOOLS,
    ov_f32: bool = True,
    rss_limit_gib: float = 12.0,
    command: str | None = None,
) -> dict:
    """Install the venvs, make the models, build and run alternating; the result (also written to
    ``root/bench_peers.json``)."""
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    versions = setup_venvs(root, [t for t in tools if t != "vlmc"])
    facts = make_models(root)
    t0 = time.perf_counter()
    measured = measure_all(
        root, facts, list(tools), rounds, tokens, threads, int(rss_limit_gib * 2**30), ov_f32
    )
    result = {
        "versions": versions,
        "facts": facts,
        "measure": measured,
        "rounds": rounds,
        "tokens": tokens,
        "threads": threads,
        "seconds": time.perf_counter() - t0,
        "command": command,
    }
    (root / "bench_peers.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=REPO / "out" / "peers", help="venvs, model, builds (kept)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tools", nargs="*", default=list(TOOLS), choices=list(TOOLS))
    ap.add_argument("--no-ov-f32", dest="ov_f32", action="store_false", help="skip OpenVINO's f32-hint runs")
    ap.add_argument("--rss-limit-gib", type=float, default=12.0, help="kill a build whose RSS goes over this")
    ap.add_argument("--setup-only", action="store_true", help="install the venvs and make the models")
    ap.add_argument("--out", type=Path, help="write the peer section of this benchmarks file")
    ap.add_argument("--from-json", type=Path, help="render an earlier run's bench_peers.json (no measuring)")
    ap.add_argument(
        "--more-runs",
        type=Path,
        metavar="JSON",
        help="add --rounds rounds of runs only (no builds) to an earlier run's bench_peers(.partial).json, "
        "on the builds it left under --root",
    )
    args = ap.parse_args()
    command = " ".join(["python", "scripts/bench_peers.py", *sys.argv[1:]])
    if args.setup_only:
        args.root.mkdir(parents=True, exist_ok=True)
        versions = setup_venvs(args.root, [t for t in args.tools if t != "vlmc"])
        print(json.dumps({"versions": versions, "facts": make_models(args.root)}, indent=1))
        return
    if args.more_runs:
        prev = json.loads(args.more_runs.read_text())
        facts = prev.get("facts") or json.loads((args.root / "model" / ".made").read_text())
        tools = [t for t in TOOLS if any(k.startswith(t + " ") for k in prev["measure"]["builds"])]
        t0 = time.perf_counter()
        measured = measure_all(
            args.root,
            facts,
            tools,
            args.rounds,
            args.tokens,
            args.threads,
            0,
            args.ov_f32,
            res=prev["measure"],
            build_rounds=0,
        )
        result = {
            "versions": setup_venvs(args.root, [t for t in tools if t != "vlmc"]),
            "facts": facts,
            "measure": measured,
            "rounds": len(measured["load"]),
            "build_rounds": len(next(iter(measured["builds"].values()))),
            "tokens": args.tokens,
            "threads": args.threads,
            "seconds": prev.get("seconds", 0) + time.perf_counter() - t0,
            "command": (prev.get("command") or "") + f"; then {command}",
        }
        (args.root / "bench_peers.json").write_text(json.dumps(result, indent=1) + "\n")
    elif args.from_json:
        result = json.loads(args.from_json.read_text())
        if "versions" not in result:  # a partial file (written after each round of a run cut short)
            names = [t for t in args.tools if t != "vlmc"]
            result.update(versions=setup_venvs(args.root, names), tokens=args.tokens, threads=args.threads)
    else:
        result = measure_peers(
            args.root,
            args.rounds,
            args.tokens,
            args.threads,
            args.tools,
            args.ov_f32,
            args.rss_limit_gib,
            command,
        )
    lines = section(result, result.get("command") or command)
    print("\n".join(lines))
    if args.out:
        previous = args.out.read_text() if args.out.is_file() else "# Benchmarks\n"
        args.out.write_text(bench.splice_section(previous, PEERS_HEADING, lines))
        print(f"wrote the peer section of {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
