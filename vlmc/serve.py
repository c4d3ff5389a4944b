"""`vlmc serve`: an OpenAI-compatible chat endpoint over the request scheduler, on FastAPI + uvicorn.

Imported only by `vlmc serve` (FastAPI and uvicorn are the ``serve`` extra). One engine thread runs :class:`vlmc.runtime.scheduler.Scheduler` (continuous batching over the paged
pool); the event loop only parses requests and streams tokens. Everything a client sends is bounded
(body bytes, messages, image count, pixels, queue length) and refused with a 4xx JSON error in the
OpenAI shape; the server binds 127.0.0.1 unless told otherwise (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from vlmc import paths
from vlmc.errors import VlmcError
from vlmc.runtime.scheduler import Request, Scheduler

logger = logging.getLogger(__name__)

# Bounds on what one client may ask (each is a settable option of `vlmc serve`).
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_MESSAGES = 256
MAX_IMAGES = 16
MAX_STOP = 4
DEFAULT_MAX_QUEUE = 64


class BadRequest(VlmcError):
    """A request the server refuses with a 4xx (its status and the OpenAI error type)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class Limits:
    max_body_bytes: int = MAX_BODY_BYTES
    max_messages: int = MAX_MESSAGES
    max_images: int = MAX_IMAGES
    max_queue: int = DEFAULT_MAX_QUEUE
    max_tokens: int = 4096


class Engine:
    """The scheduler on its own thread; :meth:`submit` is called from the event loop."""

    def __init__(self, scheduler: Scheduler, limits: Limits) -> None:
        self.scheduler = scheduler
        self.limits = limits
        self._cv = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._cancel: list[Request] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="vlmc-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, on_event) -> None:
        """Queue a request; ``on_event(kind, value)`` is called from the engine thread with
        ("token", id), ("error", message) and ("done", finish_reason)."""
        with self._cv:
            queued = len(self._inbox) + len(self.scheduler.waiting)
            if self._stopping:
                raise BadRequest("the server is shutting down", 503, "server_error")
            if queued >= self.limits.max_queue:
                raise BadRequest(
                    f"the queue is full ({queued} requests waiting); retry later", 429, "rate_limit_error"
                )
            request.on_token = lambda r, token: on_event("token", token)
            self._inbox.append((request, on_event))
            self._cv.notify()

    def cancel(self, request: Request) -> None:
        with self._cv:
            self._cancel.append(request)
            self._cv.notify()

    def _loop(self) -> None:
        pending: dict[int, object] = {}
        while True:
            with self._cv:
                while not (self._inbox or self._cancel or self.scheduler.busy or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    for _, on_event in [*self._inbox, *pending.items()]:
                        on_event("done", "cancelled")
                    return
                inbox, self._inbox = list(self._inbox), collections.deque()
                cancel, self._cancel = self._cancel, []
            for r in cancel:
                self.scheduler.cancel(r)
                pending.pop(id(r), None)
            for r, on_event in inbox:
                try:
                    self.scheduler.submit(r)
                except VlmcError as exc:
                    on_event("error", str(exc))
                    continue
                pending[id(r)] = on_event
            if self.scheduler.busy:
                try:
                    finished = self.scheduler.step()
                except VlmcError as exc:  # the package refused a step: every running request ends
                    for r in self._running():
                        self.scheduler.cancel(r)
                        pending.pop(id(r))("error", str(exc))
                    continue
                for r in finished:
                    pending.pop(id(r))("done", r.finish_reason)

    def _running(self) -> list[Request]:
        sched = self.scheduler
        return [s.request for s in [*sched.running, *sched.prefilling, *sched.waiting]]

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=5)


def _image_source(url: str, image_root: Path | None, limits: Limits):
    """What an ``image_url`` names: decoded bytes of a data: URL, or a file under ``image_root``."""
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if not head.endswith(";base64"):
            raise BadRequest("an image data: URL must be base64 (data:image/png;base64,...)")
        if len(data) > limits.max_body_bytes:
            raise BadRequest("the image data is larger than the request bound")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("the image data: URL is not valid base64") from None
    rel = url[len("file://") :] if url.startswith("file://") else url
    if "://" in rel:
        raise BadRequest("image_url must be a data: URL or a file under the server's --image-root")
    if image_root is None:
        raise BadRequest(
            "local image files are off: start the server with --image-root DIR to allow files in DIR"
        )
    root = image_root.resolve()
    if rel.startswith(str(root) + "/"):
        rel = rel[len(str(root)) + 1 :]
    try:
        return str(paths.regular_file(root, rel, "image_url", "the request"))
    except VlmcError:
        raise BadRequest(
            f"image_url {rel[:200]!r} is not a regular file under the server's --image-root (symlinks out, "
            "'..' and absolute paths elsewhere are refused)"
        ) from None


def parse_messages(messages: Any, image_root: Path | None, limits: Limits) -> tuple[list[dict], list]:
    """OpenAI chat messages -> (the conversation in transformers' message format, image sources in order)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    if len(messages) > limits.max_messages:
        raise BadRequest(f"at most {limits.max_messages} messages per request")
    conversation, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}] must be an object with role system, user or assistant")
        content = m.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str):
                        raise BadRequest(f"messages[{i}].content[{j}].image_url needs a url")
                    images.append(_image_source(url, image_root, limits))
                    parts.append({"type": "image"})
                else:
                    raise BadRequest(f"messages[{i}].content[{j}] must be a text or image_url part")
        else:
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        conversation.append({"role": m["role"], "content": parts})
    if len(images) > limits.max_images:
        raise BadRequest(f"at most {limits.max_images} images per request")
    return conversation, images


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings")
    return stop


class _Stream:
    """One request's tokens, decoded incrementally, cut at a stop string."""

    def __init__(self, tokenizer, eos: set[int], stop: list[str]) -> None:
        self.tokenizer, self.eos, self.stop = tokenizer, eos, stop
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """The new text the token completes (held back while a character or a stop string is partial)."""
        if self.stopped or token in self.eos:
            return ""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                self.stopped = True
                text = text[:cut]
        hold = 0 if self.stopped else max([_partial(text, s) for s in self.stop] + [0])
        if not self.stopped and text.endswith("\ufffd"):
            return ""
        safe = text[: len(text) - hold]
        delta, self.sent = safe[len(self.sent) :], max(self.sent, safe, key=len)
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.tokens) if not self.stopped else self.sent
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta


