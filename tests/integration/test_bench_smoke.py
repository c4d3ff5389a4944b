"""`make bench` at tiny size: the whole benchmark script runs and writes its report and plots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_quick_writes_report_and_plots(tmp_path):
    out = tmp_path / "benchmarks.md"
    # A hand-written section survives the run; a generated one is replaced, not appended again.
    out.write_text(
        "# Benchmarks\n\nold preamble\n\n## Machine\n\nstale machine table\n\n"
        "## Notes written by hand\n\nmeasured with `some command`: 1.23 s\n"
    )
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = out.read_text()
    assert "| tiny |" in text and "time ratio" in text
    assert "## Notes written by hand\n\nmeasured with `some command`: 1.23 s\n" in text
    assert "stale machine table" not in text and "old preamble" not in text
    assert text.count("## Machine") == 1 and "| cores |" in text
    for bench in ("prune_visual_tokens", "quantize", "paged_kv", "merge"):
        assert bench in text, f"no {bench} rows in the report"
    for png in ("pipeline_time.png", "pipeline_rss.png"):
        assert (tmp_path / "bench" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bench_peers():
    import importlib

    sys.path.insert(0, str(REPO / "scripts"))
    return importlib.import_module("bench_peers")


def test_bench_peers_tokenizer_is_vlmc_byte_layout():
    """The peers' tokenizer (scripts/bench_peers.py) gives the ids vlmc's byte fallback gives: the
    prompts every tool runs have the same ids and length."""
    from vlmc.runtime.tokenizer import ByteTokenizer

    bp = _bench_peers()
    tok = bp.byte_tokenizer(32064, 32000, 32001)
    assert len(tok) == 32064
    ours = ByteTokenizer(32064, 32000, "<image>", bos=1, eos=2)
    for text in ("USER: <image>\nDescribe the image. ASSISTANT:", "héllo wörld ✓"):
        assert tok.encode(text) == ours.encode(text)
    assert tok.decode(ours.encode("héllo ✓")[1:]) == "héllo ✓"
    assert tok.convert_tokens_to_ids(["<image>", "<pad>", "</s>"]) == [32000, 32001, 2]


def test_bench_peers_section_medians_and_paired_ratios():
    """The peer table: medians over rounds, peer / vlmc ratios paired within a round, failures named."""
    bp = _bench_peers()

    def build(s, rss, b):
        return {"ok": True, "seconds": s, "peak_rss_bytes": rss, "bytes": b}

    def run(tok_s, ttft, **kw):
        return {"ok": True, "decode_tok_s": tok_s, "ttft_s": ttft, "tokens": [5, 6], **kw}

    measure = {
        "load": [[20.0, 18.0, 10.0], [25.0, 20.0, 12.0], [22.0, 21.0, 13.0]],
        "builds": {
            "vlmc fp32": [build(10, 2 << 30, 2e9), build(20, 2 << 30, 2e9)],
            "vlmc int4": [build(30, 3 << 30, 7e8), build(40, 3 << 30, 7e8)],
            "ortgenai fp32": [build(5, 1 << 30, 2e9), build(30, 1 << 30, 2e9)],
            "ortgenai int4": [
                build(6, 1 << 30, 7e8),
                {"ok": False, "error": "boom", "seconds": 1, "peak_rss_bytes": 1},
            ],
        },
        "runs": {
            "vlmc fp32": [run(4.0, 3.0), run(2.0, 5.0)],
            "vlmc int4": [
                run(10.0, 2.0, cosine_vs_fp32=0.9, first_token_agrees=True),
                run(20.0, 2.0, cosine_vs_fp32=0.8, first_token_agrees=False),
            ],
            "ortgenai fp32": [run(8.0, 1.0), run(2.0, 1.0)],
            "ortgenai int4": [run(30.0, 1.0, cosine_vs_fp32=0.95, first_token_agrees=True)],
        },
    }
    result = {
        "measure": measure,
        "versions": {"ortgenai": {"onnxruntime-genai": "0.18.0"}},
        "rounds": 2,
        "tokens": 2,
        "threads": 2,
    }
    lines = bp.section(result, "python scripts/bench_peers.py --rounds 2")
    rows = {
        (c[0][2:], c[1]): c for c in (ln.split(" | ") for ln in lines if ln.startswith("| ") and " | " in ln)
    }
    fp32 = rows[("onnxruntime-genai (text decoder)", "FP32")]
    # build seconds: median(5, 30) = 17.5; paired ratios 5/10 and 30/20 -> median 1.00
    assert fp32[2] == "17.5 (1.00×)"
    # decode: median(8, 2) = 5; paired 8/4 = 2 and 2/2 = 1 -> 1.50 (the ratio of medians would be 1.67)
    assert fp32[6] == "5.00 (1.50×)"
    assert fp32[5] == "1.00 (0.27×)"  # time to first token: paired 1/3 and 1/5 -> median 0.267
    int4 = rows[("onnxruntime-genai (text decoder)", "INT4")]
    assert int4[6] == "30.00 (3.00×)" and int4[7] == "1/1 rounds" and int4[8].startswith("0.9500")
    assert "failed: `boom`" in int4[-1]
    vlmc4 = rows[("vlmc", "INT4")]
    assert vlmc4[2] == "35.0" and vlmc4[7] == "1/2 rounds" and vlmc4[8].startswith("0.8500")
    assert "20.0, 18.0, 10.0; 25.0, 20.0, 12.0; 22.0, 21.0, 13.0" in lines[3]
