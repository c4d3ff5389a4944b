"""`--executor acl` under a strict pyACL stand-in (tests/_pyacl_standin.py): the stand-in's own rules,
each planted and caught, and every build kind run through AclDevice with the reference executor's tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _pyacl_standin as standin
import numpy as np
import pytest
from click.testing import CliRunner

from vlmc import pass_api, tensor_names
from vlmc.backends import ascend
from vlmc.cli import main
from vlmc.errors import VlmcError
from vlmc.package import Package
from vlmc.runtime import Pipeline
from vlmc.runtime.executors import acl as acl_device
from vlmc.runtime.executors import build as runner

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_host_loop  # noqa: E402  (the 32-layer config is the benchmark's)

PROMPTS = ["Describe the image."]
IMAGES = [["demo"]]
SOC = "Ascend910B2"
BLOCK = 16


@pytest.fixture
def acl(monkeypatch):
    state = standin.install(monkeypatch)
    import acl as module

    return module, state


@pytest.fixture(scope="module")
def llava_build(exported, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("acl_build")
    pkg = Package.load(exported("tiny-llava"))
    ascend.compile(pkg, tmp / "build", {"soc": SOC, "sequence_buckets": [64, 256]})
    standin.placeholder_oms(tmp / "build")
    return tmp / "build"


def _opened(acl, root, name):
    """A desc, model id and the build's spec, loaded by hand (as AclDevice does)."""
    summary = json.loads((root / "compile.json").read_text())
    entry = next(b for b in summary["builds"] if b["name"] == name)
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    ctx, ret = acl.rt.create_context(0)
    model, ret = acl.mdl.load_from_file(str(root / entry["om"]))
    assert ret == 0
    desc = acl.mdl.create_desc()
    assert acl.mdl.get_desc(desc, model) == 0
    return ctx, model, desc, runner.BuildSpec(entry)


# ---- the stand-in's rules, each planted ------------------------------------------------------------
def test_calls_before_init_and_context_are_refused(acl):
    module, state = acl
    assert module.rt.malloc(16, 0) == (0, standin.ACL_ERROR_UNINITIALIZE)
    assert module.init() == 0 and module.init() == standin.ACL_ERROR_REPEAT_INITIALIZE
    assert module.rt.malloc(16, 0) == (0, standin.ACL_ERROR_RT_CONTEXT_NULL)  # no set_device/context yet
    assert module.rt.create_context(0)[1] == standin.ACL_ERROR_RT_PARAM_INVALID  # before set_device
    assert len(state.violations) == 3


def test_double_frees_and_leaks_at_finalize_are_refused(acl):
    module, state = acl
    module.init(), module.rt.set_device(0)
    ctx, _ = module.rt.create_context(0)
    ptr, ret = module.rt.malloc(64, 0)
    assert ret == 0 and module.rt.malloc(0, 0)[1] == standin.ACL_ERROR_INVALID_PARAM
    buf = module.create_data_buffer(ptr, 64)
    ds = module.mdl.create_dataset()
    assert module.mdl.add_dataset_buffer(ds, buf) == (ds, 0)
    assert module.destroy_data_buffer(buf) == 0 and module.destroy_data_buffer(buf) != 0
    assert module.mdl.destroy_dataset(ds) == 0 and module.mdl.destroy_dataset(ds) != 0
    assert module.rt.free(ptr) == 0 and module.rt.free(ptr) != 0
    assert [v for v in state.violations if "twice" in v] and len(state.violations) == 4
    leaked, _ = module.rt.malloc(8, 0)
    assert module.rt.destroy_context(ctx) != 0  # memory still alive in the context
    assert module.finalize() != 0 and "resources alive" in state.violations[-1]
    assert "device allocations" in state.violations[-1]


def test_memcpy_bounds_and_host_pointers(acl):
    module, state = acl
    module.init(), module.rt.set_device(0), module.rt.create_context(0)
    ptr, _ = module.rt.malloc(8, 0)
    host = np.arange(4, dtype=np.float32)
    assert module.rt.memcpy(ptr, 8, module.util.numpy_to_ptr(host), 16, 1) != 0  # count > dest_max
    assert module.rt.memcpy(ptr, 8, module.util.numpy_to_ptr(host[:2].copy()), 8, 1) == 0
    back = np.zeros(2, np.float32)
    assert module.rt.memcpy(module.util.numpy_to_ptr(back), 8, ptr, 8, 2) == 0
    assert back.tolist() == [0.0, 1.0]
    assert module.rt.memcpy(ptr, 8, 12345, 8, 1) != 0  # a host address nobody registered
    assert len(state.violations) == 2


