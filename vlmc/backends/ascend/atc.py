"""ATC command lines: the complete flag table, every rule ATC enforces, and reading ATC's errors.

The rules follow docs/atc-facts.md (gathered from hicann/ge ``atc_flags.cc``,
``main_impl.cc`` and ``option_utils.cc``). :func:`problems` checks a parsed command against all of
them, independently of how vlmc built it, so tests can hold every emitted command to the rules.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from vlmc.backends.ascend import soc
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# hicann/ge api/atc/atc_flags.cc: ATC stops on any other flag ("unknown command line flag").
FLAGS = frozenset(
    """
ac_parallel_enable aicore_num allow_hf32 atomic_clean_policy auto_tune_mode buffer_optimize build_config
cal_conf check_report cluster_config compress_weight_conf compression_optimize_conf core_type
customize_dtypes debug_dir deterministic deterministic_level device_id disable_reuse_memory
display_model_info dump_mode dynamic_batch_size dynamic_dims dynamic_image_size enable_attr_compression
enable_compress_weight enable_scope_fusion_passes enable_single_stream enable_small_channel external_weight
framework fusion_switch_file h2d_overlapped_with_compute hccl_sub_comm_config help host_env_cpu host_env_os
input_format input_fp16_nodes input_hint_shape input_shape input_shape_range insert_op_conf
is_input_adjust_hw_layout is_output_adjust_hw_layout jit_compile json keep_dtype log mdl_bank_path mode
model modify_mixlist om oo_level op_bank_path op_compiler_cache_dir op_compiler_cache_mode op_debug_config
op_debug_level op_name_map op_precision_mode op_select_implmode optimization_switch optypelist_for_implmode
out_nodes output output_type precision_mode precision_mode_v2 quant_dumpable raw_ge_options
save_original_model shape_generalized_build_mode singleop soc_version sparsity static_model_ops_lower_limit
status_check target tiling_schedule_optimize virtual_type weight
""".split()
)

# Flags that circulate in blog posts but do not exist; their effects come from vlmc passes.
NOT_ATC_FLAGS = {
    "enable_vision_token_prune": "use the prune pass",
    "vision_quant_type": "use the quantize pass",
    "language_precision": "use the quantize pass / the package precision",
    "enable_paged_kv_cache": "use the paged_kv pass",
    "kv_block_size": "use the paged_kv pass's block_size option",
    "enable_fusion": "fusions are graph passes (NPURmsNorm/NPURotaryMul lowering)",
}

REQUIRED = ("model", "framework", "output", "soc_version")
FRAMEWORK_ONNX = "5"
GEAR_FLAGS = ("dynamic_batch_size", "dynamic_image_size", "dynamic_dims")
MIN_PROFILES = 2
MAX_PROFILES = 100

PRECISION_MODES = (
    "force_fp16",
    "force_fp32",
    "cube_fp16in_fp32out",
    "allow_mix_precision",
    "allow_fp32_to_fp16",
    "must_keep_origin_dtype",
    "allow_mix_precision_fp16",
    "allow_mix_precision_bf16",
    "allow_fp32_to_bf16",
)
PRECISION_MODES_V2 = (
    "fp16",
    "origin",
    "cube_fp16in_fp32out",
    "mixed_float16",
    "mixed_bfloat16",
    "cube_hif8",
    "mixed_hif8",
)
# Precisions a quantized (AMCT deploy form) model may not use.
QUANT_FORBIDDEN_PRECISION = {
    "precision_mode": ("force_fp32", "must_keep_origin_dtype"),
    "precision_mode_v2": ("origin",),
}
QUANT_FORBIDDEN_FLAGS = ("dynamic_batch_size", "dynamic_image_size")

ENUMS: dict[str, tuple[str, ...]] = {
    "mode": ("0", "1", "3", "6"),
    "precision_mode": PRECISION_MODES,
    "precision_mode_v2": PRECISION_MODES_V2,
    "input_format": ("NCHW", "NCDHW", "ND"),
    "op_select_implmode": (
        "high_performance",
        "high_precision",
        "high_precision_for_all",
        "high_performance_for_all",
    ),
    "log": ("debug", "info", "warning", "error", "null"),
    "host_env_os": ("linux", "minios"),
    "host_env_cpu": ("x86_64", "aarch64", "arm64", "arm"),
    "external_weight": ("0", "1", "2"),
    "buffer_optimize": ("l2_optimize", "l1_optimize", "off_optimize"),
    "op_debug_level": ("0", "1", "2", "3", "4"),
    "status_check": ("0", "1"),
}

# ATC's coded errors, turned into what a user should do.
ERROR_CODES = {
    "E16002": "the ONNX parser has no plugin for an op type at this opset; run `vlmc compile` precheck and export at opset 17",
    "E10001": "an option has an invalid value; compare the command with docs/ascend.md",
    "E10002": "--input_shape is malformed or names an input the model does not have",
    "E10009": "two mutually exclusive options were given (e.g. two --dynamic_* options, or both precision options)",
    "E10035": "too few dynamic profiles: --dynamic_dims needs at least 2 (and at most 100)",
    "E10054": "a required option is missing (--model, --framework, --output or --soc_version)",
    "EZ3003": "no kernel implements an op with these dtypes/shapes on this SoC; check the op and its dtype",
}
SUCCESS_TEXT = "ATC run success"


@dataclass
class AtcCommand:
    """One ATC invocation: ordered ``--name=value`` options plus the context the rules need."""

    options: dict[str, str]
    quantized: bool = False
    sequence: bool = False
    files: dict[str, str] = field(default_factory=dict)  # config files the options refer to: name -> text

    def argv(self) -> list[str]:
        return ["atc"] + [f"--{k}={v}" for k, v in self.options.items()]

    def shell(self) -> str:
        return shlex.join(self.argv())


def parse_argv(argv: list[str]) -> dict[str, str]:
    """``['atc', '--a=1', ...]`` -> ``{'a': '1'}``; malformed or repeated options raise VlmcError."""
    out: dict[str, str] = {}
    for arg in argv[1:] if argv and argv[0] == "atc" else argv:
        if not arg.startswith("--") or "=" not in arg:
            raise VlmcError(f"ATC option {arg!r} is not written as --name=value")
        name, value = arg[2:].split("=", 1)
        if name in out:
            raise VlmcError(f"ATC option --{name} is given twice")
        out[name] = value
    return out


def parse_input_shape(text: str) -> list[tuple[str, list[str]]]:
    """``"a:1,-1;b:2"`` -> ``[('a', ['1', '-1']), ('b', ['2'])]`` (dims kept as text for range checks)."""
    entries = []
    for part in text.split(";"):
        if ":" not in part:
            raise ValueError(f"entry {part!r} is not name:dims")
        name, dims = part.rsplit(":", 1)
        entries.append((name, dims.split(",") if dims else []))
    return entries


def _profiles(text: str) -> list[list[str]]:
    return [p.split(",") for p in text.split(";")]


def _positive_int(v: str) -> bool:
    return v.isdigit() and int(v) > 0


def problems(options: dict[str, str], quantized: bool = False, sequence: bool = False) -> list[str]:
    """Every rule an ATC command breaks (empty when ATC would accept it).

    Args:
        options: parsed ``--name=value`` options.
        quantized: the model is in AMCT deploy form (AscendQuant/AscendDequant/weight-quant ops).
        sequence: the model takes token sequences, so its inputs must be declared ND.
    """
    out: list[str] = []
    for name in options:
        if name in NOT_ATC_FLAGS:
            out.append(f"--{name} is not an ATC option ({NOT_ATC_FLAGS[name]})")
        elif name not in FLAGS:
            out.append(f"--{name} is not an ATC option (ATC: unknown command line flag '{name}')")
    for name in REQUIRED:
        if not options.get(name):
            out.append(f"--{name} is required")
    if options.get("framework", FRAMEWORK_ONNX) != FRAMEWORK_ONNX:
        out.append(f"--framework must be {FRAMEWORK_ONNX} (ONNX), got {options['framework']}")
    if options.get("output", "").endswith(".om"):
        out.append("--output takes no suffix; ATC appends .om")
    socv = options.get("soc_version")
    if socv is not None and socv not in soc.SOCS:
        if socv in soc.FAMILIES:
            out.append(
                f"--soc_version={socv} is a family name that ATC reads as a different chip; "
                f"use a variant: {', '.join(soc.FAMILIES[socv][0])}"
            )
        else:
            out.append(f"--soc_version={socv} is not a known SoC ({', '.join(sorted(soc.SOCS))})")
    for name, allowed in ENUMS.items():
        if name in options and options[name] not in allowed:
            out.append(f"--{name}={options[name]} is not one of {', '.join(allowed)}")
    if "input_shape_range" in options:
        out.append("--input_shape_range is deprecated; use --input_shape with -1 and --dynamic_dims")
    out += _shape_problems(options, quantized)
    if "precision_mode" in options and "precision_mode_v2" in options:
        out.append("--precision_mode and --precision_mode_v2 are mutually exclusive")
    precision = options.get("precision_mode_v2") or options.get("precision_mode") or "force_fp16"
    if "modify_mixlist" in options and not (
        precision.startswith("allow_mix_precision") or precision.startswith("mixed_")
    ):
        out.append(f"--modify_mixlist needs an allow_mix_precision* or mixed_* precision, not {precision}")
    if "keep_dtype" in options and precision in ("must_keep_origin_dtype", "origin"):
        out.append(f"--keep_dtype has no effect with precision {precision}")
    if "optypelist_for_implmode" in options and "op_select_implmode" not in options:
        out.append("--optypelist_for_implmode requires --op_select_implmode")
    if quantized:
        for name in QUANT_FORBIDDEN_FLAGS:
            if name in options:
                out.append(f"a quantized model cannot use --{name}")
        for name, bad in QUANT_FORBIDDEN_PRECISION.items():
            if options.get(name) in bad:
                out.append(f"a quantized model cannot use --{name}={options[name]}")
    if sequence and options.get("input_format") != "ND":
        out.append("a sequence model needs --input_format=ND (the default NCHW is for images)")
    return out


def _shape_problems(options: dict[str, str], quantized: bool) -> list[str]:
    out: list[str] = []
    gears = [g for g in GEAR_FLAGS if g in options]
    if len(gears) > 1:
        out.append(f"{' and '.join('--' + g for g in gears)} are mutually exclusive")
    if gears and "input_shape_range" in options:
        out.append(f"--{gears[0]} cannot be combined with --input_shape_range")
    if "dynamic_dims" in options and options.get("input_format", "NCHW") != "ND":
        # The --dynamic_dims page describes gears "in ND format" and every example passes
        # --input_format=ND (hicann/ge docs/zh/user_guides/atc_tools/CLI_options/--dynamic_dims.md).
        out.append("--dynamic_dims gears are for ND inputs: give --input_format=ND")
    if "dynamic_dims" in options and "insert_op_conf" in options:
        out.append("--dynamic_dims cannot be combined with --insert_op_conf (AIPP)")
    shape_text = options.get("input_shape")
    if shape_text is None:
        if gears:
            out.append(f"--{gears[0]} needs --input_shape with -1 entries")
        return out
    try:
        entries = parse_input_shape(shape_text)
    except ValueError as exc:
        return out + [f"--input_shape: {exc}"]
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        out.append("--input_shape names an input twice")
    n_dynamic = 0
    has_range = False
    for name, dims in entries:
        for d in dims:
            if d == "-1":
                n_dynamic += 1
            elif "~" in d:
                lo, _, hi = d.partition("~")
                has_range = True
                if not (_positive_int(lo) and _positive_int(hi) and int(lo) <= int(hi)):
                    out.append(f"--input_shape {name}: range {d!r} must be lo~hi with 1 <= lo <= hi")
            elif not d.isdigit():
                out.append(f"--input_shape {name}: dimension {d!r} is not an integer, -1 or a range")
    if has_range and gears:
        out.append(f"--input_shape ranges (a~b) cannot be combined with --{gears[0]}")
    if n_dynamic and not gears and not has_range:
        out.append(
            "--input_shape has -1 dimensions but no gears: ATC would build a fully dynamic-shape model"
        )
    if gears and not n_dynamic:
        out.append(f"--{gears[0]} is given but --input_shape has no -1 dimension")
    if "dynamic_dims" in options:
        profiles = _profiles(options["dynamic_dims"])
        out += _count_problems("dynamic_dims", len(profiles))
        for p in profiles:
            if len(p) != n_dynamic:
                out.append(
                    f"--dynamic_dims profile {','.join(p)!r} has {len(p)} values but --input_shape has "
                    f"{n_dynamic} -1 dimensions"
                )
                break
            if not all(_positive_int(v) for v in p):
                out.append(f"--dynamic_dims profile {','.join(p)!r} must hold positive integers")
                break
        if len({tuple(p) for p in profiles}) != len(profiles):
            out.append("--dynamic_dims repeats a profile")
    if "dynamic_batch_size" in options:
        values = options["dynamic_batch_size"].split(",")
        out += _count_problems("dynamic_batch_size", len(values))
        if not all(_positive_int(v) for v in values):
            out.append("--dynamic_batch_size must list positive integers")
        if any("-1" in dims[1:] for _, dims in entries):
            out.append("--dynamic_batch_size allows -1 only in the first (batch) dimension")
    if "dynamic_image_size" in options:
        pairs = _profiles(options["dynamic_image_size"])
        out += _count_problems("dynamic_image_size", len(pairs))
        if not all(len(p) == 2 and all(_positive_int(v) for v in p) for p in pairs):
            out.append("--dynamic_image_size profiles must be h,w pairs of positive integers")
        for name, dims in entries:
            if "-1" in dims and (len(dims) != 4 or "-1" in dims[:2]):
                out.append(f"--dynamic_image_size allows -1 only in H and W of a 4-D input ({name})")
    return out


def _count_problems(flag: str, n: int) -> list[str]:
    if n < MIN_PROFILES:
        return [f"--{flag} needs at least {MIN_PROFILES} profiles, got {n}"]
    if n > MAX_PROFILES:
        return [f"--{flag} allows at most {MAX_PROFILES} profiles, got {n}"]
    return []


def build(
    options: dict[str, str],
    quantized: bool = False,
    sequence: bool = False,
    files: dict[str, str] | None = None,
) -> AtcCommand:
    """An ATC command that satisfies every rule, or VlmcError naming the first broken one."""
    cmd = AtcCommand(dict(options), quantized=quantized, sequence=sequence, files=dict(files or {}))
    found = problems(cmd.options, quantized=quantized, sequence=sequence)
    if found:
        raise VlmcError(f"ATC command for {options.get('output', '?')} breaks a rule: {found[0]}")
    return cmd


def explain(log_text: str) -> list[str]:
    """Readable messages for the coded errors (and unknown flags) in ATC's output."""
    messages: list[str] = []
    for m in re.finditer(r"unknown command line flag '([^']+)'", log_text):
        messages.append(f"ATC does not know the flag --{m.group(1)}")
    seen: set[str] = set()
    for m in re.finditer(r"\b(E[0-9A-Z]\d{4})\b", log_text):
        code = m.group(1)
        if code in seen:
            continue
        seen.add(code)
        line = _line_around(log_text, m.start())
        meaning = ERROR_CODES.get(code, "see the CANN error code reference")
        messages.append(f"{code}: {meaning} (ATC said: {line})")
    return messages


def _line_around(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start : end if end >= 0 else len(text)].strip()[:300]


def om_files(output: Path) -> list[Path]:
    """The .om files ATC wrote for ``--output``: ``<out>.om`` or, for dynamic-shape models,
    ``<out>_<os>_<cpu>.om``."""
    found = []
    plain = output.with_name(output.name + ".om")
    if plain.is_file():
        found.append(plain)
    found += sorted(p for p in output.parent.glob(output.name + "_*_*.om") if p.is_file())
    return found


def run(cmd: AtcCommand, cwd: Path, log_path: Path, atc_exe: str) -> dict:
    """Run one ATC command in ``cwd`` (where it writes fusion_result.json), logging to ``log_path``."""
    argv = [atc_exe] + cmd.argv()[1:]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, check=False)
    text = log_path.read_text(errors="replace")
    output = (cwd / cmd.options["output"]).resolve()
    oms = om_files(output)
    ok = proc.returncode == 0 and SUCCESS_TEXT in text and bool(oms)
    return {
        "status": "ok" if ok else "failed",
        "returncode": proc.returncode,
        "log": str(log_path),
        "om": [str(p) for p in oms],
        "errors": [] if ok else (explain(text) or [_tail(text)]),
    }


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "ATC printed nothing"
