#!/usr/bin/env bash
# A separate venv where the remote code of Qwen-VL-Chat runs unmodified (transformers 4.44, as the published
# code expects; vlmc's own venv has transformers 5, where that code does not run). Used only by the tests marked
# `remote_reference` (kept out of `make test`; docs/families.md says how to run them).
#
# The remote Python files are not in this repository; the tests take a directory holding them from an env var:
#   VLMC_QWEN_VL_REMOTE_CODE  configuration_qwen.py modeling_qwen.py qwen_generation_utils.py tokenization_qwen.py
#                             visual.py (run here from the public mirror github.com/x1ngzai/Qwen-VL-Chat-Int4)
#   VLMC_PHI3_V_REMOTE_CODE   configuration_phi3_v.py modeling_phi3_v.py image_embedding_phi3_v.py
#                             image_processing_phi3_v.py processing_phi3_v.py (run here from the clone of the hub
#                             repo at github.com/Aritra02091998/Phi-3-vision-128k-instruct-Improvised-for-QLORA-Training)
# e.g. git clone https://github.com/x1ngzai/Qwen-VL-Chat-Int4, or the hub repo itself (huggingface.co/Qwen/Qwen-VL-Chat,
# huggingface.co/microsoft/Phi-3-vision-128k-instruct) without its weights.
# The Phi-3-V processor imports torchvision, hence the torch pair below (a CUDA build; it runs on CPU).
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
