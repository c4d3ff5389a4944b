"""`make bench`: what vlmc costs (build vs bare torch.onnx.export) and what its passes buy, on this machine.

Writes docs/benchmarks.md (tables, machine description, commands) and PNG plots next to it. All
numbers are medians of side-by-side interleaved runs in one invocation. `--quick` runs a tiny size
with 2 runs (the smoke test in `make test` uses it; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"

# (vision, text) overrides on the tiny LLaVA config; "2b" is ~1.9B parameters at real widths:
# CLIP ViT-L/14-336 (24 layers, 1024 wide) and a 2048-wide, 30-layer Llama (GQA, 48000 vocab).
# "llava-1.5" is llava-hf/llava-1.5-7b-hf's published widths (its config.json: Llama hidden 4096,
# intermediate 11008, 32 heads, 32 KV heads, vocab 32064, image token 32000; CLIP ViT-L/14-336:
# hidden 1024, intermediate 4096, 16 heads, 336 px, patch 14) at reduced depth (1 decoder layer,
# 2 vision layers): 512 M parameters, the shape of the measurement.
SIZES = {
    "tiny": ({}, {}),
    "small": (
        {
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "image_size": 224,
            "patch_size": 14,
        },
        {
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "vocab_size": 32000,
        },
    ),
    "llava-1.5": (
        {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 2,
            "num_attention_heads": 16,
            "image_size": 336,
            "patch_size": 14,
        },
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 1,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32064,
            "image_token_index": 32000,
            # llava-1.5-7b-hf's context: 576 image tokens and a prompt do not fit the tiny config's 512
            "max_position_embeddings": 4096,
        },
    ),
    "2b": (
        {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "image_size": 336,
            "patch_size": 14,
        },
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 30,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "vocab_size": 48000,
            "max_position_embeddings": 4096,  # room for the 576 image tokens at 336 px
        },
    ),
}


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import onnxruntime
    import torch
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def make_model_dir(size: str, root: Path) -> tuple[Path, int]:
    import torch
    from transformers import LlavaForConditionalGeneration

    from vlmc.exporters import zoo

    vis, txt = SIZES[size]
    txt = dict(txt)
    image_token = txt.pop("image_token_index", None)
    cfg = zoo.tiny_llava_config(**txt)
    for k, v in vis.items():
        setattr(cfg.vision_config, k, v)
    if txt.get("vocab_size"):
        cfg.image_token_index = image_token if image_token is not None else txt["vocab_size"] - 1
    cfg.text_config.initializer_range = 0.02
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    params = sum(p.numel() for p in model.parameters())
    path = root / f"llava-{size}"
    model.save_pretrained(path)
    del model
    return path, params


MIN_FREE_DISK = 8 << 30  # scale-row steps are killed when the scratch disk gets this full (shared machine)


def measure(
    cmd: list[str],
    rss_limit: int | None = None,
    check: bool = True,
    log: Path | None = None,
    disk: Path | None = None,
) -> dict:
    """Run ``cmd`` under scripts/_measure.py: seconds, peak RSS, and per-step figures from its progress notes.

    With ``rss_limit`` the command is killed over that RSS; with ``disk`` when that filesystem gets
    under :data:`MIN_FREE_DISK` free."""
    limit = ["--rss-limit", str(rss_limit)] if rss_limit else []
    limit += ["--min-free", f"{MIN_FREE_DISK}:{disk}"] if disk else []
    logs = ["--log", str(log)] if log else []
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "_measure.py"), *limit, *logs, *cmd],
        capture_output=True,
        text=True,
        check=True,
    )
    res = json.loads(out.stdout)
    if check and res["returncode"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res['stderr_tail']}")
    return res


def pipeline_cost(sizes: list[str], runs: int, root: Path, large_runs: int | None = None) -> list[dict]:
    vlmc = str(Path(sys.executable).parent / "vlmc")
    rows = []
    for size in sizes:
        model_dir, params = make_model_dir(size, root)
        recipe = root / f"{size}.yaml"
        recipe.write_text(
            f"model: {model_dir}\npasses: [fold_constants, simplify]\n"
            "target: {backend: ascend, soc: Ascend910B1}\n"
        )
        bare, built, steps = [], [], []
        n = large_runs if (large_runs and size in LARGE) else runs
        for _ in range(n):  # interleaved so both sides see the same machine state
            bare.append(measure([sys.executable, str(SCRIPTS / "bare_export.py"), str(model_dir)]))
            built.append(
                measure(
                    [vlmc, "-q", "build", "--recipe", str(recipe), "-o", str(root / f"out-{size}"), "--force"]
                )
            )
            steps.append(_steps(root / f"out-{size}" / "package" / "report.json"))
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        import shutil

        shutil.rmtree(model_dir, ignore_errors=True)  # multi-GB at the large size
        shutil.rmtree(root / f"out-{size}", ignore_errors=True)
        row = {
            "size": size,
            "params": params,
            "fp32_weight_bytes": params * 4,
            "runs": n,
            "bare_seconds": med(bare, "seconds"),
            "build_seconds": med(built, "seconds"),
            "bare_peak_rss": med(bare, "peak_rss_bytes"),
            "build_peak_rss": med(built, "peak_rss_bytes"),
        }
        row["time_ratio"] = row["build_seconds"] / row["bare_seconds"]
        row["rss_over_weights"] = row["build_peak_rss"] / row["fp32_weight_bytes"]
        row["bare_rss_over_weights"] = row["bare_peak_rss"] / row["fp32_weight_bytes"]
        # per step of the build (phases, and each pass inside "passes"): median seconds and peak RSS
        row["steps"] = {
            k: {
                "seconds": statistics.median(s[k]["seconds"] for s in steps),
                "peak_rss_bytes": statistics.median(s[k]["peak_rss_bytes"] or 0 for s in steps),
            }
            for k in steps[0]
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


LARGE = ("2b", "llava-1.5")  # sizes that get --large-runs

# The recipe users run (issue 20): INT8 static vision (4 calibration images), INT4 weight-only
# decoder (group 128), Ascend. The 7B row adds the paged KV rewrite, as the goal states it.
QUANT_PASSES = """passes:
  - fold_constants
  - simplify
  - quantize:
      vision_encoder: {weights: int8, activations: int8, calibration: {count: 4}}
      decoder: {weights: int4, group_size: 128}
