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
which report the largest gear) and reused every step. :meth:`AclDevice.close` releases in reverse order
of creation on every path and always ends with ``acl.finalize`` (when this process's ``acl.init``
succeeded): data buffers, datasets and memory of each build, then ``acl.mdl.unload`` and
``acl.mdl.destroy_desc``, the pools, ``destroy_context``, ``reset_device``.

Per step (docs/ascend.md): only the small inputs (embeddings, mask, positions, block tables, slots) are
copied in, at the executed gear's bytes, and of those only the ones whose bytes differ from what their
buffer already holds; the gear is set with ``acl.mdl.set_input_dynamic_dims`` into the
``ascend_mbatch_shape_data`` buffer when it differs from the last one set there; after ``acl.mdl.execute`` only the outputs the loop reads (logits)
are copied back, at ``acl.mdl.get_cur_output_dims`` (asked once per gear: a gear is a static model). The KV stays on the device (stack_kv.py):

- contiguous: a decode build's stacked, rolled ``present.*`` output has the shape of its stacked past at
  the same gear, so the next step binds the output buffer as its input and hands the old input buffer to
  the output (``acl.update_data_buffer`` on both data buffers, no copy). Where the layout differs (prefill
  to decode, a change of gear) the KV goes through the host once: one copy out, one copy in per stack.
- paged: the pools are device allocations bound by address (their data buffers made once); a step's
  stacked new rows ``[batch, sequence, layers, kv_heads, head_dim]`` are stored into the slot-major pool
  ``[num_blocks, block_size, layers, kv_heads, head_dim]`` with one device-to-device ``acl.rt.memcpy``
  per run of consecutive slots for all layers (one per stack at batch 1), just before the next execution.
  Padding slots (< 0) are skipped. No torch or torch_npu is involved, so nothing depends on torch's
  device-backend autoload.

pyACL pages (https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/appdevgapi/): init /
finalize aclpythondevg_01_0006; rt.malloc aclpythondevg_01_0110; rt.memcpy aclpythondevg_01_0120;
destroy_data_buffer aclpythondevg_01_0017; mdl.get_input_size_by_index aclpythondevg_01_0199;
mdl.set_input_dynamic_dims aclpythondevg_01_0168 (English 800 book); the C pages they wrap:
aclmdlCreateDataset / aclmdlDestroyDataset aclcppdevg_03_1438 / 03_1439, aclDestroyDataBuffer
aclcppdevg_03_1432, aclmdlGetCurOutputDims aclcppdevg_03_1466, aclrtMemcpy aclcppdevg_03_0105 (kind 3
ACL_MEMCPY_DEVICE_TO_DEVICE; aclrtMemcpy2d, 03_0108, copies only host<->device, so no strided
device-to-device copy is used), aclUpdateDataBuffer (acl.update_data_buffer, aclpythondevg_01_0018).

Everything device-side is imported lazily, so this module imports anywhere; :func:`available` says
whether ``acl`` imports.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path

import numpy as np

from vlmc import tensor_names
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

DYNAMIC_INPUT = "ascend_mbatch_shape_data"
ACL_MAX_DIM_CNT = 128  # acl_mdl.h: aclmdlIODims.dims holds at most this many values
_MEMCPY_HOST_TO_DEVICE, _MEMCPY_DEVICE_TO_HOST, _MEMCPY_DEVICE_TO_DEVICE = 1, 2, 3  # aclrtMemcpyKind
_MALLOC_HUGE_FIRST = 0  # aclrtMemMallocPolicy ACL_MEM_MALLOC_HUGE_FIRST
ACL_ERROR_REPEAT_INITIALIZE = 100002  # acl_base.h: aclInit was already called in this process
# Host inputs up to this size are compared with what their device buffer holds before they are copied
# (a decode step's block tables, slots, positions); larger ones (a prefill's embeddings) are copied as
# they are, comparing would cost about what the copy does.
_SAME_BYTES_LIMIT = 4096


