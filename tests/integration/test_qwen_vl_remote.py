"""Qwen-VL against its own remote code (model.chat), run unmodified where it runs: transformers 4.44 in a venv of
its own. Kept out of `make test`: marked remote_reference and skipped unless that venv and the remote code exist.

    scripts/remote_reference_venv.sh                       # makes .venv-remote
    VLMC_QWEN_VL_REMOTE_CODE=/path/to/Qwen-VL-Chat \\         # modeling_qwen.py, visual.py, ... of the hub repo
        .venv/bin/python -m pytest -n 0 -m remote_reference tests/integration/test_qwen_vl_remote.py
"""

from __future__ import annotations

import sys

import pytest
from _qwen_vl_hub import write_hub_copy
from _remote_reference import add_code, picture, ready, run, until_stop

from vlmc import exporters
from vlmc.package import Package
from vlmc.runtime import Pipeline

pytestmark = pytest.mark.remote_reference

CODE_VAR = "VLMC_QWEN_VL_REMOTE_CODE"
CODE_FILES = (
    "configuration_qwen.py",
    "modeling_qwen.py",
    "qwen_generation_utils.py",
    "tokenization_qwen.py",
    "visual.py",
)


NOT_READY = ready(CODE_VAR, CODE_FILES, "Qwen-VL-Chat")


@pytest.mark.skipif(NOT_READY is not None, reason=str(NOT_READY))
@pytest.mark.parametrize("question", ["What is in the picture?", "Describe it in one word."])
def test_run_equals_remote_chat(tmp_path, question):
    hub = write_hub_copy(tmp_path / "Qwen-VL-Chat")
    add_code(hub, CODE_VAR, CODE_FILES)
    image = picture(tmp_path / "picture.png", (300, 400), seed=1)
    new = 8
    remote = run("qwen_vl_remote_reference.py", hub, image, question, new, timeout=900)

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
    want = until_stop(remote["tokens"], set(pkg.manifest["text"]["eos_token_id"]))
    print(f"vlmc {got} remote {remote['tokens']}", file=sys.stderr)
    assert list(got) == want
