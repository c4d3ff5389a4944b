"""Greedy tokens of Qwen-VL-Chat's own remote code (model.chat) for one image and question, as JSON on stdout.

Run with the separate venv of scripts/remote_reference_venv.sh (transformers 4.44, where the published code runs
unmodified), on a model directory that holds the repository's Python files next to its config and weights:

    .venv-remote/bin/python scripts/qwen_vl_remote_reference.py DIR IMAGE "question" 8

The query is "Picture 1: <img>IMAGE</img>\n" + question, as the hub's from_list_format writes it. The generated ids are read from the model's generate call inside chat (a wrapper records them; the remote code
itself is not changed). This script imports nothing from vlmc.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    directory, image, question, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, fp32=True).eval()
    recorded = {}
    generate = model.generate

    def recording(inputs, **kwargs):
        out = generate(inputs, **kwargs)
        recorded["prompt"], recorded["out"] = inputs[0].tolist(), out[0].tolist()
        return out

    model.generate = recording
    # the query as the hub's current tokenization_qwen.from_list_format writes it ("Picture 1: <img>...</img>\n");
    # some older copies of that file (e.g. the x1ngzai/Qwen-VL-Chat-Int4 mirror) write "Picture 1:" without the
    # space, so the text is laid out here and everything after it (tokenize, make_context, chat) is the remote's
    query = f"Picture 1: <img>{image}</img>\n{question}"
    with torch.no_grad():
        response, _ = model.chat(tok, query=query, history=None, do_sample=False, max_new_tokens=new)
    new_ids = recorded["out"][len(recorded["prompt"]) :]
    print(json.dumps({"prompt_ids": recorded["prompt"], "tokens": new_ids, "response": response}))


if __name__ == "__main__":
    main()