def available() -> bool:
    """True where pyACL (``acl``) can be imported."""
    return importlib.util.find_spec("acl") is not None


def _check(ret, what: str) -> None:
    if ret != 0:
        raise VlmcError(f"pyACL {what} failed with error {ret}")


class DevicePool:
    """A paged KV pool in device memory (``acl.rt.malloc``), bound as a build input by address.

    ``[num_blocks, block_size, kv_heads, head_dim]``, or stacked slot-major ``[num_blocks, block_size,
    layers, kv_heads, head_dim]`` for a build that takes all layers in one input (stack_kv.py); a layer of
    a stack is written with :meth:`write_layer`, a step's rows of every layer with :meth:`write_stack`.
    """

    def __init__(self, device: AclDevice, name: str, shape: tuple[int, ...], dtype) -> None:
        self.device, self.name = device, name
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        if self.dtype != np.float16:
            raise VlmcError(f"{name}: device pools are float16 (the builds' pool dtype), not {self.dtype}")
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.axis = tensor_names.layer_axis(name) if tensor_names.is_stacked(name) else None
        # A slot's bytes (every layer's row, slot-major) and one layer's row.
        self.slot_bytes = int(np.prod(self.shape[2:], dtype=np.int64)) * self.dtype.itemsize
        self.row_bytes = int(np.prod(self.shape[-2:], dtype=np.int64)) * self.dtype.itemsize
        self.ptr = device._malloc(self.nbytes, f"pool {name}")
        self._pending: dict[int, tuple[object, np.ndarray]] = {}  # layer -> (device rows, slots)
        self._whole: tuple[object, np.ndarray] | None = None  # (device rows of every layer, slots)
        self.zero()

    def zero(self) -> None:
        self._pending.clear()  # rows of the generation before: a zeroed pool stores none of them
        self._whole = None
        _check(
            self.device.acl.rt.memset(self.ptr, self.nbytes, 0, self.nbytes), f"acl.rt.memset({self.name})"
        )

    def write(self, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Store a step's rows [batch, seq, kv_heads, head_dim] at ``slot_mapping`` [batch, seq]."""
        self._write_host(0, rows, slot_mapping, self.row_bytes, self.row_bytes)

    def write_layer(self, layer: int, rows, slot_mapping: np.ndarray) -> None:
        """The same, into layer ``layer`` of a stacked pool. Rows the device kept (a layer of a stacked
        output, runner.OutputLayer) are stored at the next execution, all layers with one copy per run."""
        handle = getattr(getattr(rows, "parent", None), "handle", None)
        if isinstance(handle, DeviceOutput):
            self._pending[layer] = (rows.parent, np.asarray(slot_mapping))
            self.device._dirty.add(self)
            return
        if self.axis == 0:
            size = self.nbytes // self.shape[0]
            self._write_host(layer * size, rows, slot_mapping, self.row_bytes, self.row_bytes, size)
        else:  # slot-major: a layer's rows are one row apart in every slot, no run spans two slots
            self._write_host(layer * self.row_bytes, rows, slot_mapping, self.slot_bytes, self.row_bytes)

    def write_stack(self, rows, slot_mapping: np.ndarray) -> bool:
        """Every layer's rows at once: ``rows`` is a stacked output the device kept (runner.DeviceStack)
        with this slot-major pool's layers, stored at the next execution with one device-to-device copy
        per run of consecutive slots. False (nothing done) for anything else: the caller writes layer by
        layer then."""
        if self.axis != 2 or not isinstance(getattr(rows, "handle", None), DeviceOutput):
            return False
        if rows.shape[2] != self.shape[2]:
            raise VlmcError(f"{self.name}: {rows.shape[2]} layers of rows for a pool of {self.shape[2]}")
        self._pending.clear()  # superseded: this step's rows cover every layer
        self._whole = (rows, np.asarray(slot_mapping))
        self.device._dirty.add(self)
        return True

    def _slots(self, slot_mapping, stride: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        slots = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
        live = np.flatnonzero(slots >= 0)
        if live.size and (int(slots[live].max()) + 1) * stride > size:
            raise VlmcError(f"{self.name}: slot {int(slots[live].max())} is outside the pool")
        return slots, live

    def _write_host(self, base, rows, slot_mapping, stride, row, size=None) -> None:
        acl = self.device.acl
        slots, live = self._slots(slot_mapping, stride, self.nbytes if size is None else size)
        flat = np.ascontiguousarray(rows, dtype=self.dtype).reshape(len(slots), -1)
        if flat.shape[1] * self.dtype.itemsize != row:
            raise VlmcError(
                f"{self.name}: rows of shape {list(rows.shape)} do not fit the pool {list(self.shape)}"
            )
        src = acl.util.numpy_to_ptr(flat)
        for first, dst, n in _runs(live, slots, stride == row):
            offset = base + dst * stride
            ret = acl.rt.memcpy(self.ptr + offset, self.nbytes - offset, src + first * row, n * row,
                                _MEMCPY_HOST_TO_DEVICE)  # fmt: skip
            _check(ret, f"acl.rt.memcpy({self.name})")

    def flush(self) -> None:
        """Store the pending device rows: one device-to-device copy per run of consecutive slots for all
        layers when every layer's rows come from one stacked output at the same slots, else per layer."""
        pending, self._pending = self._pending, {}
        stored, self._whole = self._whole, None
        groups = [] if stored is None else [(*stored, None)]  # write_stack's: every layer at once
        if pending:  # write_layer's (after any write_stack of the same step, so stored after it)
            layers = self.shape[self.axis]
            stacks = {id(p) for p, _ in pending.values()}
            first_stack, first_slots = pending[min(pending)]
            whole = (
                len(pending) == layers
                and len(stacks) == 1
                and self.axis == 2
                and all(np.array_equal(s, first_slots) for _, s in pending.values())
            )
            groups += (
                [(first_stack, first_slots, None)]
                if whole
                else [(p, s, layer) for layer, (p, s) in pending.items()]
            )
        acl = self.device.acl
        for stack, slot_mapping, layer in groups:
            handle = stack.handle
            handle.check_fresh()
            # Python lists: a step has a few slots, and per-element numpy indexing costs more than it saves.
            rows = stack.row_index()
            slots = np.asarray(slot_mapping).reshape(-1).tolist()
            if len(rows) != len(slots):
                raise VlmcError(f"{self.name}: {len(rows)} rows for {len(slots)} slots")
            live = [k for k, slot in enumerate(slots) if slot >= 0]
            if live and (max(slots) + 1) * self.slot_bytes > self.nbytes:
                raise VlmcError(f"{self.name}: slot {max(slots)} is outside the pool")
            src_slot = math.prod(handle.shape[2:]) * handle.dtype.itemsize
            if src_slot != self.slot_bytes:
                raise VlmcError(f"{self.name}: the stacked rows do not fit the pool {list(self.shape)}")
            width, shift = (self.slot_bytes, 0) if layer is None else (self.row_bytes, layer * self.row_bytes)
            merge = layer is None
            for first, dst, n in _runs(live, slots, merge, order=rows):
                offset = dst * self.slot_bytes + shift
                src = handle.ptr + rows[first] * self.slot_bytes + shift
                ret = acl.rt.memcpy(self.ptr + offset, self.nbytes - offset, src, (n - 1) * self.slot_bytes + width,
                                    _MEMCPY_DEVICE_TO_DEVICE)  # fmt: skip
                if ret:  # the message is spelled only on failure: this runs every step
                    _check(ret, f"acl.rt.memcpy({self.name}, device to device)")


def _runs(live, slots, merge: bool, order=None):
    """(first index, first slot, length) of each run of ``live`` entries whose slots (and, given ``order``,
    source rows) are consecutive; every entry its own run unless ``merge``. Takes numpy arrays or lists."""
    start = 0
    while start < len(live):
        end = start + 1
        while (
            merge
            and end < len(live)
            and live[end] == live[end - 1] + 1
            and slots[live[end]] == slots[live[end - 1]] + 1
            and (order is None or order[live[end]] == order[live[end - 1]] + 1)
        ):
            end += 1
        yield int(live[start]), int(slots[live[start]]), end - start
        start = end


class DeviceBuffer:
    """One device allocation a build binds as a stacked KV input or output; ``version`` counts the
    executions that wrote it (a :class:`DeviceOutput` of an older version is stale)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr, self.size, self.version = ptr, size, 0


class DeviceOutput:
    """A stacked KV output left on the device: its buffer, the gear shape it was written at, its dtype."""

    def __init__(self, session: _BuildSession, index: int, buffer: DeviceBuffer, shape, dtype) -> None:
        self.session, self.index, self.buffer = session, index, buffer
        self.version = buffer.version
        # A step makes one per stack: a tuple of ints and a dtype (what execute passes) are taken as they are.
        self.shape = shape if type(shape) is tuple else tuple(int(d) for d in shape)
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize  # Python ints: no overflow, no numpy call

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    def check_fresh(self) -> None:
        if self.buffer.version != self.version or self.session.device._closed:
            raise VlmcError(f"{self.session.build.name}: a KV output was read after its buffer was reused")

    def to_host(self) -> np.ndarray:
        """The whole buffer at its gear, copied to the host (one ``acl.rt.memcpy``)."""
        self.check_fresh()
        acl = self.session.device.acl
        out = np.empty(self.shape, self.dtype)
        if out.nbytes:
            ret = acl.rt.memcpy(acl.util.numpy_to_ptr(out), out.nbytes, self.ptr, out.nbytes,
                                _MEMCPY_DEVICE_TO_HOST)  # fmt: skip
            _check(ret, "acl.rt.memcpy(KV output to host)")
        return out


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
        self.in_bufs: list[DeviceBuffer | None] = [None] * expected
        self.out_bufs = [
            self._buffer(size, f"{build.name} output {i}", zero=tensor_names.is_stacked_output(o["name"]))
            for i, (size, o) in enumerate(zip(self.out_sizes, build.outputs))
        ]
        self.outputs = device._dataset([(b.ptr, b.size) for b in self.out_bufs], f"{build.name} outputs")
        self.out_data = [acl.mdl.get_dataset_buffer(self.outputs, i) for i in range(len(self.out_bufs))]
        self.out_dtypes = [np.dtype(o["dtype"]) for o in build.outputs]
        self.in_dtypes = [np.dtype(i["dtype"]) for i in build.inputs]
        self.kept = [tensor_names.is_stacked_output(o["name"]) for o in build.outputs]  # left on the device
        self.inputs: int | None = None  # made at the first execution, when the pools are known
        self.in_data: list[int] = []
        self.bound: dict[int, int] = {}  # input index -> the pool address its data buffer holds
        self._dims_spec = {"dimCount": 0, "name": "", "dims": []}
        # What the device buffers already hold, so that a step copies only what changed: input index ->
        # the bytes last copied into its buffer (small host inputs only, see _SAME_BYTES_LIMIT), and the
        # dims vector last written into the ascend_mbatch_shape_data buffer.
        self.sent: dict[int, bytes] = {}
        self.dims_set: list[int] | None = None
        self.out_shapes: dict[tuple[int, ...] | None, list[list[int]]] = {}  # gear dims -> output dims

    def _buffer(self, size: int, what: str, zero: bool = False) -> DeviceBuffer:
        buf = DeviceBuffer(self.device._malloc(size, what), max(int(size), 1))
        if zero:  # KV padding positions are read (masked): zeros, never stale memory
            _check(self.device.acl.rt.memset(buf.ptr, buf.size, 0, buf.size), f"acl.rt.memset({what})")
        return buf

    def _make_inputs(self, feeds: list) -> None:
        device, acl = self.device, self.device.acl
        pairs = []
        for i, value in enumerate(feeds):
            if isinstance(value, DevicePool):
                pairs.append((value.ptr, value.nbytes))
                self.bound[i] = value.ptr
            else:
                name = self.build.inputs[i]["name"]
                self.in_bufs[i] = self._buffer(
                    self.in_sizes[i], f"{self.build.name} input {i}", zero=tensor_names.is_stacked(name)
                )
                pairs.append((self.in_bufs[i].ptr, self.in_bufs[i].size))
        if self.dims_index is not None:
            i = self.dims_index
            self.in_bufs[i] = self._buffer(self.in_sizes[i], f"{self.build.name} {DYNAMIC_INPUT}")
            pairs.append((self.in_bufs[i].ptr, self.in_bufs[i].size))
        self.inputs = device._dataset(pairs, f"{self.build.name} inputs")
        self.in_data = [acl.mdl.get_dataset_buffer(self.inputs, i) for i in range(len(pairs))]

    def _bind(self, i: int, value: DeviceOutput) -> None:
        """Make the KV output ``value`` input ``i``: its buffer becomes the input's and the input's old
        buffer the producer's output (two ``acl.update_data_buffer``, no copy); where either is too small
        for the other role, one device-to-device copy into the input's own buffer instead."""
        acl, mine = self.device.acl, self.in_bufs[i]
        value.check_fresh()
        if value.buffer is mine:
            return  # already this input's (the same output fed twice)
        self.sent.pop(i, None)  # the input's buffer changes (or is written) here: its bytes are unknown
        producer, j = value.session, value.index
        if value.buffer.size >= self.in_sizes[i] and mine.size >= producer.out_sizes[j]:
            _check(acl.update_data_buffer(self.in_data[i], value.buffer.ptr, value.buffer.size),
                   "acl.update_data_buffer")  # fmt: skip
            _check(
                acl.update_data_buffer(producer.out_data[j], mine.ptr, mine.size), "acl.update_data_buffer"
            )
            self.in_bufs[i], producer.out_bufs[j] = value.buffer, mine
            return
        ret = acl.rt.memcpy(mine.ptr, mine.size, value.ptr, value.nbytes, _MEMCPY_DEVICE_TO_DEVICE)
        _check(ret, "acl.rt.memcpy(KV, device to device)")

    def execute(self, feeds: dict[str, object], dims: list[int] | None) -> dict[str, object]:
        acl, build = self.device.acl, self.build
        values = list(feeds.values())
        if self.inputs is None:
            self._make_inputs(values)
        for i, (spec, value) in enumerate(zip(build.inputs, values)):
            if isinstance(value, DevicePool):
                if self.bound.get(i) != value.ptr:  # a pool re-allocated since: rebind its data buffer
                    _check(
                        acl.update_data_buffer(self.in_data[i], value.ptr, value.nbytes),
                        "acl.update_data_buffer",
                    )
                    self.bound[i] = value.ptr
                continue
            if isinstance(value, DeviceOutput):
                self._bind(i, value)
                continue
            host = np.ascontiguousarray(value)
            if host.dtype != self.in_dtypes[i]:
                raise VlmcError(
                    f"{build.name}: input {spec['name']} is {host.dtype}, the build declares {spec['dtype']}"
                )
            if host.nbytes > self.in_sizes[i]:
                raise VlmcError(
                    f"{build.name}: input {spec['name']} needs {host.nbytes} bytes, the .om holds {self.in_sizes[i]}"
                )
            if not host.nbytes:
                continue
            # The buffer keeps what the last copy put there (nothing else writes a host input's buffer:
            # _bind forgets an input it rebinds), so bytes equal to those are not copied again: at batch 1
            # the block tables, say, change only when a block is added. Compared as bytes, which for a
            # small input costs less than the copy; a larger one is copied without looking.
            blob = host.tobytes() if host.nbytes <= _SAME_BYTES_LIMIT else None
            if blob is not None and self.sent.get(i) == blob:
                continue
            self.sent.pop(i, None)  # a failed copy leaves the buffer's bytes unknown
            ret = acl.rt.memcpy(self.in_bufs[i].ptr, self.in_sizes[i], acl.util.numpy_to_ptr(host), host.nbytes,
                                _MEMCPY_HOST_TO_DEVICE)  # fmt: skip
            if ret:  # messages are spelled only on failure: this runs every step
                _check(ret, f"acl.rt.memcpy({spec['name']})")
            if blob is not None:
                self.sent[i] = blob
        if dims is not None and dims != self.dims_set:
            # set_input_dynamic_dims copies the gear into the ascend_mbatch_shape_data buffer, which keeps
            # it (GeExecutor::SetDynamicDims, https://github.com/mindspore-ai/graphengine
            # ge/executor/ge_executor.cc: one host-to-device rtMemcpy per value): the same gear as this
            # dataset's last execution is not set again.
            if len(dims) > ACL_MAX_DIM_CNT:
                raise VlmcError(
                    f"{build.name}: the dims vector has {len(dims)} values, ACL_MAX_DIM_CNT is {ACL_MAX_DIM_CNT}"
                )
            self.dims_set = None
            spec = self._dims_spec  # one dict reused: pyACL reads it during the call
            spec["dimCount"], spec["dims"] = len(dims), dims
            _check(acl.mdl.set_input_dynamic_dims(self.model_id, self.inputs, self.dims_index, spec),
                   "acl.mdl.set_input_dynamic_dims")  # fmt: skip
            self.dims_set = list(dims)
        ret = acl.mdl.execute(self.model_id, self.inputs, self.outputs)
        if ret:
            _check(ret, f"acl.mdl.execute({build.name})")
        # Each gear is a static model of its own (ATC compiles one per --dynamic_dims profile), so its
        # output dims are asked once per gear and kept.
        key = None if dims is None else tuple(dims)
        shapes = self.out_shapes.get(key)
        if shapes is None:
            shapes = []
            for i in range(len(build.outputs)):
                cur, ret = acl.mdl.get_cur_output_dims(self.desc, i)
                _check(ret, "acl.mdl.get_cur_output_dims")
                shapes.append(tuple(int(d) for d in cur["dims"][: cur["dimCount"]]))
            self.out_shapes[key] = shapes
        result = {}
        for i, spec in enumerate(build.outputs):
            shape = shapes[i]
            buf = self.out_bufs[i]
            if self.kept[i]:  # the KV: left where it is, for the next step to bind
                buf.version += 1
                out = DeviceOutput(self, i, buf, shape, self.out_dtypes[i])
                if out.nbytes > buf.size:
                    raise VlmcError(f"{build.name}: output {spec['name']} is larger than its buffer")
                result[spec["name"]] = out
                continue
            out = np.empty(shape, self.out_dtypes[i])
            if out.nbytes > self.out_sizes[i]:
                raise VlmcError(f"{build.name}: output {spec['name']} is larger than its buffer")
            if out.nbytes:
                ret = acl.rt.memcpy(acl.util.numpy_to_ptr(out), out.nbytes, buf.ptr, out.nbytes,
                                    _MEMCPY_DEVICE_TO_HOST)  # fmt: skip
                if ret:
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
        self._dirty: set[DevicePool] = set()  # pools with rows waiting to be stored (DevicePool.flush)
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

    def execute(self, build, feeds: dict[str, object], dims: list[int] | None) -> dict[str, object]:
        """Run a build; its stacked KV outputs stay on the device (:class:`DeviceOutput`), the rest are
        copied back. The rows pools wait for are stored first (their source is the last step's output)."""
        while self._dirty:
            self._dirty.pop().flush()
        return self._sessions[build.name].execute(feeds, dims)

    def binds(self, value, shape: tuple[int, ...]) -> bool:
        """Whether a KV output can be bound as an input of this ``shape`` as it is (its buffer holds that
        layout): the caller otherwise brings it to the host and pads it."""
        return (
            isinstance(value, DeviceOutput)
            and value.session.device is self
            and value.buffer.version == value.version
            and value.shape == tuple(shape)
        )

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
