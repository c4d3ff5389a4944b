"""Shared fixtures: built-in packages exported once per test session (per xdist worker)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """Export a built-in once per session: exported("tiny-llava") -> package directory."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            from vlmc import exporters

            out = tmp_path_factory.mktemp(name.replace(".", "_")) / "pkg"
            exporters.export(exporters.load_source(name)).save(out)
            cache[name] = out
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_llava(exported) -> Path:
    return exported("tiny-llava")


@pytest.fixture(scope="session")
def mha(tmp_path_factory) -> Path:
    """tiny-llava with as many KV heads as query heads (LLaVA-1.5's shape, no repeat_kv in the graph; the
    built-in has 4 over 2), exported once per session."""
    import torch
    from _export import export_model
    from transformers import LlavaForConditionalGeneration

    from vlmc.exporters import zoo

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(zoo.tiny_llava_config(num_key_value_heads=4)).eval()
    return export_model(tmp_path_factory, model, "tiny-llava-mha", "llava")
