"""The request scheduler: continuous batching over one paged pool is token-exact against each request run
alone, on every KV-relevant family shape; pool limits, arrival order, and prefix/image reuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmc import manager
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.recipe import Step
from vlmc.runtime import Pipeline
from vlmc.runtime.paged import NULL_BLOCK
from vlmc.runtime.scheduler import Request, Scheduler, block_keys

BLOCK = 16
REQUESTS = [
    ("Describe the image.", ["demo:1"], 6),
    ("Hi", [], 9),
    ("Tell me everything about this picture, in great detail please.", ["demo:2"], 4),
    ("What is shown here, and what colours does it have?", ["demo:3"], 7),
    ("Count to ten.", [], 5),
]


def _paged(path: Path, tmp: Path, *steps: Step) -> Package:
    pkg = manager.run(Package.load(path), [*steps, Step("paged_kv", {"block_size": BLOCK}, len(steps) + 1)])
    return Package.load(pkg.save(tmp / "paged"))


def _alone(pkg: Package, prompt: str, images: list, max_new: int) -> list[int]:
    pipe = Pipeline(pkg)
    try:
        return pipe.generate([prompt], [images], max_new).tokens[0]
    finally:
        pipe.close()


@pytest.mark.parametrize("builtin", ["tiny-llava", "tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-gemma3"])
def test_batched_requests_equal_each_request_alone(builtin, exported, tmp_path):
    pkg = _paged(exported(builtin), tmp_path)
    expected = [_alone(pkg, p, im, n) for p, im, n in REQUESTS]
    pipe = Pipeline(pkg)
    sched = Scheduler(pipe, max_batch=3, num_blocks=64)
    # Two now, the rest while those decode: requests join a running batch and leave it at different steps.
    reqs = [Request(p, im, n) for p, im, n in REQUESTS]
    for r in reqs[:2]:
        sched.submit(r)
    sched.step()
    sched.step()
    for r in reqs[2:]:
        sched.submit(r)
    widths = []
    while sched.busy:
        sched.step()
        widths.append(len(sched.running))
    assert [r.tokens for r in reqs] == expected
    assert max(widths) == 3 and all(r.finish_reason in ("stop", "length") for r in reqs)
    # Fewer decoder runs than one-at-a-time would take: decode steps were shared.
    assert sched.steps < sum(len(t) - 1 for t in expected)
    # Every block a sequence held is back; the rest are the prefix cache's.
    cached = set(sched.prefix.blocks.values())
    assert NULL_BLOCK not in cached
    assert sched.allocator.num_free + len(cached) == sched.allocator.num_blocks - 1
    assert all(sched.allocator.holders(b) == 1 for b in cached)
    pipe.close()


@pytest.mark.parametrize(
    "builtin", ["tiny-llava", "tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-gemma3", "tiny-llava+merge"]
)
def test_prompts_admitted_while_others_decode_are_prefilled_in_chunks(builtin, exported, tmp_path):
    """Requests that arrive while a sequence decodes are prefilled one block per step: the running
    sequence gets a token every step meanwhile, and every request's tokens equal it run alone (a merged
    package's prompts with images go whole, its text-only ones in chunks)."""
    name, _, merge = builtin.partition("+")
    pkg = _paged(exported(name), tmp_path, *([Step("merge", {}, 1)] if merge else []))
    expected = [_alone(pkg, p, im, n) for p, im, n in REQUESTS]
    pipe = Pipeline(pkg)
    sched = Scheduler(pipe, max_batch=4, num_blocks=64, prefill_chunk=BLOCK)
    reqs = [Request(p, im, n) for p, im, n in REQUESTS]
    # The one that decodes throughout: the longest answer, submitted first and alone.
    first = max(range(len(reqs)), key=lambda i: reqs[i].max_new_tokens)
    sched.submit(reqs[first])
    sched.step()
    for r in reqs[:first] + reqs[first + 1 :]:
        sched.submit(r)
    chunked_steps = 0
    while sched.busy:
        before, computed = len(reqs[first].tokens), sched.stats["prefill_tokens"]
        decoding = bool(sched.running)
        sched.step()
        if before and not reqs[first].done:
            assert len(reqs[first].tokens) == before + 1  # never stalled by the prompts being prefilled
        if decoding and sched.stats["prefill_tokens"] > computed:
            chunked_steps += 1
            # while a sequence decodes, a step prefills one chunk: a block (an image's whole run where
            # its tokens attend both ways; a merged graph's prompt with images whole)
            assert sched.stats["prefill_tokens"] - computed <= BLOCK or sched.whole_images or merge
    assert not sched.prefilling and not sched.running
    assert [r.tokens for r in reqs] == expected
    assert chunked_steps > len(reqs) - 1  # the later prompts took several steps each
    assert sched.stats["prefills"] == len(reqs) < sched.stats["prefill_runs"]
    pipe.close()


