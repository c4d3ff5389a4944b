"""vlmc/runtime/chat.py: a source's Jinja chat template rendered as transformers does, and bounded."""

from __future__ import annotations

import pytest

from vlmc.errors import VlmcError
from vlmc.runtime import chat

# The shape of a typical chat template: a loop over messages and their content parts, a generation prompt
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_plain_prompt_is_one_user_turn_with_its_images_first():
    assert chat.user_message("hi", 2) == [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hi"}]}
    ]
    assert chat.render(TEMPLATE, "what is this?", 1) == "<|user|>\n<image>\nwhat is this?<|assistant|>\n"


def test_a_conversation_renders_every_turn_and_special_tokens_are_variables():
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
    ]
    template = "{{ bos_token }}" + TEMPLATE
    got = chat.render(template, turns, 0, special_tokens={"bos_token": "<s>"})
    # trim_blocks (as transformers sets it) drops the newline right after each `{% endfor %}`
    assert got == "<s><|user|>\na<|assistant|>\nb<|assistant|>\n"


def test_tojson_does_not_escape_html_and_trim_blocks_drops_the_newline_after_a_tag():
    # transformers' environment: tojson(ensure_ascii=False) without HTML escaping; trim_blocks
    template = "{% if true %}\n{{ messages[0]['content'][0]['text'] | tojson }}{% endif %}"
    assert chat.render(template, "<b>é</b>", 0) == '"<b>é</b>"'


def test_raise_exception_in_the_template_is_one_line_error():
    with pytest.raises(VlmcError, match="failed to render: only user and assistant roles"):
        chat.render("{{ raise_exception('only user and assistant roles') }}", "x", 0)


def test_a_range_past_the_sandbox_bound_is_refused():
    with pytest.raises(VlmcError, match=r"ran past a bound: range of 1000000 items"):
        chat.render("{% for i in range(1000000) %}{% endfor %}", "x", 0)


def test_nested_loops_run_out_of_steps_instead_of_running_on(monkeypatch):
    monkeypatch.setattr(chat.limits, "MAX_TEMPLATE_STEPS", 1000)
    template = "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
    with pytest.raises(VlmcError, match="ran past a bound: more than 1000 steps"):
        chat.render(template, "x", 0)


def test_output_above_the_size_bound_is_refused(monkeypatch):
    monkeypatch.setattr(chat.limits, "MAX_TEMPLATE_OUTPUT_CHARS", 50)
    with pytest.raises(VlmcError, match="output above 50 characters"):
        chat.render("{% for i in range(30) %}xxxx{% endfor %}", "x", 0)
