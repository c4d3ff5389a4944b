"""A multi-turn conversation over one package or build: the history, images per turn, and reuse of both.

`vlmc run --chat` drives it. On a paged package each turn goes through the request scheduler, so the
prompt prefix the earlier turns left in the pool and the features of an image already seen are reused
(vlmc/runtime/scheduler.py); a contiguous package recomputes the whole conversation every turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vlmc.runtime.scheduler import Request, Scheduler

logger = logging.getLogger(__name__)


@dataclass
class Turn:
    text: str
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    time_to_first_token: float | None


@dataclass
class Conversation:
    """The messages so far (transformers' message format) and the images they hold, in order."""

    pipeline: object
    max_new_tokens: int = 256
    messages: list[dict] = field(default_factory=list)
    images: list = field(default_factory=list)
    scheduler: Scheduler | None = None

    def __post_init__(self) -> None:
        if self.scheduler is None and self.pipeline.m["kv"].get("layout") == "paged":
            self.scheduler = Scheduler(self.pipeline, max_batch=1)

    def ask(self, text: str, images: list | None = None) -> Turn:
        """Add a user turn (its images first, then the text), generate the answer and add it too."""
        images = list(images or [])
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        messages = [*self.messages, {"role": "user", "content": content}]
        all_images = [*self.images, *images]
        if self.scheduler is not None:
            (req,) = self.scheduler.run([Request(messages, all_images, self.max_new_tokens)])
            tokens, prompt, cached, ttft = (
                req.tokens,
                req.prompt_tokens,
                req.cached_tokens,
                req.time_to_first_token,
            )
        else:
            res = self.pipeline.generate([messages], [all_images], self.max_new_tokens)
            tokens, prompt, cached, ttft = res.tokens[0], 0, 0, None
        eos = self.pipeline.eos_ids()
        answer = self.pipeline.tokenizer.decode([t for t in tokens if t not in eos])
        self.messages = [*messages, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        self.images = all_images
        return Turn(answer, tokens, prompt, cached, ttft)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
