"""The scale benchmark's tools: the shard-by-shard checkpoint writer, the disk floor, the RSS watchdog."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
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