"""
PAGED_PASS = "  - paged_kv: {block_size: 128}\n"
SCALE_TARGET = "target: {backend: ascend, soc: Ascend910B4}\n"


def _params_in(checkpoint: Path) -> int:
    from safetensors import safe_open

    n = 0
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for k in f.keys():
                shape = f.get_slice(k).get_shape()
                n += math.prod(shape)
    return n


def _drop_cached(checkpoint: Path) -> None:
    """Drop the checkpoint's pages from the page cache, so the next command reads it from the disk.

    Every command of a scale row starts from the same cold checkpoint. Before this, the floor read a
    checkpoint still cached from being written (47.5 s against 92.2 s cold, at 7B) and then evicted
    it by writing 28 GB, so the build after it read from the disk: the floor and the build did not
    see the same cache. posix_fadvise(DONTNEED) drops clean pages of a file and needs no privilege;
    the sync first makes the checkpoint's pages clean.
    """
    os.sync()
    for path in checkpoint.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _floor(checkpoint: Path, root: Path) -> dict:
    """The disk-bound floor (scripts/disk_floor.py): read the checkpoint once, write it once as FP32."""
    import shutil

    _drop_cached(checkpoint)

    cmd = [sys.executable, str(SCRIPTS / "disk_floor.py"), str(checkpoint), str(root / "floor.bin")]
    need = 2 * sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))  # bf16 -> FP32
    if shutil.disk_usage(root).free - need < 2 * MIN_FREE_DISK:
        cmd += ["--max-file-gib", "4"]  # no room for the whole FP32 copy: 4 GiB at a time, synced
    res = measure(cmd, disk=root)
    res["mode"] = "synced every 4 GiB" if "--max-file-gib" in cmd else "one file"
    if res["returncode"] != 0:
        raise SystemExit(f"bench: the disk floor did not finish ({res['last_line'] or 'killed: disk full'})")
    return res


def _scale_build(
    name: str,
    checkpoint: Path,
    params: int,
    recipe_text: str,
    root: Path,
    rss_limit: int,
    bare: bool,
    export_row: bool = True,
) -> dict:
    """One scale row: disk floor, bare torch.onnx.export (``bare``), `vlmc export` (``export_row``),
    and `vlmc build`, each under the RSS watchdog. The build's per-step figures come from its
    report.json when it finishes, else from its progress notes (scripts/_measure.py), which also
    name the step it failed or was killed in."""
    vlmc = str(Path(sys.executable).parent / "vlmc")
    recipe = root / f"{name}.yaml"
    recipe.write_text(f"model: {checkpoint}\n" + recipe_text)
    out = root / f"out-{name}"
    row: dict = {"name": name, "params": params, "fp32_weight_bytes": params * 4, "rss_limit": rss_limit}
    row["recipe"] = recipe_text
    row["load_average"] = _load_average()
    floor = _floor(checkpoint, root)
    row["floor_seconds"], row["floor_mode"] = floor["seconds"], floor["mode"]
    if bare:
        _drop_cached(checkpoint)
        b = measure([sys.executable, str(SCRIPTS / "bare_export.py"), str(checkpoint)], rss_limit)
        row["bare_seconds"], row["bare_peak_rss"] = b["seconds"], b["peak_rss_bytes"]
    import shutil

    if export_row:
        _drop_cached(checkpoint)
        e = measure(
            [vlmc, "-q", "export", str(checkpoint), "-o", str(root / f"pkg-{name}"), "--force"],
            rss_limit,
            disk=root,
        )
        _remove_outputs(root, f"pkg-{name}")
        row["export_seconds"], row["export_peak_rss"] = e["seconds"], e["peak_rss_bytes"]
    log = root / f"{name}-build.log"
    _drop_cached(checkpoint)
    r = measure(
        [vlmc, "build", "--recipe", str(recipe), "-o", str(out), "--force"],
        rss_limit,
        check=False,
        log=log,
        disk=root,
    )
    row["build_seconds"], row["build_peak_rss"] = r["seconds"], r["peak_rss_bytes"]
    row["build_ok"] = r["returncode"] == 0
    row["killed_over_rss"] = r.get("killed_over_rss", False)
    row["killed_low_disk"] = r.get("killed_low_disk", False)
    row["build_last_line"] = r.get("last_line", "")
    row["notes"] = r.get("steps", [])  # per progress note: seconds and sampled peak RSS
    row["failed_step"] = None if row["build_ok"] else (r.get("last_step") or "before its first step")
    report = out / "package" / "report.json"
    row["steps"] = _steps(report) if row["build_ok"] and report.is_file() else {}
    row["load_average_after"] = _load_average()
    if LOG_DIR is not None:  # --keep-logs: the whole stderr of the build, to read after a failure
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, LOG_DIR / log.name)
    _remove_outputs(root, f"out-{name}")
    print(json.dumps(row), flush=True)
    return row


LOG_DIR: Path | None = None  # --keep-logs


def _remove_outputs(root: Path, name: str) -> None:
    """Remove an output and what a killed `vlmc` left of it (its ``.<name>.tmp-*`` staging directory)."""
    import shutil

    shutil.rmtree(root / name, ignore_errors=True)
    for leftover in root.glob(f".{name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _recipe_body(path: Path) -> str:
    """A recipe file's text without its model key (the row sets the model)."""
    return "".join(ln for ln in path.read_text().splitlines(keepends=True) if not ln.startswith("model:"))


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# Free disk the 7B row needs besides its checkpoint (14 GB of bf16): the scratch graphs (26 GB FP32
# at export), the package written from them, the floor's FP32 file and the build directory.
SEVEN_B_DISK = 31 << 30
SEVEN_B_CHECKPOINT = 15 << 30


