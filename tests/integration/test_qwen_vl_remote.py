"""Qwen-VL against its own remote code (model.chat), run unmodified where it runs: transformers 4.44 in a venv of
its own. Kept out of `make test`: marked remote_reference and skipped unless that venv and the remote code exist.

    scripts/remote_reference_venv.sh                       # makes .venv-remote
    VLMC_QWEN_VL_REMOTE_CODE=/path/to/Qwen-VL-Chat \\         # modeling_qwen.py, visual.py, ... of the hub repo
        .venv/bin/python -m pytest -n 0 -m remote_reference tests/integration/test_qwen_vl_remote.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _qwen_vl_hub import write_hub_copy
from PIL import Image

from vlmc import exporters
from vlmc.package import Package
from vlmc.runtime import Pipeline

pytestmark = pytest.mark.remote_reference

ROOT = Path(__file__).resolve().parents[2]
REMOTE_PYTHON = Path(os.environ.get("VLMC_REMOTE_PYTHON", ROOT / ".venv-remote" / "bin" / "python"))
REMOTE_CODE = os.environ.get("VLMC_QWEN_VL_REMOTE_CODE")
CODE_FILES = (
    "configuration_qwen.py",
    "modeling_qwen.py",
    "qwen_generation_utils.py",
    "tokenization_qwen.py",
    "visual.py",
)


def _remote_ready() -> str | None:
    if not REMOTE_PYTHON.exists():
        return f"no remote reference venv ({REMOTE_PYTHON}; scripts/remote_reference_venv.sh makes it)"
    if not REMOTE_CODE or not all((Path(REMOTE_CODE) / f).is_file() for f in CODE_FILES):
        return "VLMC_QWEN_VL_REMOTE_CODE does not name a directory with Qwen-VL-Chat's Python files"
    return None


@pytest.mark.skipif(_remote_ready() is not None, reason=str(_remote_ready()))
@pytest.mark.parametrize("question", ["What is in the picture?", "Describe it in one word."])
def test_run_equals_remote_chat(tmp_path, question):
    hub = write_hub_copy(tmp_path / "Qwen-VL-Chat")
    for f in CODE_FILES:
        shutil.copy(Path(REMOTE_CODE) / f, hub / f)
    rng = np.random.default_rng(1)
    image = tmp_path / "picture.png"
    Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(image)
    new = 8
    done = subprocess.run(
        [
            str(REMOTE_PYTHON),
            str(ROOT / "scripts" / "qwen_vl_remote_reference.py"),
            str(hub),
            str(image),
            question,
            str(new),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    remote = json.loads(done.stdout.strip().splitlines()[-1])

    source = exporters.load_source(str(hub))
    exporters.export(source).save(tmp_path / "pkg")
    pkg = Package.load(tmp_path / "pkg")
    pipe = Pipeline(pkg)
    inp = pipe.prepare([question], [[str(image)]])
    ids = inp.input_ids[0].tolist()
    pad = pkg.manifest["vision"]["image_token_id"]
    # the remote prompt writes the picture's path bytes into the image rows; every other id is the same
    assert len(ids) == len(remote["prompt_ids"])
    assert [a for a, b in zip(ids, remote["prompt_ids"]) if a != pad] == [
        b for a, b in zip(ids, remote["prompt_ids"]) if a != pad
    ]
    got = pipe.generate_from(inp, new).tokens[0]
    stops = set(pkg.manifest["text"]["eos_token_id"])
    want = []
    for t in remote["tokens"]:
        want.append(t)
        if t in stops:
            break
    print(f"vlmc {got} remote {remote['tokens']}", file=sys.stderr)
    assert list(got) == want