def _partial(text: str, stop: str) -> int:
    """Characters at the end of ``text`` that could start ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def build_app(engine: Engine, model_name: str, image_root: Path | None = None):
    """The FastAPI application: /v1/models and /v1/chat/completions."""
    app = FastAPI(title="vlmc", docs_url=None, redoc_url=None, openapi_url=None)
    limits = engine.limits
    pipe = engine.scheduler.pipe
    created = int(time.time())

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        body = {"error": {"message": message[:1000], "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=status)

    @app.exception_handler(BadRequest)
    async def _bad(_, exc: BadRequest):
        return error(exc.status, str(exc), exc.kind)

    @app.exception_handler(VlmcError)
    async def _vlmc(_, exc: VlmcError):
        return error(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return error(400, f"invalid request: {exc.errors()[0].get('msg', 'bad value')}")

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        logger.exception("internal error")
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "vlmc"}],
        }

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        length = http.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            raise BadRequest(f"the request body is larger than {limits.max_body_bytes} bytes", 413)
        raw = b""
        async for chunk in http.stream():
            raw += chunk
            if len(raw) > limits.max_body_bytes:
                raise BadRequest(f"the request body is larger than {limits.max_body_bytes} bytes", 413)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        conversation, images = parse_messages(body.get("messages"), image_root, limits)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 256))
        if (
            not isinstance(max_tokens, int)
            or isinstance(max_tokens, bool)
            or not 1 <= max_tokens <= limits.max_tokens
        ):
            raise BadRequest(f"max_tokens must be an integer from 1 to {limits.max_tokens}")
        temperature = body.get("temperature", 1.0)
        if (
            not isinstance(temperature, (int, float))
            or isinstance(temperature, bool)
            or not 0 <= temperature <= 2
        ):
            raise BadRequest("temperature must be a number from 0 to 2")
        if body.get("n", 1) != 1:
            raise BadRequest("n must be 1")
        seed = body.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise BadRequest("seed must be a non-negative integer")
        stop = _stop_list(body.get("stop"))
        stream = bool(body.get("stream", False))
        request = Request(conversation, images, max_tokens, float(temperature), seed)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        engine.submit(
            request, lambda kind, value: loop.call_soon_threadsafe(events.put_nowait, (kind, value))
        )
        decoder = _Stream(pipe.tokenizer, engine.scheduler.eos, stop)
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        def chunk(delta: dict, finish: str | None) -> str:
            payload = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return f"data: {json.dumps(payload)}\n\n"

        async def next_event():
            return await events.get()

        if stream:
            # The first event says whether the request was admitted: an error is a 400, not a stream.
            first = await next_event()
            if first[0] == "error":
                raise BadRequest(first[1])

            async def body_stream():
                yield chunk({"role": "assistant", "content": ""}, None)
                kind, value = first
                try:
                    while True:
                        if kind == "token":
                            delta = decoder.add(value)
                            if decoder.stopped:
                                engine.cancel(request)
                                if delta:
                                    yield chunk({"content": delta}, None)
                                yield chunk({}, "stop")
                                break
                            if delta:
                                yield chunk({"content": delta}, None)
                        elif kind == "done":
                            tail = decoder.flush()
                            if tail:
                                yield chunk({"content": tail}, None)
                            yield chunk({}, "length" if value == "length" else "stop")
                            break
                        else:
                            yield chunk({}, "stop")
                            break
                        kind, value = await next_event()
                    yield "data: [DONE]\n\n"
                finally:
                    if not request.done:
                        engine.cancel(request)

            return StreamingResponse(body_stream(), media_type="text/event-stream")

        try:
            while True:
                kind, value = await next_event()
                if kind == "error":
                    raise BadRequest(value)
                if kind == "token":
                    decoder.add(value)
                    if decoder.stopped:
                        engine.cancel(request)
                        finish = "stop"
                        break
                if kind == "done":
                    decoder.flush()
                    finish = "length" if value == "length" else "stop"
                    break
        finally:
            if not request.done and not decoder.stopped:
                engine.cancel(request)
        completion = len([t for t in decoder.tokens if t not in engine.scheduler.eos])
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": decoder.sent},
                    "finish_reason": finish,
                }
            ],
            "usage": {
                "prompt_tokens": request.prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": request.prompt_tokens + completion,
            },
            # vlmc's own: the generated token ids, and the prompt tokens served from the prefix cache
            "vlmc": {"tokens": list(request.tokens), "cached_tokens": request.cached_tokens},
        }

    return app


def serve(
    pipeline, host: str, port: int, model_name: str, limits: Limits, image_root: Path | None, **sched
) -> None:
    """Run the server until SIGINT/SIGTERM (in-flight requests are cancelled within a second)."""
    import socket

    import uvicorn

    engine = Engine(Scheduler(pipeline, **sched), limits)
    app = build_app(engine, model_name, image_root)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise VlmcError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)  # before the address is printed: a client that reads it may connect at once
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, lifespan="off")
    server = uvicorn.Server(config)
    print(f"serving {model_name} on http://{host}:{bound}/v1", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
