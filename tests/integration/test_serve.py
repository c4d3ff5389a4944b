"""`vlmc serve` with the real `openai` client on localhost: concurrent requests (one streamed, one with an
image, one malformed) each equal to the same request run alone; bounds; shutdown on a signal."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vlmc import manager
from vlmc.package import Package
from vlmc.recipe import Step
from vlmc.runtime import Pipeline, preprocess

openai = pytest.importorskip("openai")
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def paged_llava(exported, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "paged"
    manager.run(Package.load(exported("tiny-llava")), [Step("paged_kv", {"block_size": 16}, 1)]).save(out)
    return out


@pytest.fixture(scope="module")
def server(paged_llava, tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    _png(preprocess.demo_image(seed=4), root / "four.png")
    proc = subprocess.Popen(
        [
            str(BIN / "vlmc"),
            "serve",
            str(paged_llava),
            "--port",
            "0",
            "--image-root",
            str(root),
            "--max-batch",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert "serving" in line, proc.stderr.read()
    url = line.split(" on ")[1].strip()
    yield url, root, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)


def _png(img: np.ndarray, path: Path | None = None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    if path is not None:
        path.write_bytes(buf.getvalue())
    return buf.getvalue()


def _alone(pkg_dir: Path, prompt: str, images: list, n: int):
    pipe = Pipeline(Package.load(pkg_dir))
    try:
        res = pipe.generate([prompt], [images], n)
        return res.tokens[0], res.texts[0]
    finally:
        pipe.close()


def test_concurrent_requests_through_the_openai_client(server, paged_llava):
    url, root, _ = server
    client = openai.OpenAI(base_url=url, api_key="not-needed", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-llava"]
    image = preprocess.demo_image(seed=2)
    data_url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    results: dict[str, object] = {}

    def plain():
        results["plain"] = client.chat.completions.create(
            model="tiny-llava",
            messages=[{"role": "user", "content": "Hi there"}],
            max_tokens=9,
            temperature=0,
        )

    def with_image():
        results["image"] = client.chat.completions.create(
            model="tiny-llava",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url}},
                        {"type": "text", "text": "Describe the image."},
                    ],
                }
            ],
            max_tokens=7,
            temperature=0,
        )

    def streamed():
        chunks = client.chat.completions.create(
            model="tiny-llava",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": str(root / "four.png")}},
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        parts, finish = [], None
        for c in chunks:
            parts.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
        results["stream"] = ("".join(parts), finish)

    def malformed():
        try:
            client.chat.completions.create(model="tiny-llava", messages=[{"role": "robot", "content": 3}])
        except openai.BadRequestError as exc:
            results["bad"] = exc

    threads = [threading.Thread(target=f) for f in (plain, with_image, streamed, malformed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    tokens, text = _alone(paged_llava, "Hi there", [], 9)
    assert results["plain"].model_extra["vlmc"]["tokens"] == tokens
    assert results["plain"].choices[0].message.content == text
    tokens, text = _alone(paged_llava, "Describe the image.", [image], 7)
    assert results["image"].model_extra["vlmc"]["tokens"] == tokens
    _, text = _alone(paged_llava, "What is this?", [str(root / "four.png")], 8)
    assert results["stream"][0] == text and results["stream"][1] in ("stop", "length")
    bad = results["bad"]
    assert bad.status_code == 400 and "messages[0]" in bad.body["message"]
    # The command a user runs gives the same tokens for the same request alone.
    run = subprocess.run(
        [
            str(BIN / "vlmc"),
            "run",
            str(paged_llava),
            "--prompt",
            "Hi there",
            "--max-new-tokens",
            "9",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(run.stdout)["tokens"][0] == results["plain"].model_extra["vlmc"]["tokens"]


@pytest.mark.parametrize(
    "body, status, says",
    [
        (b"not json", 400, "not JSON"),
        (json.dumps({"messages": []}).encode(), 400, "non-empty list"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(),
            400,
            "max_tokens",
        ),
        (
            json.dumps(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}],
                        }
                    ]
                }
            ).encode(),
            400,
            "not a regular file under the server's --image-root",
        ),
        (
            json.dumps(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                        }
                    ]
                }
            ).encode(),
            400,
            "data: URL",
        ),
        (
            json.dumps(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                            ],
                        }
                    ]
                }
            ).encode(),
            400,
            "not a readable image",
        ),
    ],
)
def test_bad_requests_get_a_4xx_json_error(server, body, status, says):
    import urllib.error
    import urllib.request

    url, _, _ = server
    req = urllib.request.Request(
        url + "/chat/completions", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == status
    err = json.loads(info.value.read())["error"]
    assert says in err["message"] and "Traceback" not in err["message"]


def test_a_body_past_the_bound_is_refused_before_it_is_read(server):
    import http.client
    import urllib.parse

    url, _, _ = server
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.putrequest("POST", parts.path + "/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(33 * 1024 * 1024))
    conn.endheaders()  # no body is sent: the server answers from the header
    resp = conn.getresponse()
    assert resp.status == 413 and "larger than" in json.loads(resp.read())["error"]["message"]


def test_sigterm_stops_the_server_within_seconds_during_a_stream(paged_llava):
    proc = subprocess.Popen(
        [str(BIN / "vlmc"), "serve", str(paged_llava), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = proc.stdout.readline().split(" on ")[1].strip()
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=480,
        temperature=0,
        stream=True,
    )
    next(iter(stream))  # the request is running
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=15)
    assert time.monotonic() - t0 < 5
    assert "Traceback" not in proc.stderr.read()
    assert os.path.exists(paged_llava / "vlmc.json")