def _check_disk(root: Path, need: int, what: str) -> None:
    import shutil

    free = shutil.disk_usage(root).free
    if free < need:
        raise SystemExit(
            f"bench: {what} needs about {need / 2**30:.0f} GiB of free disk under {root}; "
            f"{free / 2**30:.0f} GiB are free (pass --scratch DIR on a larger disk)"
        )


def scale_rows(
    root: Path,
    seven_b: bool,
    seven_b_dir: Path | None,
    rss_limit: int,
    with_512m: bool = True,
    export_row: bool = True,
    seven_b_recipe: str | None = None,
) -> list[dict]:
    """The 512 M real-width quantized row, and with ``seven_b`` a full LLaVA-1.5-7B (random bf16 shards).

    ``seven_b_dir``: a checkpoint directory to use, or to write the 7B checkpoint into and keep (so
    the row can be measured again without writing 14 GB again).
    """
    import shutil

    rows = []
    if with_512m:
        model_dir, params = make_model_dir("llava-1.5", root)
        rows.append(
            _scale_build(
                "llava-1.5 quantized",
                model_dir,
                params,
                QUANT_PASSES + SCALE_TARGET,
                root,
                rss_limit,
                True,
                export_row,
            )
        )
        shutil.rmtree(model_dir, ignore_errors=True)
    if seven_b:
        sys.path.insert(0, str(SCRIPTS))
        import make_checkpoint

        ckpt = seven_b_dir or (root / "llava-1.5-7b")
        have = (ckpt / "model.safetensors.index.json").is_file()
        if seven_b_dir is not None:
            ckpt.mkdir(parents=True, exist_ok=True)
        _check_disk(root, SEVEN_B_DISK, "the 7B build")
        if not have:
            _check_disk(
                ckpt if ckpt.exists() else root, SEVEN_B_CHECKPOINT + SEVEN_B_DISK, "the 7B checkpoint"
            )
            make_checkpoint.write(make_checkpoint.llava_15_7b_config(), ckpt)
        try:
            rows.append(
                _scale_build(
                    "llava-1.5-7b",
                    ckpt,
                    _params_in(ckpt),
                    seven_b_recipe or (QUANT_PASSES + PAGED_PASS + SCALE_TARGET),
                    root,
                    rss_limit,
                    False,
                    export_row,
                )
            )
        finally:
            if seven_b_dir is None:
                shutil.rmtree(ckpt, ignore_errors=True)
    return rows


