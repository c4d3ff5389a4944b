"""Greedy tokens of Phi-3-vision-128k-instruct's own remote code for one image and question, as JSON on stdout.

Run with the separate venv of scripts/remote_reference_venv.sh (transformers 4.44, where the published code runs
unmodified), on a model directory that holds the repository's Python files next to its config and weights:

    .venv-remote/bin/python scripts/phi3_v_remote_reference.py DIR IMAGE "question" 8

The steps are the model card's (huggingface.co/microsoft/Phi-3-vision-128k-instruct): the user message
"<|image_1|>\\n" + question through the tokenizer's chat template with add_generation_prompt, the repository's
Phi3VProcessor on that prompt and the image, then model.generate greedy (do_sample False) with
eos_token_id = tokenizer.eos_token_id (its raw first-step logits are printed too); the model is loaded with
_attn_implementation="eager", as the card says to do without flash attention. This script imports nothing from
vlmc and changes nothing of the remote code.
"""

from __future__ import annotations

import json
import sys

import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoProcessor


def main() -> None:
    directory, image, question, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        directory, trust_remote_code=True, torch_dtype=torch.float32, _attn_implementation="eager"
    ).eval()
    processor = AutoProcessor.from_pretrained(directory, trust_remote_code=True)
    messages = [{"role": "user", "content": f"<|image_1|>\n{question}"}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(prompt, [Image.open(image)], return_tensors="pt")
    # read before generate: the remote forward edits input_ids in place
    prompt_ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(
            **inputs,
            eos_token_id=processor.tokenizer.eos_token_id,
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    print(
        json.dumps(
            {
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "pixel_values_shape": list(inputs["pixel_values"].shape),
                "image_sizes": inputs["image_sizes"].tolist(),
                "tokens": out.sequences[0, len(prompt_ids) :].tolist(),
                "first_logits": out.logits[0][0].tolist(),  # the raw logits of the last prompt position
            }
        )
    )


if __name__ == "__main__":
    main()
