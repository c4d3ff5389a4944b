"""The build report: report.md in every package, and the same data for `vlmc inspect`."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import onnx_ir as ir

import vlmc.manifest
from vlmc import graphs, interop, outdir, paths
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def kv_bytes_per_token(manifest: dict) -> int:
    kv = manifest["kv"]
    itemsize = 2 if kv.get("dtype") in ("float16", "bfloat16") else 4
    return 2 * int(kv["layers"]) * int(kv["kv_heads"]) * int(kv["head_dim"]) * itemsize


def summary(pkg, with_ops: bool = True, root: Path | None = None) -> dict:
    """A plain-dict summary of a package (used by `vlmc inspect --json` and report.md).

    Args:
        pkg: the package.
        with_ops: read every graph for op histograms and weight bytes.
        root: the directory its verify.json and pictures are read from (default: the package's own).
    """
    m = pkg.manifest
    graph_entries = {}
    total_weights = 0
    stored: dict[str, int] = {}  # weight copies as stored: a weight shared between graphs counts once
    for name, info in sorted(
        m["graphs"].items()
    ):  # vlmc.json stores graphs sorted; a package in memory may not
        entry = {
            "role": info["role"],
            "precision": info["precision"],
            "file": info["file"],
            "inputs": info["inputs"],
            "outputs": info["outputs"],
        }
        if with_ops:
            # Graphs as IR, weights never read: histograms and byte counts need only the structure,
            # dtypes and shapes (a graph unchanged since read is opened again from its file).
            path = pkg.path_of(name)
            model = graphs.load_ir(path) if path is not None else pkg.model(name)
            entry["ops"] = graphs.op_histogram(model)
            entry["weight_bytes"] = graphs.initializer_bytes(model)
            entry["weights_by_dtype"] = weight_dtypes(model)
            total_weights += entry["weight_bytes"]
            stored.update(weight_regions(model))
        graph_entries[name] = entry
    return {
        "model": m["model"],
        "vision": {k: m["vision"].get(k) for k in ("image_size", "tokens_per_image", "image_token_id")},
        "kv": dict(m["kv"], bytes_per_token=kv_bytes_per_token(m)),
        "graphs": graph_entries,
        "pipeline": m.get("pipeline", {}),
        "unique_weight_bytes": sum(stored.values()) if with_ops else None,
        "total_weight_bytes": total_weights if with_ops else None,
        "history": [{"pass": h["pass"], "modified": h["modified"]} for h in m.get("history", [])],
        "precision": {
            name: {"precision": g["precision"], "weights_by_dtype": g.get("weights_by_dtype", {})}
            for name, g in graph_entries.items()
        },
        "verify": verify_data(pkg, root),
        "compile": pkg.report.get("compile"),
        "pictures": pictures(pkg, root),
    }


def weight_dtypes(model: ir.Model) -> dict[str, int]:
    """Weight bytes per element type in a graph (initializers only): the precision map's evidence.

    Sizes come from each tensor's dtype and shape, so memory-mapped weights are never read.
    """
    out: dict[str, int] = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None:
            continue
        try:
            name = np.dtype(tensor.dtype.numpy()).name
        except Exception:  # types numpy has no name for (bfloat16, float8, int4)
            name = f"onnx:{int(tensor.dtype)}"
        out[name] = out.get(name, 0) + tensor.nbytes
    return dict(sorted(out.items()))


def weight_regions(model: ir.Model) -> dict[str, int]:
    """Stored weight copies of a graph: identity -> bytes (initializers and Constant tensors).

    Tensors in a file are identified by where they are stored (file, offset, length), so graphs that
    share a data file count a shared weight once, and nothing is read; in-memory tensors by content.
    """
    tensors = [v.const_value for v in model.graph.initializers.values() if v.const_value is not None]
    for node in model.graph:
        if node.op_type == "Constant" and node.domain == "":
            tensors.extend(a.value for a in node.attributes.values() if a.type == ir.AttributeType.TENSOR)
    in_memory = [t for t in tensors if not isinstance(t, ir.ExternalTensor)]
    hashes = dict(zip(map(id, in_memory), interop.tensor_hashes(in_memory)))
    out: dict[str, int] = {}
    for tensor in tensors:
        if isinstance(tensor, ir.ExternalTensor):
            key = f"{Path(tensor.path).resolve()}@{tensor.offset or 0}+{tensor.length}"
        else:
            key = hashes[id(tensor)]
        out[key] = tensor.nbytes
    return out


def manifest_digest(manifest: dict) -> str:
    """sha256 of the canonical manifest text: identifies one package state (graphs, facts, history)."""
    return hashlib.sha256(vlmc.manifest.dumps(manifest).encode()).hexdigest()


def verify_data(pkg, root: Path | None = None) -> dict | None:
    """The last `vlmc verify` result for this exact package (report.json's copy, else verify.json)."""
    data = pkg.report.get("verify")
    root = root or pkg.root
    if not data and root is not None and (root / "verify.json").is_file():
        try:
            data = json.loads(paths.read_text(root, "verify.json", "verify.json", str(root)))
        except (OSError, ValueError, RecursionError, VlmcError):
            data = None
    if not isinstance(data, dict) or data.get("manifest_sha256") != manifest_digest(pkg.manifest):
        return None  # absent, or measured on the package this one was optimized from
    return data


PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg")


def pictures(pkg, root: Path | None = None) -> list[str]:
    """Pictures a pass attached to the package (e.g. the pruning overlay), as paths relative to it."""
    root = root or pkg.root
    names = {rel for rel in pkg.files if rel.lower().endswith(PICTURE_SUFFIXES)}
    if root is not None and root.is_dir():
        # Through the confinement rule: a picture that is a link out of the package refuses it.
        names |= {
            rel for rel, _ in paths.package_files(root, str(root)) if rel.lower().endswith(PICTURE_SUFFIXES)
        }
    return sorted(names)


def compile_summary(compiled: dict | None) -> dict | None:
    """What the report keeps of a backend's compile.json: target, warnings and the compiler commands."""
    if not compiled:
        return None
    out = {k: compiled[k] for k in ("backend", "soc_version") if k in compiled}
    builds = compiled.get("builds") or []
    out["commands"] = {b["name"]: b["command"] for b in builds if isinstance(b, dict) and b.get("command")}
    out["warnings"] = list(compiled.get("warnings") or [])
    return out


def write(pkg, root: Path) -> None:
    """(Re)write report.json and report.md in a package directory."""
    root = Path(root)
    outdir.write_file(
        root, "report.json", json.dumps(pkg.report, indent=2, sort_keys=True, default=str) + "\n"
    )
    outdir.write_file(root, "report.md", render_markdown(pkg, root))


def _as_stored(pkg):
    """A view of the package whose manifest and report read as they will from disk (key-sorted JSON).

    report.md is written at save time from in-memory dicts in insertion order, while `vlmc inspect`
    renders what vlmc.json and report.json give back; rendering both from the stored form keeps
    them identical.
    """
    import copy

    view = copy.copy(pkg)
    view.manifest = json.loads(vlmc.manifest.dumps(pkg.manifest))
    view.report = json.loads(json.dumps(pkg.report, sort_keys=True, default=str))
    return view


def render_markdown(pkg, root: Path | None = None) -> str:
    """Human-readable report of a package (report.md; `vlmc inspect` prints the same text)."""
    root = Path(root) if root is not None else pkg.root
    pkg = _as_stored(pkg)
    s = summary(pkg, root=root)
    m = pkg.manifest
    lines = [f"# vlmc package: {m['model']['source']}", ""]
    lines += [
        f"- family: **{m['model']['family']}** ({m['model']['architecture']})",
        f"- visual tokens per image: {s['vision']['tokens_per_image']}"
        # tiled packages (vision.tiled): an image is 1..n tiles of tokens_per_image each
        + (" per tile" if m["vision"].get("tiled") else ""),
        f"- KV layout: {m['kv']['layout']}"
        + (f" (block size {m['kv'].get('block_size')})" if m["kv"].get("block_size") else ""),
        f"- KV bytes per token: {s['kv']['bytes_per_token']}",
        f"- unique weight bytes: {_fmt_bytes(s['unique_weight_bytes'])} "
        f"(graphs' weights summed: {_fmt_bytes(s['total_weight_bytes'])})",
        "",
    ]
    lines += [
        "## Graphs",
        "",
        "| graph | role | precision | weights | inputs | outputs |",
        "|---|---|---|---|---|---|",
    ]
    for name, g in s["graphs"].items():
        ins = ", ".join(f"`{i['name']}` {i['dtype']}{i['shape']}" for i in g["inputs"][:6])
        if len(g["inputs"]) > 6:
            ins += f", … ({len(g['inputs'])} in all)"
        outs = ", ".join(f"`{o['name']}`" for o in g["outputs"][:4])
        if len(g["outputs"]) > 4:
            outs += f", … ({len(g['outputs'])} in all)"
        lines.append(
            f"| {name} | {g['role']} | {g['precision']} | {_fmt_bytes(g['weight_bytes'])} | {ins} | {outs} |"
        )
    lines += ["", "## Ops", ""]
    for name, g in s["graphs"].items():
        top = ", ".join(f"{k}×{v}" for k, v in g["ops"].items())
        lines.append(f"- **{name}**: {top}")
    timings = {(p["index"], p["pass"]): p for p in pkg.report.get("passes", [])}
    if m.get("history"):
        lines += ["", "## Passes", "", "| # | pass | modified | seconds | report |", "|---|---|---|---|---|"]
        for h in m["history"]:
            t = timings.get((h.get("index"), h["pass"]), {})
            rep = "; ".join(f"{k}: {_short(v)}" for k, v in sorted(h.get("report", {}).items()))
            lines.append(
                f"| {h.get('index', '')} | {h['pass']} | {h['modified']} | {t.get('seconds', '')} | {rep} |"
            )
    lines += ["", "## Precision", "", "| graph | precision | weight bytes by dtype |", "|---|---|---|"]
    for name, p in s["precision"].items():
        by = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in p["weights_by_dtype"].items()) or "-"
        lines.append(f"| {name} | {p['precision']} | {by} |")
    lines += _pruning_lines(m)
    lines += _verify_lines(s["verify"])
    lines += _compile_lines(s["compile"])
    if s["pictures"]:
        lines += ["", "## Pictures", ""] + [f"![{Path(rel).stem}]({rel})" for rel in s["pictures"]]
    return "\n".join(lines) + "\n"


def _pruning_lines(m: dict) -> list[str]:
    """The prune_visual_tokens fidelity table (method vs baselines at equal k) and what it saves."""
    rep = next(
        (
            h.get("report", {})
            for h in reversed(m.get("history", []))
            if h["pass"] == "prune_visual_tokens" and h.get("modified")
        ),
        None,
    )
    if not rep:
        return []
    lines = [
        "",
        "## Visual-token pruning",
        "",
        f"{rep.get('method')}: {rep.get('keep')} of {rep.get('tokens_before')} visual tokens per image "
        f"(scores from {rep.get('score_source')})",
        "",
    ]
    fid = rep.get("fidelity") or {}
    rows = [(k, v) for k, v in fid.items() if isinstance(v, dict)]
    if rows:
        lines += [
            f"Against the unpruned package on {fid.get('calibration_images')} calibration image(s):",
            "",
            "| method | first-token KL | cosine | top-1 | top-5 | greedy common prefix |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['kl']:.4g} | {v['cosine']:.4f} | {v['top1']:.2f} | {v['top5']:.2f} | {v['common_prefix']} |"
            for k, v in rows
        ]
    sav = rep.get("savings") or {}
    if sav:
        flops = sav.get("prefill_flops_saved")
        lines += [
            "",
            f"- KV bytes per image: {_fmt_bytes(sav['kv_bytes_per_image_before'])} → "
            f"{_fmt_bytes(sav['kv_bytes_per_image_after'])}",
            "- prefill FLOPs saved (FastV formula, one image"
            + (
                f" + {sav.get('prefill_text_tokens')} text tokens): {flops:.1%}"
                if flops is not None
                else "): unknown"
            ),
        ]
    return lines


def _inputs_summary(inputs: dict) -> str:
    """verify's (a): ids and pixel values of the runtime against the source processor's."""
    if not inputs.get("checked"):
        return f"not checked ({inputs.get('reason', 'verified by an older vlmc')})"
    if not inputs.get("passed"):
        return str(inputs.get("first_difference") or inputs.get("vision_difference"))
    pixels = inputs.get("pixel_max_abs_diff")
    return "identical ids" + (f", pixel values max abs diff {pixels:.3g}" if pixels is not None else "")


def _verify_lines(v: dict | None) -> list[str]:
    if not v:
        return ["", "## Verification", "", "not run (run `vlmc verify PACKAGE`)"]
    kind = "exact package: parity" if v.get("exact_package") else "lossy package: fidelity"
    rows = [
        ("inputs vs the source processor", _inputs_summary(v.get("inputs") or {})),
        ("prefill logits max abs diff", f"{v.get('prefill_logits_max_abs_diff', float('nan')):.3g}"),
        ("prefill logits cosine", f"{v.get('prefill_logits_cosine', float('nan')):.6f}"),
        ("top-1 agreement", f"{v.get('top1_agreement', float('nan')):.3f}"),
        (
            "token agreement",
            f"{v.get('token_agreement', float('nan')):.3f} over {v.get('max_new_tokens')} new tokens",
        ),
        ("common prefix", str(v.get("common_prefix"))),
        ("thresholds", _short(v.get("thresholds"))),
        ("result", "PASS" if v.get("passed") else "FAIL"),
    ]
    return [
        "",
        "## Verification",
        "",
        f"{kind}, against {v.get('source')} in transformers",
        "",
        "| metric | value |",
        "|---|---|",
    ] + [f"| {k} | {val} |" for k, val in rows]


def _compile_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    head = f"backend {c.get('backend')}" + (f", SoC {c['soc_version']}" if c.get("soc_version") else "")
    lines = ["", "## Compile", "", head]
    if c.get("commands"):
        lines += (
            ["", "ATC commands:", "", "```sh"] + [cmd for _, cmd in sorted(c["commands"].items())] + ["```"]
        )
    lines += [f"- warning: {w}" for w in c.get("warnings", [])]
    return lines


def _short(v: object) -> str:
    # Key-sorted JSON for containers: the same text whether the data is fresh or read back from disk.
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