def test_short_buffers_a_missing_gear_buffer_and_wrong_dims_are_refused(acl, llava_build):
    module, state = acl
    ctx, model, desc, spec = _opened(module, llava_build, "embed_tokens")
    assert spec.gears  # sequence gears: the model has an ascend_mbatch_shape_data input
    n = module.mdl.get_num_inputs(desc)
    index, ret = module.mdl.get_input_index_by_name(desc, standin.DYNAMIC_INPUT)
    assert ret == 0 and index == n - 1
    sizes = [module.mdl.get_input_size_by_index(desc, i) for i in range(n)]
    ptrs = [module.rt.malloc(s, 0)[0] for s in sizes]
    out_size = module.mdl.get_output_size_by_index(desc, 0)
    out_ptr, _ = module.rt.malloc(out_size, 0)
    outs = module.mdl.create_dataset()
    module.mdl.add_dataset_buffer(outs, module.create_data_buffer(out_ptr, out_size))
    # Without the gear buffer: refused by execute (and set_input_dynamic_dims has nowhere to write).
    ins = module.mdl.create_dataset()
    module.mdl.add_dataset_buffer(ins, module.create_data_buffer(ptrs[0], sizes[0]))
    gear = spec.gears[0]
    dims = runner.dims_vector(spec.input_shape, gear)
    assert (
        module.mdl.set_input_dynamic_dims(
            model, ins, index, {"dimCount": len(dims), "name": "", "dims": dims}
        )
        != 0
    )
    assert module.mdl.execute(model, ins, outs) == standin.ACL_ERROR_MODEL_INPUT_NOT_MATCH
    assert "no ascend_mbatch_shape_data buffer" in state.violations[-1]
    # With it: a vector that is no gear, one over ACL_MAX_DIM_CNT, then the right one.
    module.mdl.add_dataset_buffer(ins, module.create_data_buffer(ptrs[1], sizes[1]))
    bad = [d + 1 for d in dims]
    assert (
        module.mdl.set_input_dynamic_dims(model, ins, index, {"dimCount": len(bad), "name": "", "dims": bad})
        != 0
    )
    long = [1] * 129
    assert module.mdl.set_input_dynamic_dims(
        model, ins, index, {"dimCount": 129, "name": "", "dims": long}
    ) == (standin.ACL_ERROR_STORAGE_OVER_LIMIT)
    assert "ACL_MAX_DIM_CNT" in state.violations[-1]
    assert (
        module.mdl.set_input_dynamic_dims(
            model, ins, index, {"dimCount": len(dims), "name": "", "dims": dims}
        )
        == 0
    )
    assert module.mdl.execute(model, ins, outs) == 0
    cur, ret = module.mdl.get_cur_output_dims(desc, 0)
    assert ret == 0 and cur["dims"][:2] == [1, gear[-1]]
    # A buffer smaller than the executed gear's bytes (the largest gear needs all of sizes[0]).
    big = runner.dims_vector(spec.input_shape, spec.gears[-1])
    small, _ = module.rt.malloc(sizes[0] // 2, 0)
    ins2 = module.mdl.create_dataset()
    module.mdl.add_dataset_buffer(ins2, module.create_data_buffer(small, sizes[0] // 2))
    module.mdl.add_dataset_buffer(ins2, module.create_data_buffer(ptrs[1], sizes[1]))
    assert (
        module.mdl.set_input_dynamic_dims(model, ins2, index, {"dimCount": len(big), "name": "", "dims": big})
        == 0
    )
    assert module.mdl.execute(model, ins2, outs) != 0 and "the gear needs" in state.violations[-1]


def test_the_standin_runs_the_build_graph_over_device_memory(acl, llava_build):
    # A feed copied in, executed, copied out: the same numbers as the reference device on the same graph.
    module, state = acl
    with acl_device.AclDevice(0) as device:
        spec = runner.BuildSpec(
            next(
                b
                for b in json.loads((llava_build / "compile.json").read_text())["builds"]
                if b["name"] == "embed_tokens"
            )
        )
        device.load(spec, llava_build)
        ids = np.arange(64, dtype=np.int64).reshape(1, 64) % 50
        dims = [1, 64]
        assert dims in spec.allowed_dims()
        got = device.execute(spec, {"input_ids": ids}, dims)["inputs_embeds"]
        ref = runner.ReferenceDevice()
        ref.load(spec, llava_build)
        want = ref.execute(spec, {"input_ids": ids}, dims)["inputs_embeds"]
        np.testing.assert_array_equal(got, want)
    assert state.violations == [] and state.finalized == 1
    assert not any(state.live().values())


def test_unchanged_inputs_are_not_copied_again_and_changed_ones_are(acl, llava_build):
    # AclDevice skips the host-to-device copy of an input whose bytes its buffer already holds, and the
    # gear of a dataset that already holds it; every change must still reach the device.
    module, state = acl
    entry = next(
        b
        for b in json.loads((llava_build / "compile.json").read_text())["builds"]
        if b["name"] == "embed_tokens"
    )
    spec = runner.BuildSpec(entry)
    ref = runner.ReferenceDevice()
    ref.load(spec, llava_build)

    def run(device, ids):
        dims = spec.dims([ids.shape[1]])
        copies, gears = (
            state.copies.get("host->device", 0),
            state.calls.get("acl.mdl.set_input_dynamic_dims", 0),
        )
        got = device.execute(spec, {"input_ids": ids}, dims)["inputs_embeds"]
        np.testing.assert_array_equal(got, ref.execute(spec, {"input_ids": ids}, dims)["inputs_embeds"])
        return (
            state.copies.get("host->device", 0) - copies,
            state.calls.get("acl.mdl.set_input_dynamic_dims", 0) - gears,
            got,
        )

    with acl_device.AclDevice(0) as device:
        device.load(spec, llava_build)
        a, b = np.array([[3]], np.int64), np.array([[7]], np.int64)
        assert run(device, a)[:2] == (1, 1)  # the first execution copies and sets the gear
        assert run(device, a)[:2] == (0, 0)  # the same bytes and gear: nothing to copy
        copied, gears, got_b = run(device, b)
        assert (copied, gears) == (1, 0)  # a changed token is copied (and the embedding follows it)
        assert not np.array_equal(got_b, run(device, a)[2])  # back to a: copied again, a's embedding
        long = np.arange(64, dtype=np.int64).reshape(1, 64) % 50
        assert run(device, long)[:2] == (1, 1)  # another gear is set, its input copied
        assert run(device, a)[:2] == (1, 1)  # and back: gear [1] set again over the 64 one
    assert state.violations == [] and not any(state.live().values())


# ---- AclDevice: owned resources, released on every path ---------------------------------------------
def _generate(root, prompts=PROMPTS, images=IMAGES, tokens=5):
    pkg, executor = runner.open_build(root, "acl")
    with executor:
        return Pipeline(pkg, executor=executor).generate(prompts, images, tokens), executor


def test_acl_run_matches_reference_and_releases_everything(acl, llava_build):
    module, state = acl
    got, executor = _generate(llava_build)
    pkg, ref_exec = runner.open_build(llava_build, "reference")
    want = Pipeline(pkg, executor=ref_exec).generate(PROMPTS, IMAGES, 5)
    assert got.tokens == want.tokens
    assert state.violations == [] and state.finalized == 1 and not any(state.live().values())
    # Buffers and datasets are made once per build, not per step.
    builds = len(executor.runs)
    assert state.calls["acl.mdl.create_dataset"] == 2 * builds
    assert (
        state.calls["acl.mdl.execute"] == sum(executor.runs.values()) > state.calls["acl.mdl.create_dataset"]
    )


def test_a_bad_request_is_refused_before_the_device_opens(acl, llava_build):
    # Two images and three prompts fail in cli._distribute, which runs before vlmc.runtime's Target
    # opens the device session: nothing is initialized, so nothing is left to release.
    module, state = acl
    args = ["run", str(llava_build), "--executor", "acl", "--image", "demo", "--image", "demo"]
    out = CliRunner().invoke(main, [*args, "--prompt", "a", "--prompt", "b", "--prompt", "c"])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert state.calls.get("acl.init") is None and not any(state.live().values())


def test_an_interrupt_mid_generation_releases_everything(acl, llava_build, monkeypatch):
    module, state = acl
    real = module.mdl.execute
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(module.mdl, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _generate(llava_build)
    assert state.finalized == 1 and not any(state.live().values()) and state.violations == []


def test_a_device_error_mid_run_through_the_cli_reaches_finalize(acl, llava_build, monkeypatch):
    # `vlmc run BUILD --executor acl` (the error path is the CLI's): the device fails a step after
    # the session opened (acl.init, builds loaded, buffers made). The CLI says so in one line, and every
    # resource is released, acl.finalize included.
    module, state = acl
    real = module.mdl.execute
    calls = []

    def failing(*args):
        calls.append(1)
        return standin.ACL_ERROR_RT_MEMORY_ALLOCATION if len(calls) == 3 else real(*args)

    monkeypatch.setattr(module.mdl, "execute", failing)
    args = ["run", str(llava_build), "--executor", "acl", "--image", "demo", "--prompt", PROMPTS[0]]
    out = CliRunner().invoke(main, [*args, "--max-new-tokens", "4"])
    assert out.exit_code == VlmcError.exit_code and "Traceback" not in out.output, out.output
    last = out.output.strip().splitlines()[-1]
    assert (
        last.startswith("vlmc: error:")
        and f"failed with error {standin.ACL_ERROR_RT_MEMORY_ALLOCATION}" in last
    )
    assert len(calls) == 3 and state.calls["acl.init"] == 1
    assert state.finalized == 1 and not any(state.live().values()) and state.violations == []


def test_a_failed_open_releases_what_it_made(acl, llava_build, monkeypatch):
    module, state = acl
    monkeypatch.setattr(module.rt, "create_context", lambda device: (0, standin.ACL_ERROR_RT_PARAM_INVALID))
    with pytest.raises(VlmcError, match="acl.rt.create_context failed with error 107000"):
        runner.open_build(llava_build, "acl")
    assert state.finalized == 1 and not any(state.live().values())


# ---- every build kind under --executor acl ---------------------------------------------------------
def _build(exported, tmp_path, name: str, layout: str, target: dict):
    pkg = Package.load(exported(name))
    if layout == "paged":
        pass_api.get("paged_kv")(block_size=BLOCK).run(pkg)
        pkg.save(tmp_path / "paged")
        pkg = Package.load(tmp_path / "paged")
    ascend.compile(pkg, tmp_path / "build", {"soc": SOC, **target})
    standin.placeholder_oms(tmp_path / "build")
    return pkg, tmp_path / "build"


def _same_tokens_no_leak(state, root, prompts, images, tokens):
    pkg, ref_exec = runner.open_build(root, "reference")
    want = Pipeline(pkg, executor=ref_exec).generate(prompts, images, tokens)
    got, executor = _generate(root, prompts, images, tokens)
    assert got.tokens == want.tokens and len(got.tokens[0]) == tokens
    assert state.violations == [] and state.finalized == 1 and not any(state.live().values())
    assert 0 < state.max_dim_count <= standin.ACL_MAX_DIM_CNT
    return executor


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_default_gears(acl, exported, tmp_path, layout):
    _, state = acl
    _, root = _build(exported, tmp_path, "tiny-llava", layout, {"sequence_buckets": [64, 256]})
    executor = _same_tokens_no_leak(state, root, PROMPTS, IMAGES, 5)
    assert set(executor.runs) >= {"decoder_prefill", "decoder_decode"}


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_batch_and_image_gears(acl, exported, tmp_path, layout):
    _, state = acl
    target = {"sequence_buckets": [64, 256], "batch_sizes": [1, 4], "images": [1, 2]}
    _, root = _build(exported, tmp_path, "tiny-llava", layout, target)
    prompts = ["Describe the image.", "What is it? Answer in a few words please.", "Hi"]
    _same_tokens_no_leak(state, root, prompts, [["demo"], ["demo:1"], []], 4)


# ---- a 32-layer decoder: the dims vector stays within ACL_MAX_DIM_CNT --------------------------------
DEEP = 32


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """tiny-llava's architecture with a narrow 32-layer text model (widths 16), exported once."""
    return bench_host_loop.deep_llava(tmp_path_factory.mktemp("deep") / "pkg", DEEP)


def _deep_build(deep, tmp_path, layout, **target):
    pkg = Package.load(deep)
    if layout == "paged":
        pass_api.get("paged_kv")(block_size=BLOCK).run(pkg)
        pkg.save(tmp_path / "paged")
        pkg = Package.load(tmp_path / "paged")
    summary = ascend.compile(pkg, tmp_path / "build", {"soc": SOC, "sequence_buckets": [64, 256], **target})
    standin.placeholder_oms(tmp_path / "build")
    return summary, tmp_path / "build"


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_32_layer_decoder_runs_with_a_short_dims_vector(acl, deep, tmp_path, layout, monkeypatch):
    _, state = acl
    stored = {"write_stack": 0, "write_layer": 0}  # how the loop hands a step's rows to the device pools
    for method in stored:
        real = getattr(acl_device.DevicePool, method)

        def counted(self, *args, _real=real, _name=method):
            stored[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(acl_device.DevicePool, method, counted)
    summary, root = _deep_build(deep, tmp_path, layout, batch_sizes=[1, 2])
    decoder = [b for b in summary["builds"] if b["graph"] == "decoder"]
    assert all(b["gears"] for b in decoder)  # batch (and sequence/past) gears: every step sets dims
    # The KV inputs are stacked, so the count does not grow with depth (7 + 8 x 32 = 263 per layer).
    assert all(len(b["dims_vector"]) <= 24 for b in decoder), [len(b["dims_vector"]) for b in decoder]
    stacked = {
        i["name"]
        for b in decoder
        for i in b["inputs"]
        if tensor_names.is_stacked(i["name"]) and i["shape"][tensor_names.layer_axis(i["name"])] == DEEP
    }
    assert set(stacked) == (
        {"past_key_values.key", "past_key_values.value"}
        if layout == "contiguous"
        else {"key_cache", "value_cache"}
    )
    state.copies.clear()
    executor = _same_tokens_no_leak(state, root, ["Describe the image.", "Hi"], [["demo"], []], 4)
    # The KV stays on the device: no layer's KV is copied per step.
    steps = sum(n for b, n in executor.runs.items() if b.startswith("decoder"))
    if layout == "contiguous":
        # A decode step swaps its output and input buffers; only prefill->decode goes through the host.
        assert state.calls["acl.update_data_buffer"] >= 4 * (executor.runs["decoder_decode"] - 1)
        assert state.copies.get("device->host", 0) <= sum(executor.runs.values()) + 2
    else:
        # The new rows of all layers reach the pools with one copy per sequence and stack, not per layer,
        # and the loop hands them over with one call per stack and step (PagedPool.write), not per layer.
        assert 0 < state.copies["device->device"] <= 2 * 2 * steps
        assert stored == {"write_stack": 2 * steps, "write_layer": 0}, (stored, steps)


def test_a_kv_output_bound_as_an_input_without_a_swap_is_refused(acl, deep, tmp_path):
    # The stand-in refuses an execute whose input shares memory with an output (the aliasing a swap avoids),
    # and the device refuses a KV output read after its buffer was written again.
    module, state = acl
    _, root = _deep_build(deep, tmp_path, "contiguous")
    pkg, executor = runner.open_build(root, "acl")
    with executor:
        Pipeline(pkg, executor=executor).generate(["Hi"], [[]], 3)
        device = executor.device
        session = device._sessions["decoder_decode"]
        i = [s["name"] for s in session.build.inputs].index("past_key_values.key")
        j = [o["name"] for o in session.build.outputs].index("present.key")
        out = session.out_bufs[j]
        assert module.update_data_buffer(session.in_data[i], out.ptr, out.size) == 0
        assert module.mdl.execute(session.model_id, session.inputs, session.outputs) != 0
        assert "share device memory" in state.violations[-1]
        assert module.update_data_buffer(session.in_data[i], 12345, 8) != 0  # not acl.rt.malloc memory
        stale = acl_device.DeviceOutput(session, j, out, [1], np.float16)
        out.version += 1
        with pytest.raises(VlmcError, match="after its buffer was reused"):
            stale.to_host()
        assert (
            module.update_data_buffer(session.in_data[i], session.in_bufs[i].ptr, session.in_bufs[i].size)
            == 0
        )
    assert len(state.violations) == 2 and state.finalized == 1 and not any(state.live().values())


def test_precheck_refuses_a_dims_vector_over_acl_max_dim_cnt(deep, tmp_path, monkeypatch):
    # The per-layer form (what vlmc built before the stacked one) at 32 layers: 7 + 8 x 32 values.
    from vlmc.backends.ascend import stack_kv

    monkeypatch.setattr(stack_kv, "stack_inputs", lambda model, graph: [])
    out = CliRunner().invoke(main, ["compile", str(deep), "--soc", SOC, "-o", str(tmp_path / "build")])
    assert out.exit_code == 1 and "Traceback" not in out.output, out.output  # CheckFailed: exit 1
    line = out.output.strip().splitlines()[-1]
    assert "ACL_MAX_DIM_CNT = 128" in line and "decoder_decode" in line and "263 values" in line
    assert not (tmp_path / "build").exists()
