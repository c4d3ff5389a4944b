"""The scale benchmark's tools: the shard-by-shard checkpoint writer, the disk floor, the RSS watchdog."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import disk_floor  # noqa: E402
import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from vlmc.exporters import zoo

    root = tmp_path_factory.mktemp("ckpt")
    cfg = zoo.tiny_llava_config(num_hidden_layers=3)
    n = make_checkpoint.write(cfg, root / "gen", shard_bytes=100_000)
    return cfg, root, n


def test_checkpoint_writer_uses_save_pretrained_names_and_loads(written):
    from transformers import LlavaForConditionalGeneration

    cfg, root, n = written
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    model.save_pretrained(root / "ref", max_shard_size="100KB")
    index = lambda p: json.loads((p / "model.safetensors.index.json").read_text())["weight_map"]  # noqa: E731
    assert set(index(root / "gen")) == set(index(root / "ref"))
    assert len(set(index(root / "gen").values())) > 1  # sharded
    assert n == sum(p.numel() for p in model.parameters())
    loaded = LlavaForConditionalGeneration.from_pretrained(root / "gen", dtype=torch.float32)
    norm = loaded.model.language_model.layers[2].input_layernorm.weight
    proj = loaded.model.language_model.layers[2].self_attn.q_proj.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert 0.01 < float(proj.std()) < 0.03


def test_disk_floor_reads_once_and_writes_fp32(written, tmp_path):
    _, root, n = written
    res = disk_floor.floor(root / "gen", tmp_path / "floor.bin")
    assert res["read_bytes"] == 2 * n  # bf16
    assert res["written_bytes"] == 4 * n
    # on a disk without room for the whole copy: every byte still written, the file kept small
    bounded = disk_floor.floor(root / "gen", tmp_path / "ring.bin", max_file_bytes=200_000)
    assert bounded["written_bytes"] == 4 * n > 200_000 >= (tmp_path / "ring.bin").stat().st_size


def test_measure_kills_a_child_over_its_rss_limit():
    hog = "import time; b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "_measure.py"),
            "--rss-limit",
            str(200 << 20),
            sys.executable,
            "-c",
            hog,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    res = json.loads(out.stdout)
    assert res["killed_over_rss"] and res["returncode"] != 0 and res["seconds"] < 25


def _measured(code: str, *extra: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "_measure.py"), *extra, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_measure_times_each_step_from_its_progress_note(tmp_path):
    code = (
        "import sys, time\n"
        "print('loading ...', file=sys.stderr, flush=True); time.sleep(0.6)\n"
        "print('a plain line', file=sys.stderr, flush=True)\n"
        "print('pass 1/2: hog ...', file=sys.stderr, flush=True)\n"
        "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.8)\n"
    )
    res = _measured(code, "--log", str(tmp_path / "err.log"))
    assert [s["step"] for s in res["steps"]] == [
        "start-up (before the first note)",
        "loading",
        "pass 1/2: hog",
    ]
    _, load, hog = res["steps"]
    assert load["seconds"] >= 0.5 and hog["seconds"] >= 0.7
    assert hog["peak_rss_bytes"] - load["peak_rss_bytes"] > 200 << 20  # the 300 MiB are in its step
    assert res["last_step"] == "pass 1/2: hog" and res["returncode"] == 0
    assert "a plain line" in (tmp_path / "err.log").read_text()


def test_measure_kills_the_whole_process_tree_and_names_the_step():
    # the hog is a grandchild: the watchdog counts and kills the child's descendants too
    hog = "import time; b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    code = (
        "import subprocess, sys\n"
        "print('quantizing ...', file=sys.stderr, flush=True)\n"
        f"subprocess.run([sys.executable, '-c', {hog!r}])\n"
    )
    res = _measured(code, "--rss-limit", str(200 << 20))
    assert res["killed_over_rss"] and res["seconds"] < 25
    assert res["last_step"] == "quantizing"


def test_bench_splices_only_its_section():
    import bench

    doc = "# Benchmarks\n\n## A\n\nkeep a\n\n" + bench.SCALE_HEADING + "\n\nold row\n\n## B\n\nkeep b\n"
    new = bench.splice_section(doc, bench.SCALE_HEADING, ["", bench.SCALE_HEADING, "", "new row"])
    assert "old row" not in new and "new row" in new
    assert new.index("keep a") < new.index("new row") < new.index("## B") < new.index("keep b")
    assert bench.splice_section("# Benchmarks\n", "## S", ["## S", "x"]).endswith("## S\nx\n")


def test_bench_reports_the_step_a_build_failed_in():
    import bench

    row = {
        "name": "m",
        "params": 10**9,
        "fp32_weight_bytes": 4 * 10**9,
        "rss_limit": 8 << 30,
        "floor_seconds": 10.0,
        "build_seconds": 30.0,
        "build_peak_rss": 8 << 30,
        "build_ok": False,
        "killed_over_rss": True,
        "build_last_line": "",
        "failed_step": "pass 3/4: quantize",
        "load_average": [2.0, 1.5, 1.0],
        "steps": {},
        "notes": [
            {"step": "exporting m (llava)", "start": 1.0, "seconds": 20.0, "peak_rss_bytes": 4 << 30},
            {"step": "pass 3/4: quantize", "start": 21.0, "seconds": 9.0, "peak_rss_bytes": 8 << 30},
        ],
    }
    text = "\n".join(bench.scale_section([row], "python scripts/bench.py --only-7b"))
    assert "killed over the 8.00 GiB RSS limit in pass 3/4: quantize" in text
    assert "| pass 3/4: quantize **← failed here** | 9.00 | 0.90× | 8.00 GiB |" in text
    assert "| exporting m (llava) | 20.00 | 2.00× |" in text
    assert "`python scripts/bench.py --only-7b`" in text


def test_measure_kills_a_child_when_the_disk_gets_full(tmp_path):
    code = "import sys, time; print('writing ...', file=sys.stderr, flush=True); time.sleep(30)"
    res = _measured(code, "--min-free", f"{10**18}:{tmp_path}")  # more free bytes than any disk has
    assert res["killed_low_disk"] and not res["killed_over_rss"] and res["seconds"] < 25