def test_a_chunk_never_cuts_an_image_whose_tokens_attend_both_ways(exported, tmp_path):
    pkg = _paged(exported("tiny-gemma3"), tmp_path)
    sched = Scheduler(Pipeline(pkg), max_batch=2, num_blocks=64, prefill_chunk=BLOCK)
    assert sched.whole_images
    image = sched.image_id
    sched.submit(Request("Describe the image in detail.", ["demo:1"], 4))
    seq = sched.waiting[0]
    seq.start = (None, "embeds", None, {})  # as _begin leaves it for a decoder (not merged) prefill

    def cuts(ids):
        seq.prompt, seq.done, out = ids, 0, []
        while seq.done < len(ids):
            seq.done = sched._chunk_end(seq, BLOCK)
            out.append(seq.done)
        return out

    # Block boundaries 16, 32 and 48 fall inside the image run [10, 50): the chunk goes past it;
    # [20, 60) starts after the boundary at 16, which stays.
    assert cuts([1] * 10 + [image] * 40 + [2] * 20) == [64, 70]
    assert cuts([1] * 20 + [image] * 40 + [2] * 20) == [16, 64, 80]
    assert cuts([1] * 40 + [image] * 8 + [2] * 20) == [16, 32, 48, 64, 68]  # a run between boundaries
    ids = seq.inputs.input_ids[0].tolist()
    real = cuts(ids)
    assert real[-1] == len(ids) and all(c % BLOCK == 0 for c in real[:-1])
    assert not any(ids[c - 1] == image == ids[c] for c in real[:-1])
    # a causal decoder (no image_tokens input) may cut anywhere on a block boundary
    assert not Scheduler(Pipeline(_paged(exported("tiny-llava"), tmp_path / "l")), num_blocks=8).whole_images


def test_merged_package_batches_too(exported, tmp_path):
    pkg = _paged(exported("tiny-llava"), tmp_path, Step("merge", {}, 1))
    assert pkg.manifest["pipeline"].get("vlm")
    expected = [_alone(pkg, p, im, n) for p, im, n in REQUESTS]
    sched = Scheduler(Pipeline(pkg), max_batch=4, num_blocks=64)
    assert [r.tokens for r in sched.run([Request(p, im, n) for p, im, n in REQUESTS])] == expected


def test_a_full_pool_makes_requests_wait_and_an_impossible_one_is_refused(exported, tmp_path):
    pkg = _paged(exported("tiny-llava"), tmp_path)
    # 10 usable blocks of 16: each request below reserves 6 (prompt ~80 tokens + 8 new), so one at a time.
    sched = Scheduler(Pipeline(pkg), max_batch=4, num_blocks=11, prefix_cache=False)
    reqs = [Request("Describe the image.", ["demo:1"], 8), Request("Describe the image.", ["demo:2"], 8)]
    for r in reqs:
        sched.submit(r)
    sched.step()
    assert len(sched.running) == 1 and len(sched.waiting) == 1
    while sched.busy:
        sched.step()
    assert [r.tokens for r in reqs] == [_alone(pkg, r.prompt, r.images, 8) for r in reqs]
    with pytest.raises(VlmcError, match=r"needs \d+ KV blocks .* but the pool has 10"):
        sched.submit(Request("Describe the image.", ["demo:1"], 400))


