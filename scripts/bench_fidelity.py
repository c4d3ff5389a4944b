"""Per-graph fidelity of a decoder, whole-graph vs streamed (segment by segment): time, peak RSS, numbers.

    python scripts/bench_fidelity.py PACKAGE [--samples 2] [--mode both|streamed|whole]

PACKAGE is an FP32 package (e.g. `vlmc build` of `scripts/make_checkpoint.py llava-1.5-7b DIR
--text-layers 4` with fold_constants and simplify). The decoder's prefill feeds are recorded from the
package's FP32 pipeline on demo images (without running the decoder), the decoder is quantized INT4
RTN group 128 into a scratch file, and each phase is timed with its own peak RSS (VmHWM reset before
it): the FP32 reference and the quantized run, whole-graph (one session on each graph, as quantize
does below VLMC_MAX_FIDELITY_BYTES) and streamed (passes/quantize/stream_fidelity.py). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split(key + ":")[1].split()[0]) * 1024


def _phase(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    base = _status("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    return out, {
        "seconds": round(time.perf_counter() - t0, 1),
        "peak_rss_gib": round(_status("VmHWM") / 2**30, 2),
        "peak_over_start_gib": round((_status("VmHWM") - base) / 2**30, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--mode", choices=("both", "streamed", "whole"), default="both")
    args = ap.parse_args()

    from vlmc import graphs, interop, ortsession
    from vlmc.package import Package
    from vlmc.passes.quantize import calib, fidelity, scheme, stream_fidelity, weight_only

    pkg = Package.load(args.package)
    name = pkg.manifest["pipeline"]["decoder"][0]
    row: dict = {"graph": name, "fp32_gib": round(graphs.initializer_bytes(pkg.model(name)) / 2**30, 2)}
    refs_images = calib.image_refs(None, args.samples, 0)
    rec, row["record"] = _phase(
        lambda: calib.record(
            pkg, {name}, refs_images, ["Describe the image."], args.samples, 0, set(), feeds_only={name}
        )
    )
    feeds = rec.feeds[name]
    row["prefill_tokens"] = [int(next(iter(f.values())).shape[1]) for f in feeds]
    results = {}
    if args.mode in ("both", "streamed"):
        results["streamed_refs"], row["streamed_fp32"] = _phase(
            lambda: stream_fidelity.reference(pkg.model(name), feeds)
        )
    if args.mode in ("both", "whole"):

        def whole_fp32():
            sess = ortsession.for_graph(pkg, name)
            names = [o.name for o in sess.get_outputs()]
            return [dict(zip(names, sess.run(None, f))) for f in feeds]

        results["whole_refs"], row["whole_fp32"] = _phase(whole_fp32)
    with tempfile.TemporaryDirectory(prefix="bench-fid-", dir=str(Path(args.package).parent)) as tmp:
        plan = scheme.GraphScheme(key=name, weights="int4", group_size=128)
        store = interop.TensorStore(Path(tmp) / "q.onnx.data")
        (quant, _), row["quantize_rtn"] = _phase(
            lambda: weight_only.quantize_weight_only(pkg.model(name), plan, None, store)
        )
        store.close()
        fids = {}
        if "streamed_refs" in results:
            (fids["streamed"], facts), row["streamed_quantized"] = _phase(
                lambda: stream_fidelity.graph_fidelity(
                    quant, "int4_weight_only", feeds, results["streamed_refs"]
                )
            )
            row["streamed_segments"] = facts
        if "whole_refs" in results:

            def whole_q():
                sess = ortsession.dequantized(quant)
                names = [o.name for o in sess.get_outputs()]
                out: dict = {}
                for f, r in zip(feeds, results["whole_refs"]):
                    fidelity.accumulate(out, r, dict(zip(names, sess.run(None, f))))
                return out

            fids["whole"], row["whole_quantized"] = _phase(whole_q)
    for k, fid in fids.items():
        row[f"{k}_logits"] = fid.get("logits")
        row[f"{k}_worst_cosine"] = min(v["cosine"] for v in fid.values())
    if len(fids) == 2:
        row["max_cosine_gap"] = max(
            abs(fids["streamed"][k]["cosine"] - fids["whole"][k]["cosine"]) for k in fids["whole"]
        )
        row["max_abs_diff_gap"] = max(
            abs(fids["streamed"][k]["max_abs_diff"] - fids["whole"][k]["max_abs_diff"]) for k in fids["whole"]
        )
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
