"""The build report: report.md in every package, and the same data for `vlmc inspect`."""

from __future__ import annotations

import logging
from pathlib import Path

from vlmc import graphs as G

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


def summary(pkg, with_ops: bool = True) -> dict:
    """A plain-dict summary of a package (used by `vlmc inspect --json` and report.md)."""
    m = pkg.manifest
    graphs = {}
    total_weights = 0
    for name, info in m["graphs"].items():
        entry = {"role": info["role"], "precision": info["precision"], "file": info["file"],
                 "inputs": info["inputs"], "outputs": info["outputs"]}
        if with_ops:
            model = pkg.graph(name)
            entry["ops"] = G.op_histogram(model)
            entry["weight_bytes"] = G.initializer_bytes(model)
            total_weights += entry["weight_bytes"]
        graphs[name] = entry
    return {
        "model": m["model"],
        "vision": {k: m["vision"].get(k) for k in ("image_size", "tokens_per_image", "image_token_id")},
        "kv": dict(m["kv"], bytes_per_token=kv_bytes_per_token(m)),
        "graphs": graphs,
        "pipeline": m.get("pipeline", {}),
        "unique_weight_bytes": total_weights if with_ops else None,
        "history": [{"pass": h["pass"], "modified": h["modified"]} for h in m.get("history", [])],
    }


def render_markdown(pkg, root: Path | None = None) -> str:
    """Human-readable report of a package."""
    s = summary(pkg)
    m = pkg.manifest
    lines = [f"# vlmc package: {m['model']['source']}", ""]
    lines += [f"- family: **{m['model']['family']}** ({m['model']['architecture']})",
              f"- visual tokens per image: {s['vision']['tokens_per_image']}",
              f"- KV layout: {m['kv']['layout']}" + (f" (block size {m['kv'].get('block_size')})" if m['kv'].get('block_size') else ""),
              f"- KV bytes per token: {s['kv']['bytes_per_token']}",
              f"- unique weight bytes: {_fmt_bytes(s['unique_weight_bytes'])}", ""]
    lines += ["## Graphs", "", "| graph | role | precision | weights | inputs | outputs |", "|---|---|---|---|---|---|"]
    for name, g in s["graphs"].items():
        ins = ", ".join(f"`{i['name']}` {i['dtype']}{i['shape']}" for i in g["inputs"][:6])
        if len(g["inputs"]) > 6:
            ins += f", … ({len(g['inputs'])} in all)"
        outs = ", ".join(f"`{o['name']}`" for o in g["outputs"][:4])
        if len(g["outputs"]) > 4:
            outs += f", … ({len(g['outputs'])} in all)"
        lines.append(f"| {name} | {g['role']} | {g['precision']} | {_fmt_bytes(g['weight_bytes'])} | {ins} | {outs} |")
    lines += ["", "## Ops", ""]
    for name, g in s["graphs"].items():
        top = ", ".join(f"{k}×{v}" for k, v in list(g["ops"].items())[:12])
        lines.append(f"- **{name}**: {top}")
    timings = {(p["index"], p["pass"]): p for p in pkg.report.get("passes", [])}
    if m.get("history"):
        lines += ["", "## Passes", "", "| # | pass | modified | seconds | report |", "|---|---|---|---|---|"]
        for h in m["history"]:
            t = timings.get((h.get("index"), h["pass"]), {})
            rep = "; ".join(f"{k}: {_short(v)}" for k, v in h.get("report", {}).items())
            lines.append(f"| {h.get('index', '')} | {h['pass']} | {h['modified']} | {t.get('seconds', '')} | {rep} |")
    for section, title in (("verify", "Verification"), ("compile", "Compile")):
        data = pkg.report.get(section)
        if data:
            lines += ["", f"## {title}", "", "```", _pretty(data), "```"]
    return "\n".join(lines) + "\n"


def _short(v: object) -> str:
    text = str(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _pretty(data: object) -> str:
    import json

    return json.dumps(data, indent=2, sort_keys=True, default=str)