@pytest.mark.parametrize("builtin", ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-gemma3", "tiny-llava-next"])
def test_second_turn_reuses_the_prefix_and_the_image(builtin, exported, tmp_path):
    pkg = _paged(exported(builtin), tmp_path)
    pipe = Pipeline(pkg)
    sched = Scheduler(pipe, max_batch=2, num_blocks=128)
    first = pkg.manifest["text"].get("image_marker", "<image>") + "Describe the image in detail, please."
    (turn1,) = sched.run([Request(first, ["demo:1"], 6)])
    answer = pipe.tokenizer.decode(turn1.tokens)
    second = first + answer + " And what else is there?"
    (turn2,) = sched.run([Request(second, ["demo:1"], 6)])
    assert turn2.cached_tokens >= BLOCK and sched.images.hits == 1
    assert turn2.tokens == _alone(pkg, second, ["demo:1"], 6)
    # A different image under the same text shares nothing past the text before it.
    (other,) = sched.run([Request(second, ["demo:2"], 6)])
    assert other.cached_tokens < turn2.cached_tokens
    assert other.tokens == _alone(pkg, second, ["demo:2"], 6)
    pipe.close()


def test_block_keys_depend_on_the_prefix_and_the_images():
    image = 9
    ids = [1, 2, 3, 4, image, image, image, image, 5, 6, 7, 8]
    keys = block_keys(ids, image, ["img-a"], 4)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(ids, image, ["img-b"], 4)[0] == keys[0]  # block 0 holds no image
    assert block_keys(ids, image, ["img-b"], 4)[1:] != keys[1:]  # the image and all after it differ
    assert block_keys([0, *ids[1:]], image, ["img-a"], 4)[1] != keys[1]  # a block's key covers its prefix
    assert len(block_keys(ids[:11], image, ["img-a"], 4)) == 2  # only whole blocks


def test_sampling_is_seeded_and_greedy_at_zero(exported, tmp_path):
    pkg = _paged(exported("tiny-llava"), tmp_path)
    sched = Scheduler(Pipeline(pkg), max_batch=2, num_blocks=64)
    a, b, greedy = sched.run(
        [
            Request("Hi", [], 8, temperature=1.5, seed=3),
            Request("Hi", [], 8, temperature=1.5, seed=3),
            Request("Hi", [], 8),
        ]
    )
    assert a.tokens == b.tokens and greedy.tokens == _alone(pkg, "Hi", [], 8)
    (c,) = sched.run([Request("Hi", [], 8, temperature=1.5, seed=4)])
    assert c.tokens != a.tokens  # another seed draws other tokens


def test_a_contiguous_package_is_refused_in_one_line(exported):
    with pytest.raises(VlmcError, match="needs a paged package"):
        Scheduler(Pipeline(Package.load(exported("tiny-llava"))))


def test_a_reference_build_serves_batches_on_its_gears(exported, tmp_path):
    from vlmc.backends import ascend
    from vlmc.runtime.executors import build as runner

    pkg = _paged(exported("tiny-llava"), tmp_path)
    target = {"soc": "Ascend910B2", "sequence_buckets": [64, 256], "batch_sizes": [1, 2, 4]}
    ascend.compile(pkg, tmp_path / "build", target)
    run_pkg, executor = runner.open_build(tmp_path / "build", "reference")
    assert executor.largest("decoder", "batch") == 4
    pipe = Pipeline(run_pkg, executor=executor)
    expected = [pipe.generate([p], [im], n).tokens[0] for p, im, n in REQUESTS]
    sched = Scheduler(pipe, max_batch=4)
    assert sched.allocator.num_blocks == run_pkg.manifest["kv"]["num_blocks"]
    assert [r.tokens for r in sched.run([Request(p, im, n) for p, im, n in REQUESTS])] == expected
    assert sched.steps < sum(len(t) - 1 for t in expected)
    # Prompts that arrive while one decodes are prefilled a block per step on the build too.
    sched = Scheduler(pipe, max_batch=4, prefix_cache=False, prefill_chunk=BLOCK)
    reqs = [Request(p, im, n) for p, im, n in REQUESTS]
    sched.submit(reqs[1])
    sched.step()
    for r in [reqs[0], *reqs[2:]]:
        sched.submit(r)
    while sched.busy:
        sched.step()
    assert [r.tokens for r in reqs] == expected
    assert sched.stats["prefill_runs"] > sched.stats["prefills"]


def test_vlmc_run_chat_reuses_the_history_and_answers_as_without_reuse(exported, tmp_path):
    import subprocess
    import sys

    pkg = _paged(exported("tiny-llava"), tmp_path)
    run = subprocess.run(
        [str(Path(sys.executable).parent / "vlmc"), "run", str(pkg.root), "--chat", "--max-new-tokens", "6"],
        input="/image demo:1\nDescribe the image.\nAnd then?\n/quit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    stats = [ln for ln in run.stderr.splitlines() if "prompt tokens reused" in ln]
    assert (
        len(stats) == 2
        and stats[0].startswith("6 tokens; 0 of")
        and not stats[1].split("; ")[1].startswith("0 ")
    )
    # In process: the second turn's tokens equal the whole conversation recomputed without any reuse.
    from vlmc.runtime.conversation import Conversation

    conv = Conversation(Pipeline(pkg), 6)
    t1 = conv.ask("Describe the image.", ["demo:1"])
    t2 = conv.ask("And then?")
    assert t1.cached_tokens == 0 and t2.cached_tokens >= BLOCK
    history = [
        _user("Describe the image.", 1),
        {"role": "assistant", "content": [{"type": "text", "text": t1.text}]},
    ]
    plain = Pipeline(pkg).generate([[*history, _user("And then?", 0)]], [["demo:1"]], 6)
    assert t2.tokens == plain.tokens[0]
    conv.close()


def _user(text: str, images: int) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}
