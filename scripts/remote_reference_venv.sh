#!/usr/bin/env bash
# A separate venv where the remote code of Qwen-VL-Chat runs unmodified (transformers 4.44, as the published
# code expects; vlmc's own venv has transformers 5, where that code does not run). Used only by the tests marked
# `remote_reference` (kept out of `make test`; docs/families.md says how to run them).
#
# torchvision: PyPI's torchvision does not import beside this machine's torch 2.13.0 file, so the pair that
# lies on this machine's disk for Python 3.11 is used (torch 2.14.1 + torchvision 0.29.1 on x86_64,
# torch 2.9.1 + torchvision 0.24.1 on aarch64).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$here/.venv-remote}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
if [ "$(uname -m)" = "aarch64" ]; then
  torch_pair=(torch==2.9.1 torchvision==0.24.1)
else
  torch_pair=(torch==2.14.1 torchvision==0.29.1)
fi
"$venv/bin/pip" install -q "${torch_pair[@]}"
"$venv/bin/pip" install -q transformers==4.44.2 tiktoken einops pillow matplotlib safetensors accelerate \
  "numpy<3" pytest transformers_stream_generator==0.0.4
echo "remote reference venv ready: $venv"
