"""What the remote-reference tests share: the transformers 4.44 venv, the remote code's files, a random picture,
the reference script run in that venv, and the remote tokens cut where vlmc stops (marker remote_reference)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
REMOTE_PYTHON = Path(os.environ.get("VLMC_REMOTE_PYTHON", ROOT / ".venv-remote" / "bin" / "python"))


def ready(env_var: str, files: tuple[str, ...], repo: str) -> str | None:
    """Why the remote reference can't run here (no venv, or ``env_var`` names no directory with ``files``)."""
    if not REMOTE_PYTHON.exists():
        return f"no remote reference venv ({REMOTE_PYTHON}; scripts/remote_reference_venv.sh makes it)"
    code = os.environ.get(env_var)
    if not code or not all((Path(code) / f).is_file() for f in files):
        return f"{env_var} does not name a directory with {repo}'s Python files"
    return None


def add_code(hub: Path, env_var: str, files: tuple[str, ...]) -> None:
    """Copy the remote code's ``files`` (from the directory ``env_var`` names) next to a hub copy."""
    for f in files:
        shutil.copy(Path(os.environ[env_var]) / f, hub / f)


def picture(path: Path, size: tuple[int, int], seed: int) -> Path:
    """A random RGB picture of ``size`` (height, width) written as PNG."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return path


def run(script: str, hub: Path, image: Path, question: str, new: int, timeout: int) -> dict:
    """``scripts/<script>`` in the remote venv (no PYTHONPATH of ours): the JSON its last line prints."""
    done = subprocess.run(
        [str(REMOTE_PYTHON), str(ROOT / "scripts" / script), str(hub), str(image), question, str(new)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """The remote tokens up to and including the first of vlmc's stop ids (vlmc stops there)."""
    out = []
    for t in tokens:
        out.append(t)
        if t in stops:
            break
    return out
