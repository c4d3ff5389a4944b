"""The .om files on a 910B through pyACL: the one module that calls the device. UNVERIFIED ON HARDWARE.

No NPU or CANN exists where vlmc is developed, so nothing here has run on a card. It runs in the tests
under tests/_pyacl_standin.py, a strict stand-in for ``acl`` written from the pyACL API reference, which
executes each build's lowered graph over its fake device memory and refuses what the reference forbids
(calls before init/context, short buffers, a gear-less dataset, dims vectors over ACL_MAX_DIM_CNT, double
frees, anything alive at ``acl.finalize``).

Resource lifecycle (docs/ascend.md "Running on a 910B"): :class:`AclDevice` owns everything it creates
and is a context manager. ``acl.init`` / ``acl.rt.set_device`` / ``acl.rt.create_context`` open it; each
build's model, desc, input and output device buffers, data buffers and datasets are created once at its
first execution (buffers sized by ``acl.mdl.get_input_size_by_index`` / ``get_output_size_by_index``,
which report the largest gear) and reused every step: a step copies in only its feeds' bytes at the
executed gear, sets the gear (``acl.mdl.set_input_dynamic_dims`` into the ``ascend_mbatch_shape_data``
buffer), executes and copies the outputs back at ``acl.mdl.get_cur_output_dims``. Paged pools are device
allocations bound by address (their data buffers are made once). :meth:`AclDevice.close` releases in
reverse order of creation on every path and always ends with ``acl.finalize`` (when this process's
``acl.init`` succeeded): data buffers, datasets and memory of each build, then ``acl.mdl.unload`` and
``acl.mdl.destroy_desc``, the pools, ``destroy_context``, ``reset_device``.

Paged rows are stored with ``acl.rt.memcpy`` host-to-device, one copy per run of consecutive slots
(a pool is ``[num_blocks, block_size, kv_heads, head_dim]`` ND, slot ``s`` is row ``s`` of its
``[slots, kv_heads, head_dim]`` view, docs/paged_kv.md); padding slots (< 0) are skipped. No torch or
torch_npu is involved, so nothing depends on torch's device-backend autoload.

pyACL pages (https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/appdevgapi/): init /
finalize aclpythondevg_01_0006; rt.malloc aclpythondevg_01_0110; rt.memcpy aclpythondevg_01_0120;
destroy_data_buffer aclpythondevg_01_0017; mdl.get_input_size_by_index aclpythondevg_01_0199;
mdl.set_input_dynamic_dims aclpythondevg_01_0168 (English 800 book); the C pages they wrap:
aclmdlCreateDataset / aclmdlDestroyDataset aclcppdevg_03_1438 / 03_1439, aclDestroyDataBuffer
aclcppdevg_03_1432, aclmdlGetCurOutputDims aclcppdevg_03_1466, aclrtMemcpy aclcppdevg_03_0105.

Everything device-side is imported lazily, so this module imports anywhere; :func:`available` says
whether ``acl`` imports.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

DYNAMIC_INPUT = "ascend_mbatch_shape_data"
ACL_MAX_DIM_CNT = 128  # acl_mdl.h: aclmdlIODims.dims holds at most this many values
_MEMCPY_HOST_TO_DEVICE, _MEMCPY_DEVICE_TO_HOST = 1, 2  # aclrtMemcpyKind
_MALLOC_HUGE_FIRST = 0  # aclrtMemMallocPolicy ACL_MEM_MALLOC_HUGE_FIRST
ACL_ERROR_REPEAT_INITIALIZE = 100002  # acl_base.h: aclInit was already called in this process


def available() -> bool:
    """True where pyACL (``acl``) can be imported."""
    return importlib.util.find_spec("acl") is not None


def _check(ret, what: str) -> None:
    if ret != 0:
        raise VlmcError(f"pyACL {what} failed with error {ret}")


class DevicePool:
    """A paged KV pool in device memory (``acl.rt.malloc``), bound as a build input by address.

    ``[num_blocks, block_size, kv_heads, head_dim]``, or stacked ``[layers, num_blocks, ...]`` for a build
    that takes all layers in one input (stack_kv.py); a layer of a stack is written with :meth:`write_layer`.
    """

    def __init__(self, device: AclDevice, name: str, shape: tuple[int, ...], dtype) -> None:
        self.device, self.name = device, name
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        if self.dtype != np.float16:
            raise VlmcError(f"{name}: device pools are float16 (the builds' pool dtype), not {self.dtype}")
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.row_bytes = int(np.prod(self.shape[-2:], dtype=np.int64)) * self.dtype.itemsize
        self.ptr = device._malloc(self.nbytes, f"pool {name}")
        self.zero()

    def zero(self) -> None:
        _check(
            self.device.acl.rt.memset(self.ptr, self.nbytes, 0, self.nbytes), f"acl.rt.memset({self.name})"
        )

    def write(self, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Store a step's rows [batch, seq, kv_heads, head_dim] at ``slot_mapping`` [batch, seq]."""
        self._write(self.ptr, self.nbytes, rows, slot_mapping)

    def write_layer(self, layer: int, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
        """The same, into layer ``layer`` of a stacked pool."""
        size = self.nbytes // self.shape[0]
        self._write(self.ptr + layer * size, size, rows, slot_mapping)

    def _write(self, base: int, size: int, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
        acl = self.device.acl
        slots = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
        flat = np.ascontiguousarray(rows, dtype=self.dtype).reshape(len(slots), -1)
        if flat.shape[1] * self.dtype.itemsize != self.row_bytes:
            raise VlmcError(
                f"{self.name}: rows of shape {list(rows.shape)} do not fit the pool {list(self.shape)}"
            )
        live = np.flatnonzero(slots >= 0)
        if live.size and (int(slots[live].max()) + 1) * self.row_bytes > size:
            raise VlmcError(f"{self.name}: slot {int(slots[live].max())} is outside the pool")
        src = acl.util.numpy_to_ptr(flat)
        # Runs of consecutive slots (a sequence's tokens inside one block) are one copy each.
        start = 0
        while start < live.size:
            end = start + 1
            while (
                end < live.size
                and live[end] == live[end - 1] + 1
                and slots[live[end]] == slots[live[end - 1]] + 1
            ):
                end += 1
            first, offset = int(live[start]), int(slots[live[start]]) * self.row_bytes
            ret = acl.rt.memcpy(base + offset, size - offset, src + first * self.row_bytes,
                                (end - start) * self.row_bytes, _MEMCPY_HOST_TO_DEVICE)  # fmt: skip
            _check(ret, f"acl.rt.memcpy({self.name})")
            start = end


class _BuildSession:
    """One loaded build: its model and desc, and input/output datasets sized for its largest gear."""

    def __init__(self, device: AclDevice, build, root: Path) -> None:
        acl = device.acl
        self.device, self.build = device, build
        om = (root / build.om).resolve()
        if not om.is_file():
            raise VlmcError(f"{build.name}: {om} is missing; run build.sh on a CANN host first")
        self.model_id, ret = acl.mdl.load_from_file(str(om))
        _check(ret, f"acl.mdl.load_from_file({om.name})")
        device._release.append((f"acl.mdl.unload({build.name})", lambda: acl.mdl.unload(self.model_id)))
        self.desc = acl.mdl.create_desc()
        if not self.desc:
            raise VlmcError("pyACL acl.mdl.create_desc returned no desc")
        device._release.append(
            (f"acl.mdl.destroy_desc({build.name})", lambda: acl.mdl.destroy_desc(self.desc))
        )
        _check(acl.mdl.get_desc(self.desc, self.model_id), "acl.mdl.get_desc")
        expected = len(build.inputs) + (1 if build.gears else 0)
        got = acl.mdl.get_num_inputs(self.desc)
        if got != expected or acl.mdl.get_num_outputs(self.desc) != len(build.outputs):
            raise VlmcError(
                f"{build.name}: {om.name} has {got} inputs, compile.json declares {expected}; rebuild the .om"
            )
        self.dims_index = None
        if build.gears:
            self.dims_index, ret = acl.mdl.get_input_index_by_name(self.desc, DYNAMIC_INPUT)
            _check(ret, f"acl.mdl.get_input_index_by_name({DYNAMIC_INPUT})")
        self.in_sizes = [acl.mdl.get_input_size_by_index(self.desc, i) for i in range(expected)]
        self.out_sizes = [acl.mdl.get_output_size_by_index(self.desc, i) for i in range(len(build.outputs))]
        self.in_ptrs: list[int | None] = [None] * expected
        self.out_ptrs = [
            device._malloc(size, f"{build.name} output {i}") for i, size in enumerate(self.out_sizes)
        ]
        self.outputs = device._dataset(
            [(p, s) for p, s in zip(self.out_ptrs, self.out_sizes)], f"{build.name} outputs"
        )
        self.inputs: int | None = None  # made at the first execution, when the pools are known
        self.in_buffers: list[int] = []
        self.bound: dict[int, int] = {}  # input index -> the pool address its data buffer holds

    def _make_inputs(self, feeds: list) -> None:
        device, acl = self.device, self.device.acl
        pairs = []
        for i, value in enumerate(feeds):
            if isinstance(value, DevicePool):
                pairs.append((value.ptr, value.nbytes))
                self.bound[i] = value.ptr
            else:
                self.in_ptrs[i] = device._malloc(self.in_sizes[i], f"{self.build.name} input {i}")
                pairs.append((self.in_ptrs[i], self.in_sizes[i]))
        if self.dims_index is not None:
            i = self.dims_index
            self.in_ptrs[i] = device._malloc(self.in_sizes[i], f"{self.build.name} {DYNAMIC_INPUT}")
            pairs.append((self.in_ptrs[i], self.in_sizes[i]))
        self.inputs = device._dataset(pairs, f"{self.build.name} inputs")
        self.in_buffers = [acl.mdl.get_dataset_buffer(self.inputs, i) for i in range(len(pairs))]

    def execute(self, feeds: dict[str, object], dims: list[int] | None) -> dict[str, np.ndarray]:
        acl, build = self.device.acl, self.build
        values = list(feeds.values())
        if self.inputs is None:
            self._make_inputs(values)
        for i, (spec, value) in enumerate(zip(build.inputs, values)):
            if isinstance(value, DevicePool):
                if self.bound.get(i) != value.ptr:  # a pool re-allocated since: rebind its data buffer
                    _check(
                        acl.update_data_buffer(self.in_buffers[i], value.ptr, value.nbytes),
                        "acl.update_data_buffer",
                    )
                    self.bound[i] = value.ptr
                continue
            host = np.ascontiguousarray(value)
            if host.dtype != np.dtype(spec["dtype"]):
                raise VlmcError(
                    f"{build.name}: input {spec['name']} is {host.dtype}, the build declares {spec['dtype']}"
                )
            if host.nbytes > self.in_sizes[i]:
                raise VlmcError(
                    f"{build.name}: input {spec['name']} needs {host.nbytes} bytes, the .om holds {self.in_sizes[i]}"
                )
            if host.nbytes:
                ret = acl.rt.memcpy(self.in_ptrs[i], self.in_sizes[i], acl.util.numpy_to_ptr(host), host.nbytes,
                                    _MEMCPY_HOST_TO_DEVICE)  # fmt: skip
                _check(ret, f"acl.rt.memcpy({spec['name']})")
        if dims is not None:
            if len(dims) > ACL_MAX_DIM_CNT:
                raise VlmcError(
                    f"{build.name}: the dims vector has {len(dims)} values, ACL_MAX_DIM_CNT is {ACL_MAX_DIM_CNT}"
                )
            spec = {"dimCount": len(dims), "name": "", "dims": [int(d) for d in dims]}
            _check(acl.mdl.set_input_dynamic_dims(self.model_id, self.inputs, self.dims_index, spec),
                   "acl.mdl.set_input_dynamic_dims")  # fmt: skip
        _check(acl.mdl.execute(self.model_id, self.inputs, self.outputs), f"acl.mdl.execute({build.name})")
        result = {}
        for i, spec in enumerate(build.outputs):
            cur, ret = acl.mdl.get_cur_output_dims(self.desc, i)
            _check(ret, "acl.mdl.get_cur_output_dims")
            out = np.empty([int(d) for d in cur["dims"][: cur["dimCount"]]], np.dtype(spec["dtype"]))
            if out.nbytes > self.out_sizes[i]:
                raise VlmcError(f"{build.name}: output {spec['name']} is larger than its buffer")
            if out.nbytes:
                ret = acl.rt.memcpy(acl.util.numpy_to_ptr(out), out.nbytes, self.out_ptrs[i], out.nbytes,
                                    _MEMCPY_DEVICE_TO_HOST)  # fmt: skip
                _check(ret, f"acl.rt.memcpy({spec['name']})")
            result[spec["name"]] = out
        return result


class AclDevice:
    """Loads each build's .om and executes it with host feeds and device-resident pools; owns every
    pyACL resource it creates and releases them all in :meth:`close` (also on ``with`` exit)."""

    def __init__(self, device_id: int = 0) -> None:
        if not available():
            raise VlmcError(
                "pyACL (acl) does not import here: install the CANN toolkit and source set_env.sh, or run "
                "--executor reference"
            )
        import acl

        self.acl = acl
        self.device_id = int(device_id)
        self._release: list[tuple[str, object]] = []  # (what, release call), in order of creation
        self._sessions: dict[str, _BuildSession] = {}
        self.pools: dict[str, DevicePool] = {}
        self._closed = False
        self._owns_init = False
        try:
            ret = acl.init()
            # A tensor-parallel rank imports torch_npu (the hccl collective) first, which may have run aclInit
            # already: ACL_ERROR_REPEAT_INITIALIZE is then not an error, and finalizing is left to its owner
            # (torch_npu treats it the same way, torch_npu/csrc/core/npu/sys_ctrl/npu_sys_ctrl.cpp).
            if ret != ACL_ERROR_REPEAT_INITIALIZE:
                _check(ret, "acl.init")
                self._owns_init = True
            _check(acl.rt.set_device(self.device_id), "acl.rt.set_device")
            self._release.append(("acl.rt.reset_device", lambda: acl.rt.reset_device(self.device_id)))
            self.context, ret = acl.rt.create_context(self.device_id)
            _check(ret, "acl.rt.create_context")
            self._release.append(("acl.rt.destroy_context", lambda: acl.rt.destroy_context(self.context)))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> AclDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- resources -------------------------------------------------------------------------
    def _malloc(self, size: int, what: str) -> int:
        ptr, ret = self.acl.rt.malloc(max(int(size), 1), _MALLOC_HUGE_FIRST)
        _check(ret, f"acl.rt.malloc({what})")
        self._release.append((f"acl.rt.free({what})", lambda: self.acl.rt.free(ptr)))
        return ptr

    def _dataset(self, pairs: list[tuple[int, int]], what: str) -> int:
        acl = self.acl
        dataset = acl.mdl.create_dataset()
        if not dataset:
            raise VlmcError(f"pyACL acl.mdl.create_dataset returned no dataset ({what})")
        self._release.append((f"acl.mdl.destroy_dataset({what})", lambda: acl.mdl.destroy_dataset(dataset)))
        for ptr, size in pairs:
            buf = acl.create_data_buffer(ptr, size)
            if not buf:
                raise VlmcError(f"pyACL acl.create_data_buffer returned no buffer ({what})")
            self._release.append(
                (f"acl.destroy_data_buffer({what})", lambda buf=buf: acl.destroy_data_buffer(buf))
            )
            _, ret = acl.mdl.add_dataset_buffer(dataset, buf)
            _check(ret, "acl.mdl.add_dataset_buffer")
        return dataset

    # ---- builds --------------------------------------------------------------------------
    def load(self, build, root: Path) -> None:
        if self._closed:
            raise VlmcError("the NPU session is closed")
        if build.name not in self._sessions:
            self._sessions[build.name] = _BuildSession(self, build, Path(root))

    def execute(self, build, feeds: dict[str, object], dims: list[int] | None) -> dict[str, np.ndarray]:
        return self._sessions[build.name].execute(feeds, dims)

    # ---- paged pools -----------------------------------------------------------------------
    def new_pool(self, name: str, shape: tuple[int, ...], dtype) -> DevicePool:
        """The device pool ``name``: allocated once, handed out again (zeroed) to the next generation."""
        pool = self.pools.get(name)
        if pool is not None and pool.shape == tuple(shape) and pool.dtype == np.dtype(dtype):
            pool.zero()
            return pool
        pool = DevicePool(self, name, shape, dtype)  # a different shape: the old one is freed at close
        self.pools[name] = pool
        return pool

    def close(self) -> None:
        """Release every resource in reverse order of creation, then ``acl.finalize``; idempotent.

        Every release is attempted even when one fails; the first failure is raised afterwards.
        """
        if self._closed:
            return
        self._closed = True
        failures = []
        while self._release:
            what, release = self._release.pop()
            try:
                ret = release()
            except Exception as exc:  # keep releasing: the rest must not leak because one call failed
                failures.append(f"{what}: {exc}")
                continue
            if ret not in (0, None):
                failures.append(f"{what} returned {ret}")
        self._sessions.clear()
        self.pools.clear()
        if self._owns_init:
            ret = self.acl.finalize()
            if ret != 0:
                failures.append(f"acl.finalize returned {ret}")
        if failures:
            raise VlmcError(f"releasing the NPU session: {'; '.join(failures)}")
