"""Phi-3-vision against its own remote code (the model card's chat template + Phi3VProcessor + generate), run
unmodified where it runs: transformers 4.44 in a venv of its own. Kept out of `make test`: marked remote_reference
and skipped unless that venv and the remote code exist.

    scripts/remote_reference_venv.sh                          # makes .venv-remote
    VLMC_PHI3_V_REMOTE_CODE=/path/to/Phi-3-vision-128k-instruct \\  # modeling_phi3_v.py, ... of the hub repo
        .venv/bin/python -m pytest -n 0 -m remote_reference tests/integration/test_phi3_v_remote.py

The remote code builds its CLIP tower from a constant (ViT-L/14-336) and asserts 24x24 patches of width 1024, so
this copy keeps the published img_processor (no narrowed tower: about 300M random weights, 1.2 GB) and narrows only
the decoder and the vocabulary.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from _phi3_v_hub import PUBLISHED_CONFIG, tokenizer, write_hub_copy
from _remote_reference import add_code, picture, ready, run, until_stop
from click.testing import CliRunner

from vlmc import exporters
from vlmc.cli import main
from vlmc.package import Package
from vlmc.runtime import Pipeline

pytestmark = pytest.mark.remote_reference

CODE_VAR = "VLMC_PHI3_V_REMOTE_CODE"
CODE_FILES = (
    "configuration_phi3_v.py",
    "image_embedding_phi3_v.py",
    "image_processing_phi3_v.py",
    "modeling_phi3_v.py",
    "processing_phi3_v.py",
)


NOT_READY = ready(CODE_VAR, CODE_FILES, "Phi-3-vision-128k-instruct")


@pytest.fixture(scope="module")
def remote_hub(tmp_path_factory):
    """The published config with the real CLIP tower (the remote code takes its widths from a constant) and a
    narrow decoder; pad_token_id is the tokenizer's <|endoftext|> (32000 in the published vocabulary, the
    Phi3VConfig default, which the narrow vocabulary does not reach)."""
    hub = write_hub_copy(
        tmp_path_factory.mktemp("phi3_v_remote") / "Phi-3-vision-128k-instruct",
        vision_layers=24,
        img_processor=dict(PUBLISHED_CONFIG["img_processor"]),
        pad_token_id=tokenizer().token_to_id("<|endoftext|>"),
    )
    add_code(hub, CODE_VAR, CODE_FILES)
    return hub


@pytest.fixture(scope="module")
def remote_package(remote_hub, tmp_path_factory):
    out = tmp_path_factory.mktemp("phi3_v_remote_pkg") / "pkg"
    exporters.export(exporters.load_source(str(remote_hub))).save(out)
    return out


@pytest.mark.skipif(NOT_READY is not None, reason=str(NOT_READY))
@pytest.mark.parametrize(
    ("question", "size"), [("What is in the picture?", (300, 400)), ("Describe it in one word.", (500, 280))]
)
def test_run_equals_remote_generate(remote_hub, remote_package, tmp_path, question, size):
    image = picture(tmp_path / "picture.png", size, seed=size[0])
    new = 8
    remote = run("phi3_v_remote_reference.py", remote_hub, image, question, new, timeout=1800)

    pkg = Package.load(remote_package)
    inp = Pipeline(pkg).prepare([question], [[str(image)]])
    ids = inp.input_ids[0].tolist()
    pad = pkg.manifest["vision"]["image_token_id"]
    # the processor writes -1 (the image's number, negated) into the image rows; every other id is the same
    assert len(ids) == len(remote["prompt_ids"])
    assert [a < 0 for a in remote["prompt_ids"]] == [a == pad for a in ids]
    assert [a for a in ids if a != pad] == [b for b in remote["prompt_ids"] if b >= 0]

    # the logits of the last prompt position, not only their argmax: random weights make greedy tokens repeat
    first = np.asarray(remote["first_logits"], np.float32)
    ours = Pipeline(pkg).generate_from(inp, 1).prefill_logits[0]
    diff = float(np.abs(ours - first).max())
    print(
        f"prefill logits max |vlmc - remote| {diff:.2e} (max |logit| {np.abs(first).max():.2f})",
        file=sys.stderr,
    )
    assert diff < 1e-3 * max(1.0, float(np.abs(first).max()))

    res = CliRunner().invoke(
        main,
        ["run", str(remote_package), "--image", str(image), "--prompt", question]
        + ["--max-new-tokens", str(new), "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)["tokens"][0]
    want = until_stop(remote["tokens"], set(pkg.manifest["text"]["eos_token_id"]))
    print(f"vlmc {got} remote {remote['tokens']}", file=sys.stderr)
    assert list(got) == want