SCALE_HEADING = "## Scale: the quantized Ascend recipe at 512 M and a full 7B"
# The sections bench.py writes; docs/benchmarks.md's other sections are hand-written and kept.
HOST_LOOP_HEADING = "## Host loop of `vlmc run BUILD --executor acl` (pyACL stand-in)"
# scripts/bench_peers.py's section (written with --peers or --only-peers; kept as it was otherwise)
PEERS_HEADING = "## Peers: vlmc against OpenVINO GenAI and onnxruntime-genai"
GENERATED_HEADINGS = (
    "## Machine",
    "## Pipeline cost: `vlmc build` vs bare `torch.onnx.export`",
    SCALE_HEADING,
    "## What the passes buy",
    HOST_LOOP_HEADING,
    PEERS_HEADING,
    "## Reproduce",
)


def scale_section(rows: list[dict], command: str | None = None) -> list[str]:
    lines = [
        "",
        SCALE_HEADING,
        "",
        "Recipe: `fold_constants, simplify, quantize (vision_encoder int8 static, calibration count 4; "
        "decoder int4 group 128)`, Ascend910B4 target; the 7B row adds `paged_kv (block 128)`. The "
        "disk floor is scripts/disk_floor.py in the same run: read the checkpoint once and write it once "
        "as FP32, one tensor at a time. Before the floor and before each measured command the checkpoint's "
        "pages are dropped from the page cache (posix_fadvise), so every command reads it from the disk. "
        "The 7B is llava-1.5-7b-hf's config with random weights written as "
        "bf16 safetensors shards with an index (scripts/make_checkpoint.py). A step that goes over the "
        "RSS limit is killed (scripts/_measure.py) so the benchmark cannot take a shared machine down. "
        "Targets (issue 20): peak RSS ≤ 0.30× FP32 weight bytes, build time ≤ 4× the disk floor.",
        "",
        "| model | params | FP32 weights | disk floor s | bare export s | `vlmc export` s (peak RSS) | `vlmc build` s | build peak RSS | build RSS / FP32 | build time / floor | load average (1, 5, 15 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fp32 = r["fp32_weight_bytes"]
        if r["build_ok"]:
            status = ""
        elif r["killed_over_rss"]:
            status = f" (killed over the {_gib(r['rss_limit'])} RSS limit in {r.get('failed_step')})"
        elif r.get("killed_low_disk"):
            status = f" (killed in {r.get('failed_step')}: the disk was almost full)"
        elif "interrupted" in r.get("build_last_line", ""):
            status = f" (interrupted in {r.get('failed_step')})"
        else:
            status = f" (failed in {r.get('failed_step')})"
        ratio = f"**{r['build_seconds'] / r['floor_seconds']:.2f}×**" if r["build_ok"] else "–"
        bare = f"{r['bare_seconds']:.1f}" if "bare_seconds" in r else "–"
        export = (
            f"{r['export_seconds']:.1f} ({_gib(r['export_peak_rss'])}, {r['export_peak_rss'] / fp32:.2f}×)"
            if "export_seconds" in r
            else "–"
        )
        load = ", ".join(f"{x:.1f}" for x in r.get("load_average", []))
        mode = r.get("floor_mode", "one file")
        floor = f"{r['floor_seconds']:.1f}" + ("" if mode == "one file" else f" ({mode})")
        lines.append(
            f"| {r['name']} | {r['params'] / 1e9:.2f} B | {_gib(fp32)} | {floor} | {bare} | "
            f"{export} | {r['build_seconds']:.1f}{status} | {_gib(r['build_peak_rss'])} | "
            f"**{r['build_peak_rss'] / fp32:.2f}×** | {ratio} | {load} |"
        )
    for r in rows:
        fp32 = r["fp32_weight_bytes"]
        lines += ["", f"Per step of `vlmc build`, {r['name']}:", ""]
        if r.get("recipe") and r["recipe"] not in (
            QUANT_PASSES + SCALE_TARGET,
            QUANT_PASSES + PAGED_PASS + SCALE_TARGET,
        ):
            lines += [
                "Not the issue's recipe; this row ran:",
                "",
                "```yaml",
                r["recipe"].rstrip("\n"),
                "```",
                "",
            ]
        lines += [
            "| step | seconds | seconds / floor | peak RSS | peak RSS / FP32 weights |",
            "|---|---|---|---|---|",
        ]
        if r["steps"]:  # the build's own report.json (per phase; the passes inside "passes")
            for name, st in r["steps"].items():
                peak = st["peak_rss_bytes"] or 0
                lines.append(
                    f"| {name} | {st['seconds']:.2f} | {st['seconds'] / r['floor_seconds']:.2f}× | "
                    f"{_gib(peak)} | {peak / fp32:.2f}× |"
                )
        else:  # unfinished: the progress notes' timings and the watchdog's RSS samples
            notes = r.get("notes", [])
            for i, st in enumerate(notes):
                last = i == len(notes) - 1
                if st["seconds"] < 0.01 and not last:
                    continue  # a note that only opens a group of steps ("running passes")
                mark = " **← failed here**" if last and not r["build_ok"] else ""
                lines.append(
                    f"| {st['step']}{mark} | {st['seconds']:.2f} | {st['seconds'] / r['floor_seconds']:.2f}× | "
                    f"{_gib(st['peak_rss_bytes'])} | {st['peak_rss_bytes'] / fp32:.2f}× |"
                )
            lines += [
                "",
                f"The build did not finish: {r.get('failed_step')!s} "
                + (
                    "went over the RSS limit and was killed"
                    if r["killed_over_rss"]
                    else "was killed when the disk was almost full"
                    if r.get("killed_low_disk")
                    else "failed"
                )
                + f" (last line it printed: `{r['build_last_line'][:300]}`). Figures from its progress notes "
                "(seconds from one note to the next; RSS sampled every 0.2 s by scripts/_measure.py).",
            ]
    if command:
        lines += ["", f"Measured with `{command}`."]
    return lines


def splice_section(text: str, heading: str, section: list[str]) -> str:
    """``text`` with the section under ``heading`` (up to the next ``## `` heading) replaced, or appended."""
    lines = text.splitlines()
    body = "\n".join(section).strip("\n").splitlines()
    if heading in lines:
        start = lines.index(heading)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = body + [""]
    else:
        lines += [""] + body
    return "\n".join(lines).rstrip("\n") + "\n"


def _steps(report_json: Path) -> dict:
    """Per-step seconds and peak RSS of one build, from the report.json it wrote."""
    rep = json.loads(report_json.read_text())
    out = {}
    phases = rep.get("build_phases", {})
    for name in ("load", "export", "passes", "save", "compile"):  # the build's order (report.json sorts keys)
        if name not in phases:
            continue
        out[name] = phases[name]
        if name == "passes":
            for p in rep.get("passes", []):
                out[f"· pass {p['pass']}"] = {
                    "seconds": p["seconds"],
                    "peak_rss_bytes": p.get("peak_rss_bytes"),
                }
    return out


def pass_benchmarks(quick: bool) -> tuple[list[dict], list[str]]:
    """Rows from the per-pass benchmark modules that exist (scripts/bench_*.py with run(rows, quick))."""
    rows: list[dict] = []
    ran = []
    for path in sorted(SCRIPTS.glob("bench_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if hasattr(mod, "run"):
            t0 = time.perf_counter()
            mod.run(rows, quick)
            ran.append(f"{path.name} ({time.perf_counter() - t0:.0f} s)")
    return rows, ran


def plot(rows: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    params = [r["params"] / 1e6 for r in rows]
    for key, label, fname in (
        ("seconds", "wall time (s)", "pipeline_time.png"),
        ("peak_rss", "peak RSS (GiB)", "pipeline_rss.png"),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        scale = 1 if key == "seconds" else 2**30
        ax.plot(params, [r[f"bare_{key}"] / scale for r in rows], "o-", label="bare torch.onnx.export")
        ax.plot(params, [r[f"build_{key}"] / scale for r in rows], "s-", label="vlmc build")
        if key == "peak_rss":
            ax.plot(params, [r["fp32_weight_bytes"] / scale for r in rows], ":", label="FP32 weight bytes")
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def targets(cost: list[dict]) -> list[str]:
    """The scale targets (build time <= 1.5x bare export, peak RSS <= 1.5x FP32 weights) at each large size,
    with the per-step breakdown that shows where time and memory go."""
    lines: list[str] = []
    for r in cost:
        if r["size"] not in LARGE:
            continue
        mem_ok, time_ok = r["rss_over_weights"] <= 1.5, r["time_ratio"] <= 1.5
        lines += [
            "",
            f"### Scale targets: {r['size']} ({r['params'] / 1e9:.2f} B parameters, "
            f"{_gib(r['fp32_weight_bytes'])} of FP32 weights)",
            "",
            "| target | measured | met |",
            "|---|---|---|",
            f"| peak RSS ≤ 1.5× FP32 weight bytes | {r['rss_over_weights']:.2f}× ({_gib(r['build_peak_rss'])}; "
            f"bare export alone {r['bare_rss_over_weights']:.2f}×) | {'yes' if mem_ok else 'no'} |",
            f"| `vlmc build` time ≤ 1.5× bare export | {r['time_ratio']:.2f}× ({r['build_seconds']:.1f} s vs "
            f"{r['bare_seconds']:.1f} s) | {'yes' if time_ok else 'no'} |",
            "",
            "Per step of the build (medians over the runs; peak RSS of the process during that step: the "
            "kernel's high-water mark where the step raised it, else sampled every 10 ms, see vlmc/memory.py; "
            "the passes run inside `passes`):",
            "",
            "| step | seconds | peak RSS | peak RSS / FP32 weights |",
            "|---|---|---|---|",
        ]
        for name, st in r.get("steps", {}).items():
            peak = st["peak_rss_bytes"]
            lines.append(
                f"| {name} | {st['seconds']:.2f} | {_gib(peak)} | {peak / r['fp32_weight_bytes']:.2f}× |"
            )
    return lines


def host_loop_section(results: list[dict], command: str) -> list[str]:
    """The host loop's own cost per decode step (scripts/bench_host_loop.py), medians."""
    import bench_host_loop

    command = re.sub(r"(--host-loop-dir)[ =]\S+", r"\1 DIR", command)  # no machine path in the docs

    r = results[0]
    return [
        "",
        HOST_LOOP_HEADING,
        "",
        f"`{command}` (scripts/bench_host_loop.py): a narrow {r['layers']}-layer LLaVA-architecture decoder "
        "(widths 16, random weights), compiled contiguous and paged in the stacked-KV form, run through "
        "`AclDevice` on the pyACL stand-in (tests/_pyacl_standin.py). The time inside `acl.mdl.execute` (the "
        "stand-in running the lowered graph) is subtracted within each run, and times are the main thread's "
        "CPU time (`time.thread_time`; this machine is shared, so wall time mostly measures waiting for a "
        "core); per step is the difference of a "
        f"1-token and a {r['steps'] + 1}-token run over the extra decode steps, batch 1, median of "
        f"{r['repeats']} repeats on one warm session. The stand-in's calls are Python functions and its "
        "device copies `bytearray` copies, so this is the host side of the same calls on pyACL at most; "
        "nothing here ran on a card. CPU time still grows with the machine's load (shared caches and "
        "cores): the 1-minute load average was "
        + ", ".join(f"{x['load']:.1f} ({x['layout']})" for x in results)
        + " during these rows, on "
        + f"{os.cpu_count()} cores; compare rows measured at the same load only.",
        "",
        *bench_host_loop.table(results),
        "",
        f"Device calls per step of the last {r['steps'] + 1}-token run (means; a call made less than once a step, "
        "such as a gear set or an unchanged input copied only when it changes, is left out):",
        "",
        "| layout | calls per step |",
        "|---|---|",
        *(
            f"| {x['layout']} | "
            + ", ".join(f"`{k}` {v:g}" for k, v in sorted(x["calls_per_step"].items()))
            + " |"
            for x in results
        ),
    ]


HOST_LOOP_TOKENS, HOST_LOOP_REPEATS = 17, 3


def _host_loop_rows(keep: Path | None = None) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_host_loop

    if keep is not None:  # builds kept (and reused) there
        return bench_host_loop.rows(tokens=HOST_LOOP_TOKENS, out=keep, repeats=HOST_LOOP_REPEATS)
    with tempfile.TemporaryDirectory(prefix="vlmc-hostloop-") as tmp:
        return bench_host_loop.rows(tokens=HOST_LOOP_TOKENS, out=Path(tmp), repeats=HOST_LOOP_REPEATS)


def _peer_lines(args) -> list[str]:
    """Measure the peers (scripts/bench_peers.py: its venvs, model and builds under --peers-root) and
    return its section."""
    sys.path.insert(0, str(SCRIPTS))
    import bench_peers

    command = " ".join(["python", "scripts/bench.py", *sys.argv[1:]])
    return bench_peers.section(
        bench_peers.measure_peers(args.peers_root, rounds=args.peer_rounds, command=command), command
    )


def render(
    m: dict,
    cost: list[dict],
    pass_rows: list[dict],
    ran: list[str],
    plots: list[str],
    args,
    scale=(),
    host_loop=(),
    peers=(),
) -> str:
    lines = [
        "# Benchmarks",
        "",
        "`make bench` (`python scripts/bench.py`) writes the sections it measures, each under its own "
        "heading: " + ", ".join(f'"{h[3:]}"' for h in GENERATED_HEADINGS) + ". It replaces those sections "
        "and this paragraph and leaves every other section as it was: those are written by hand, each "
        "naming the command that produced its figures. Medians of side-by-side interleaved runs in one "
        "invocation; onnxruntime CPU stands in for the NPU. Last generated by "
        f"`{' '.join(['python', 'scripts/bench.py', *sys.argv[1:]])}` on {time.strftime('%Y-%m-%d')}.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in m.items()]
    if cost:
        lines += _cost_section(cost, plots)
    if scale:
        lines += scale_section(list(scale), " ".join(["python", "scripts/bench.py", *sys.argv[1:]]))
    if not args.skip_passes:
        lines += _passes_section(pass_rows, ran)
    if host_loop:
        lines += host_loop_section(list(host_loop), " ".join(["python", "scripts/bench.py", *sys.argv[1:]]))
    lines += list(peers)
    lines += _reproduce_section()
    with open(args.out.parent / "bench" / "results.json", "w") as f:
        json.dump(
            {"machine": m, "pipeline_cost": cost, "scale": list(scale), "passes": pass_rows},
            f,
            indent=2,
            default=str,
        )
    return "\n".join(lines)


def _cost_section(cost: list[dict], plots: list[str]) -> list[str]:
    lines = [
        "",
        "## Pipeline cost: `vlmc build` vs bare `torch.onnx.export`",
        "",
        "`vlmc build` = export (three stages, checked, external data) + fold_constants + simplify + "
        "Ascend compile (lowering, precheck, ATC commands). The baseline exports the same three stages "
        "with `torch.onnx.export` and nothing else (scripts/bare_export.py). LLaVA-architecture models "
        "with random weights, built in code.",
        "",
        "| size | params | runs | bare s | build s | time ratio | bare peak RSS | build peak RSS | build RSS / FP32 weights |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cost:
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.1f} M | {r['runs']} | {r['bare_seconds']:.2f} | {r['build_seconds']:.2f} | "
            f"**{r['time_ratio']:.2f}×** | {_gib(r['bare_peak_rss'])} | {_gib(r['build_peak_rss'])} | "
            f"**{r['rss_over_weights']:.2f}×** |"
        )
    lines += [""] + [f"![{p}]({'bench/' + p})" for p in plots]
    lines += [
        "",
        "The tiny size's RSS ratio only shows the interpreter and torch import (about 0.4 GiB) "
        "against 0.8 MB of weights.",
    ]
    return lines + targets(cost)


def _passes_section(pass_rows: list[dict], ran: list[str]) -> list[str]:
    lines = ["", "## What the passes buy", ""]
    if pass_rows:
        lines += ["| benchmark | setting | metric | value | ratio | notes |", "|---|---|---|---|---|---|"]
        for r in pass_rows:
            lines.append(
                f"| {r.get('benchmark', '')} | {r.get('setting', '')} | {r.get('metric', '')} | {r.get('value', '')} | "
                f"{r.get('ratio', '')} | {r.get('notes', '')} |"
            )
        lines += ["", "Modules run: " + ", ".join(ran)]
    else:
        lines.append("No per-pass benchmark modules were found.")
    return lines


def _reproduce_section() -> list[str]:
    return [
        "",
        "## Reproduce",
        "",
        "```",
        "make bench                      # tiny and small: 5 runs; llava-1.5 and 2b: 3 runs; the 512 M quantized row",
        "make bench BENCH_7B=1           # also the full LLaVA-1.5-7B row (needs about 45 GB of free disk)",
        "make bench BENCH_7B=1 BENCH_7B_DIR=/big/llava7b   # keep (or reuse) the 14 GB 7B checkpoint there",
        "python scripts/bench.py --only-7b --7b-dir /big/llava7b   # just the 7B row, into the scale section",
        "python scripts/bench.py --sizes tiny small --runs 5 --out docs/benchmarks.md",
        "python scripts/bench.py --quick --out /tmp/bench.md   # smoke run (make test does this)",
        "python scripts/bench.py --only-scale              # the 512 M row alone (prints, does not rewrite this file)",
        "python scripts/ab_build.py --before REV --runs 3  # that row's build, REV and this tree alternating: medians, ratio"
        " (--plain: fold_constants, simplify)",
        "make bench BENCH_PEERS=1        # also vlmc against OpenVINO GenAI and onnxruntime-genai (their venvs under out/peers)",
        "python scripts/bench.py --only-peers   # just that section (scripts/bench_peers.py --help for its own options)",
        "```",
        "",
    ]


def splice_generated(previous: str, generated: str) -> str:
    """``previous`` with its preamble and every ``## `` section that ``generated`` holds replaced by
    the generated ones (a new section is appended); sections bench.py did not write are kept."""
    lines = generated.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("## ")] + [len(lines)]
    old = previous.splitlines()
    first_old = next((i for i, ln in enumerate(old) if ln.startswith("## ")), len(old))
    text = "\n".join(lines[: starts[0]] + old[first_old:]) + "\n"
    for a, b in zip(starts, starts[1:]):
        text = splice_section(text, lines[a], lines[a:b])
    return text


def main() -> None:
    global LOG_DIR, MIN_FREE_DISK
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--sizes", nargs="*", default=["tiny", "small", "llava-1.5", "2b"], choices=list(SIZES))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--large-runs", type=int, default=None, help="runs for the llava-1.5 and 2b sizes (default: --runs)"
    )
    ap.add_argument("--quick", action="store_true", help="tiny size, 2 runs, quick pass benchmarks")
    ap.add_argument("--skip-passes", action="store_true")
    ap.add_argument("--skip-scale", action="store_true", help="leave out the 512 M quantized-recipe row")
    ap.add_argument(
        "--skip-host-loop",
        action="store_true",
        help="leave out the pyACL host-loop rows (bench_host_loop.py)",
    )
    ap.add_argument(
        "--only-host-loop", action="store_true", help="measure and rewrite only the host-loop section"
    )
    ap.add_argument(
        "--host-loop-dir", type=Path, help="keep (and reuse) the host-loop builds in this directory"
    )
    ap.add_argument(
        "--peers",
        action="store_true",
        help="also measure vlmc against OpenVINO GenAI and onnxruntime-genai (scripts/bench_peers.py; "
        "installs their venvs under --peers-root)",
    )
    ap.add_argument("--only-peers", action="store_true", help="measure and rewrite only the peer section")
    ap.add_argument(
        "--peers-root", type=Path, default=REPO / "out" / "peers", help="the peers' venvs and builds"
    )
    ap.add_argument("--peer-rounds", type=int, default=2, help="alternating rounds of the peer benchmark")
    ap.add_argument(
        "--7b", dest="seven_b", action="store_true", help="add the full LLaVA-1.5-7B row (~45 GB disk)"
    )
    ap.add_argument("--7b-dir", dest="seven_b_dir", type=Path, help="an existing 7B checkpoint to use (kept)")
    ap.add_argument("--no-512m", dest="with_512m", action="store_false", help="leave out the 512 M scale row")
    ap.add_argument(
        "--scratch", type=Path, help="where the scale rows write (default: a temporary directory)"
    )
    ap.add_argument(
        "--rss-limit-gib", type=float, default=16.0, help="kill a scale-row step whose RSS goes over this"
    )
    ap.add_argument(
        "--only-7b",
        action="store_true",
        help="run only the 7B row (no other sizes, 512 M row or pass benchmarks) and replace only the "
        "scale section of --out",
    )
    ap.add_argument(
        "--no-export-row",
        dest="export_row",
        action="store_false",
        help="scale rows: do not measure `vlmc export` apart (the build's export step is still reported)",
    )
    ap.add_argument(
        "--min-free-gib",
        type=float,
        default=MIN_FREE_DISK / 2**30,
        help="kill a scale-row step when the scratch disk has less free than this (shared machines)",
    )
    ap.add_argument("--keep-logs", type=Path, help="copy each scale build's whole stderr into this directory")
    ap.add_argument(
        "--7b-recipe",
        dest="seven_b_recipe",
        type=Path,
        help="a recipe file (passes and target; its model key is replaced) for the 7B row instead of the "
        "issue's recipe, to measure part of the path; the row then shows the recipe it ran",
    )
    ap.add_argument(
        "--only-scale",
        action="store_true",
        help="run only the 512 M scale row (floor, bare export, vlmc export, vlmc build side by side) "
        "and print its table and JSON row; docs/benchmarks.md is not rewritten",
    )
    args = ap.parse_args()
    if args.only_scale:
        with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
            rows = scale_rows(Path(tmp), False, None, int(args.rss_limit_gib * 2**30), True)
        print("\n".join(scale_section(rows)))
        load = os.getloadavg()
        print(f"\nload average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (1, 5, 15 min)")
        return
    if args.only_host_loop:
        previous = args.out.read_text() if args.out.is_file() else "# Benchmarks\n"
        command = " ".join(["python", "scripts/bench.py", *sys.argv[1:]])
        lines = host_loop_section(_host_loop_rows(args.host_loop_dir), command)
        args.out.write_text(splice_section(previous, HOST_LOOP_HEADING, lines))
        print(f"wrote the host-loop section of {args.out}")
        return
    if args.only_peers:
        previous = args.out.read_text() if args.out.is_file() else "# Benchmarks\n"
        args.out.write_text(splice_section(previous, PEERS_HEADING, _peer_lines(args)))
        print(f"wrote the peer section of {args.out}")
        return
    if args.quick:
        args.sizes, args.runs, args.skip_scale = ["tiny"], 2, True
    if args.only_7b:
        args.sizes, args.with_512m, args.skip_passes, args.skip_scale, args.seven_b = (
            [],
            False,
            True,
            False,
            True,
        )
    LOG_DIR = args.keep_logs
    MIN_FREE_DISK = int(args.min_free_gib * 2**30)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scale: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        cost = pipeline_cost(args.sizes, args.runs, Path(tmp), args.large_runs) if args.sizes else []
        if not args.skip_scale:
            scale = scale_rows(
                Path(tmp),
                args.seven_b,
                args.seven_b_dir,
                int(args.rss_limit_gib * 2**30),
                args.with_512m,
                args.export_row,
                _recipe_body(args.seven_b_recipe) if args.seven_b_recipe else None,
            )
    command = " ".join(["python", "scripts/bench.py", *sys.argv[1:]])
    if args.only_7b:
        previous = args.out.read_text() if args.out.is_file() else "# Benchmarks\n"
        args.out.write_text(splice_section(previous, SCALE_HEADING, scale_section(scale, command)))
        results = args.out.parent / "bench" / "results-7b.json"
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps({"machine": machine(), "scale": scale}, indent=2, default=str) + "\n")
        print(f"wrote the scale section of {args.out}")
        return
    pass_rows, ran = ([], []) if args.skip_passes else pass_benchmarks(args.quick)
    host_loop = [] if args.skip_host_loop else _host_loop_rows(args.host_loop_dir)
    peers = _peer_lines(args) if args.peers else []
    plot_dir = args.out.parent / "bench"
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots = plot(cost, plot_dir) if cost else []
    previous = args.out.read_text() if args.out.is_file() else "# Benchmarks\n"
    args.out.write_text(
        splice_generated(
            previous, render(machine(), cost, pass_rows, ran, plots, args, scale, host_loop, peers)
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
