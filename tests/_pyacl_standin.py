"""A strict stand-in for pyACL (the ``acl`` module), written from the pyACL / AscendCL API reference.

There is no NPU where vlmc is developed. This module is what ``import acl`` finds in the tests: every
function has the documented Python signature and return convention (``(value, ret)`` where the page
says so, a bare ``ret`` or a bare handle otherwise) and the documented error codes (acl_base.h /
acl_rt error tables), and it refuses what the reference says a caller must not do. A refusal returns
the error code, as pyACL does, and is also recorded in :data:`STATE` ``.violations`` so a test can
assert that a whole run broke no rule.

Rules enforced (each with the page it comes from; pyACL pages are under
https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/appdevgapi/ unless a full
address is given):

- ``acl.init`` / ``acl.finalize`` (aclpythondevg_01_0006): nothing but ``init`` works before ``init``
  (ACL_ERROR_UNINITIALIZE 100001); a second ``init`` returns ACL_ERROR_REPEAT_INITIALIZE 100002.
  *Stricter than pyACL*: ``finalize`` with any model, dataset, data buffer, device allocation or
  context still alive is refused and every live resource is listed.
- ``acl.rt.set_device`` / ``reset_device`` / ``create_context`` / ``destroy_context``: memory and
  models need a current context (ACL_ERROR_RT_CONTEXT_NULL 107002, the acl_rt error table).
- ``acl.rt.malloc`` (aclpythondevg_01_0110, ``dev_ptr, ret``; size 0 refused), ``acl.rt.free``
  (a pointer not allocated, or freed twice, is refused), ``acl.rt.memset``, ``acl.rt.memcpy``
  (aclpythondevg_01_0120: ``ret``; ``count`` > ``dest_max`` or a range outside an allocation refused;
  kinds 1 host->device, 2 device->host, 3 device->device, enum values from the English page
  https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/aclpythondevg_01_0124.html).
  Device memory is a ``bytearray`` per allocation behind a fake address; host memory is a numpy
  array registered by ``acl.util.numpy_to_ptr``.
- ``acl.create_data_buffer`` / ``acl.destroy_data_buffer`` (aclpythondevg_01_0017) /
  ``acl.update_data_buffer``; ``acl.mdl.create_dataset`` / ``destroy_dataset`` / ``add_dataset_buffer``
  (``dataset, ret``) / ``get_dataset_num_buffers`` / ``get_dataset_buffer`` (aclmdlDataset,
  aclcppdevg_03_1438/1439; aclDestroyDataBuffer leaves the memory to the caller, aclcppdevg_03_1432):
  a destroyed handle is refused, twice is a double free.
- ``acl.mdl.load_from_file`` (``model_id, ret``) / ``unload``; ``create_desc`` / ``get_desc`` /
  ``destroy_desc``; ``get_num_inputs`` / ``get_num_outputs``; ``get_input_size_by_index`` /
  ``get_output_size_by_index`` (aclpythondevg_01_0199: for a model with gears, the size at the largest
  gear); ``get_input_index_by_name`` (``index, ret``); ``get_cur_output_dims`` (``dims, ret``,
  aclcppdevg_03_1466: the last set gear's output dims).
- ``acl.mdl.set_input_dynamic_dims`` (aclpythondevg_01_0168 / aclcppdevg_03_0312): ``dims`` is every
  input's full shape with one gear's values in place of the -1s; ``dimCount`` above ACL_MAX_DIM_CNT
  = 128 (acl_mdl.h aclmdlIODims) is refused, as is a vector whose static entries differ from the
  model's or whose -1 entries are no gear (GeExecutor::GetCurDynamicDims in hicann/ge checks both).
  The gear values are written, as uint64, into the ``ascend_mbatch_shape_data`` buffer of the dataset
  at ``index``, which is where the executed model reads its gear from.
- ``acl.mdl.execute``: the input dataset holds exactly the model's inputs (the
  ``ascend_mbatch_shape_data`` buffer last for a model with gears, so a dataset without it is refused),
  every buffer is at least the executed gear's bytes, the output dataset holds every output with room
  for its bytes.

A "model" is a build of a ``vlmc compile`` output: ``load_from_file(<out>/om/<build>.om)`` reads the
build's entry in ``<out>/compile.json`` (the .om itself must exist, a placeholder where ATC never ran)
and ``execute`` runs the build's lowered ONNX graph (its ``file``) on onnxruntime through
vlmc/runtime/executors/reference.py, reading the inputs from and writing the outputs to device memory.
"""

from __future__ import annotations

import bisect
import ctypes
import importlib.machinery
import json
import logging
import sys
import types
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

# acl_base.h / the acl_rt error table (public CANN headers, e.g. hicann/runtime).
ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_INVALID_FILE = 100003
ACL_ERROR_INVALID_MODEL_ID = 100011
ACL_ERROR_MODEL_INPUT_NOT_MATCH = 100017
ACL_ERROR_MODEL_OUTPUT_NOT_MATCH = 100018
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_STORAGE_OVER_LIMIT = 300000
ACL_MAX_DIM_CNT = 128  # acl_mdl.h
DYNAMIC_INPUT = "ascend_mbatch_shape_data"  # ACL_DYNAMIC_TENSOR_NAME
_MEMCPY_KINDS = {0: ("host", "host"), 1: ("device", "host"), 2: ("host", "device"), 3: ("device", "device")}
_DEVICE_BASE = 1 << 44  # fake device addresses: far from any host mapping


class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.initialized = False
        self.finalized = 0
        self.devices: set[int] = set()
        self.contexts: dict[int, int] = {}  # handle -> device
        self.current: int | None = None
        self.memory: dict[int, bytearray] = {}  # device address -> bytes
        self.freed: set[int] = set()
        self.host: dict[int, np.ndarray] = {}  # host address -> the array behind it
        self.buffers: dict[int, list[int]] = {}  # data buffer -> [address, size]
        self.datasets: dict[int, list[int]] = {}  # dataset -> data buffers in order
        self.models: dict[int, _Model] = {}
        self.descs: dict[int, int | None] = {}  # desc -> model id
        self.dead: set[int] = set()  # destroyed handles (data buffers, datasets, descs, models)
        self.violations: list[str] = []
        self.calls: dict[str, int] = {}
        self.max_dim_count = 0
        self._next = 1
        self._next_addr = _DEVICE_BASE
        self._bases: list[int] | None = None  # sorted allocation addresses, rebuilt after malloc/free

    def handle(self) -> int:
        self._next += 1
        return 0x5000 + self._next

    def alloc(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += ((size + 32 + 63) // 64) * 64 + 4096  # aclrtMalloc's padding, plus a guard gap
        self.memory[addr] = bytearray(size)
        self._bases = None
        return addr

    def live(self) -> dict[str, int]:
        return {
            "models": len(self.models),
            "descs": len(self.descs),
            "datasets": len(self.datasets),
            "data buffers": len(self.buffers),
            "device allocations": len(self.memory),
            "contexts": len(self.contexts),
            "devices": len(self.devices),
        }


STATE = _State()


def _refuse(code: int, message: str) -> int:
    STATE.violations.append(message)
    logger.debug("pyACL stand-in refused: %s", message)
    return code


def _count(name: str) -> None:
    STATE.calls[name] = STATE.calls.get(name, 0) + 1


def _ready(name: str, context: bool = True) -> int:
    """0, or the error a call made before acl.init (or, for device work, without a context) gets."""
    _count(name)
    if not STATE.initialized:
        return _refuse(ACL_ERROR_UNINITIALIZE, f"{name} before acl.init")
    if context and STATE.current is None:
        return _refuse(
            ACL_ERROR_RT_CONTEXT_NULL, f"{name} without a current context (set_device/create_context)"
        )
    return ACL_SUCCESS


def _device_range(addr: int, count: int, what: str) -> tuple[bytearray, int] | None:
    if STATE._bases is None:
        STATE._bases = sorted(STATE.memory)
    i = bisect.bisect_right(STATE._bases, addr) - 1  # the allocation starting at or below addr
    if i >= 0:
        base = STATE._bases[i]
        buf = STATE.memory[base]
        if addr < base + max(len(buf), 1):
            if addr + count > base + len(buf):
                _refuse(
                    ACL_ERROR_INVALID_PARAM,
                    f"{what}: {count} bytes at +{addr - base} overrun a {len(buf)}-byte allocation",
                )
                return None
            return buf, addr - base
    _refuse(ACL_ERROR_INVALID_PARAM, f"{what}: {addr:#x} is not device memory allocated by acl.rt.malloc")
    return None


def _host_range(addr: int, count: int, what: str) -> bool:
    arr = STATE.host.get(addr)
    if arr is not None and count <= arr.nbytes:
        return True
    for base, arr in STATE.host.items():
        if base <= addr and addr + count <= base + arr.nbytes:
            return True
    _refuse(
        ACL_ERROR_INVALID_PARAM, f"{what}: {addr:#x}+{count} is not host memory from acl.util.numpy_to_ptr"
    )
    return False


# ---- acl (system) -------------------------------------------------------------------------------
def init(config_path: str | None = None) -> int:
    _count("acl.init")
    if STATE.initialized:
        return ACL_ERROR_REPEAT_INITIALIZE
    STATE.initialized = True
    return ACL_SUCCESS


def finalize() -> int:
    ret = _ready("acl.finalize", context=False)
    if ret:
        return ret
    alive = {k: v for k, v in STATE.live().items() if v}
    STATE.initialized = False
    STATE.finalized += 1
    if alive:
        return _refuse(ACL_ERROR_INVALID_PARAM, f"acl.finalize with resources alive: {alive}")
    return ACL_SUCCESS


def create_data_buffer(data: int, size: int) -> int:
    if _ready("acl.create_data_buffer", context=False):
        return 0
    h = STATE.handle()
    STATE.buffers[h] = [int(data), int(size)]
    return h


def update_data_buffer(data_buffer: int, data: int, size: int) -> int:
    ret = _ready("acl.update_data_buffer", context=False)
    if ret:
        return ret
    if data_buffer not in STATE.buffers:
        return _refuse(
            ACL_ERROR_INVALID_PARAM, f"acl.update_data_buffer on {data_buffer:#x}, not a live data buffer"
        )
    STATE.buffers[data_buffer] = [int(data), int(size)]
    return ACL_SUCCESS


def _destroy(table: dict, handle: int, what: str, code: int = ACL_ERROR_INVALID_PARAM) -> int:
    """Destroy a live handle of ``table``; a dead one is refused (and named a double destroy)."""
    ret = _ready(what, context=False)
    if ret:
        return ret
    if handle not in table:
        twice = " (destroyed twice)" if handle in STATE.dead else ""
        return _refuse(code, f"{what}({handle:#x}): not a live handle{twice}")
    del table[handle]
    STATE.dead.add(handle)
    return ACL_SUCCESS


def destroy_data_buffer(data_buffer: int) -> int:
    return _destroy(STATE.buffers, data_buffer, "acl.destroy_data_buffer")


# ---- acl.rt ---------------------------------------------------------------------------------------
def _set_device(device_id: int) -> int:
    ret = _ready("acl.rt.set_device", context=False)
    if ret:
        return ret
    STATE.devices.add(int(device_id))
    return ACL_SUCCESS


def _reset_device(device_id: int) -> int:
    ret = _ready("acl.rt.reset_device", context=False)
    if ret:
        return ret
    if int(device_id) not in STATE.devices:
        return _refuse(ACL_ERROR_RT_PARAM_INVALID, f"acl.rt.reset_device({device_id}) without set_device")
    if any(d == device_id for d in STATE.contexts.values()):
        return _refuse(ACL_ERROR_RT_PARAM_INVALID, "acl.rt.reset_device before its contexts are destroyed")
    STATE.devices.discard(int(device_id))
    return ACL_SUCCESS


def _create_context(device_id: int) -> tuple[int, int]:
    ret = _ready("acl.rt.create_context", context=False)
    if ret:
        return 0, ret
    if int(device_id) not in STATE.devices:
        return 0, _refuse(ACL_ERROR_RT_PARAM_INVALID, f"acl.rt.create_context({device_id}) before set_device")
    h = STATE.handle()
    STATE.contexts[h] = int(device_id)
    STATE.current = h
    return h, ACL_SUCCESS


def _destroy_context(context: int) -> int:
    ret = _ready("acl.rt.destroy_context", context=False)
    if ret:
        return ret
    if context not in STATE.contexts:
        return _refuse(
            ACL_ERROR_RT_PARAM_INVALID, f"acl.rt.destroy_context({context:#x}): not a live context"
        )
    if STATE.models or STATE.memory:
        return _refuse(
            ACL_ERROR_RT_PARAM_INVALID,
            f"acl.rt.destroy_context with {len(STATE.models)} model(s) and {len(STATE.memory)} allocation(s) alive",
        )
    del STATE.contexts[context]
    STATE.current = next(iter(STATE.contexts), None)
    return ACL_SUCCESS


def _malloc(size: int, policy: int) -> tuple[int, int]:
    ret = _ready("acl.rt.malloc")
    if ret:
        return 0, ret
    if int(size) <= 0:
        return 0, _refuse(ACL_ERROR_INVALID_PARAM, "acl.rt.malloc of size 0 (the page says size cannot be 0)")
    return STATE.alloc(int(size)), ACL_SUCCESS


def _free(dev_ptr: int) -> int:
    ret = _ready("acl.rt.free")
    if ret:
        return ret
    if dev_ptr not in STATE.memory:
        twice = " (freed twice)" if dev_ptr in STATE.freed else ""
        return _refuse(ACL_ERROR_INVALID_PARAM, f"acl.rt.free({dev_ptr:#x}): not an allocation{twice}")
    del STATE.memory[dev_ptr]
    STATE._bases = None
    STATE.freed.add(dev_ptr)
    return ACL_SUCCESS


def _memset(dev_ptr: int, max_size: int, value: int, count: int) -> int:
    ret = _ready("acl.rt.memset")
    if ret:
        return ret
    if count > max_size:
        return _refuse(ACL_ERROR_INVALID_PARAM, f"acl.rt.memset count {count} > max_size {max_size}")
    where = _device_range(dev_ptr, count, "acl.rt.memset")
    if where is None:
        return ACL_ERROR_INVALID_PARAM
    buf, off = where
    buf[off : off + count] = bytes([value & 0xFF]) * count
    return ACL_SUCCESS


def _memcpy(dst: int, dest_max: int, src: int, count: int, kind: int) -> int:
    ret = _ready("acl.rt.memcpy")
    if ret:
        return ret
    if kind not in _MEMCPY_KINDS:
        return _refuse(ACL_ERROR_INVALID_PARAM, f"acl.rt.memcpy kind {kind}")
    if count > dest_max:
        return _refuse(ACL_ERROR_INVALID_PARAM, f"acl.rt.memcpy count {count} > dest_max {dest_max}")
    dst_kind, src_kind = _MEMCPY_KINDS[kind]
    if count == 0:
        return ACL_SUCCESS
    if src_kind == "device":
        where = _device_range(src, count, "acl.rt.memcpy source")
        if where is None:
            return ACL_ERROR_INVALID_PARAM
        data = bytes(where[0][where[1] : where[1] + count])
    else:
        if not _host_range(src, count, "acl.rt.memcpy source"):
            return ACL_ERROR_INVALID_PARAM
        data = ctypes.string_at(src, count)
    if dst_kind == "device":
        where = _device_range(dst, count, "acl.rt.memcpy destination")
        if where is None:
            return ACL_ERROR_INVALID_PARAM
        where[0][where[1] : where[1] + count] = data
    else:
        if not _host_range(dst, count, "acl.rt.memcpy destination"):
            return ACL_ERROR_INVALID_PARAM
        ctypes.memmove(dst, data, count)
    return ACL_SUCCESS


# ---- acl.util --------------------------------------------------------------------------------------
def _numpy_to_ptr(array: np.ndarray) -> int:
    _count("acl.util.numpy_to_ptr")
    if not array.flags.c_contiguous:
        _refuse(ACL_ERROR_INVALID_PARAM, "acl.util.numpy_to_ptr of a non-contiguous array")
        return 0
    addr = int(array.ctypes.data)
    STATE.host[addr] = array  # kept alive while its address may be used
    if len(STATE.host) > 4096:
        STATE.host.pop(next(iter(STATE.host)))
    return addr


# ---- acl.mdl ---------------------------------------------------------------------------------------
class _Model:
    """A build of a compile output: its compile.json entry and its lowered graph on onnxruntime."""

    def __init__(self, root: Path, entry: dict) -> None:
        from vlmc.runtime.executors import build as runner
        from vlmc.runtime.executors import reference

        self.root, self.entry = root, entry
        self.spec = runner.BuildSpec(entry)
        self.session = reference.Session(root / entry["file"], fp16=True)
        self.inputs = [(i["name"], np.dtype(i["dtype"]), list(i["shape"])) for i in entry["inputs"]]
        self.outputs = [(o["name"], np.dtype(o["dtype"]), list(o["dims"])) for o in entry["outputs"]]
        self.gears = [list(g) for g in entry["gears"]]
        self.allowed = self.spec.allowed_dims()
        self.n_dynamic = len(self.gears[0]) if self.gears else 0
        self.cur_out: list[list[int]] | None = None
        self.points = self.spec.points()

    @property
    def num_inputs(self) -> int:
        return len(self.inputs) + (1 if self.gears else 0)

    def input_size(self, index: int) -> int:
        if index == len(self.inputs) and self.gears:
            return 8 * self.n_dynamic  # one uint64 per gear value
        name, dtype, shape = self.inputs[index]
        per_gear = []
        for dims in self.allowed:
            start = sum(len(s) for _, _, s in self.inputs[:index])
            per_gear.append(int(np.prod(dims[start : start + len(shape)], dtype=np.int64)) * dtype.itemsize)
        return max(per_gear)

    def output_size(self, index: int) -> int:
        """The output's bytes at the gear where it is largest (what the .om reports)."""
        _, dtype, dims = self.outputs[index]
        sizes = []
        for gear, values in self.points:
            if all(isinstance(d, int) or d in values for d in dims):
                sizes.append(
                    int(np.prod([d if isinstance(d, int) else values[d] for d in dims])) * dtype.itemsize
                )
            else:  # a dim no input names (image tokens of a vision graph): ATC knows it from shape inference
                sizes.append(self._traced_shapes(gear)[index] * dtype.itemsize)
        return max(sizes)

    def _traced_shapes(self, gear) -> list[int]:
        if not hasattr(self, "_traced"):
            self._traced = {}
        key = tuple(gear or ())
        if key not in self._traced:
            full = self.allowed[self.gears.index(list(gear))] if gear else self.allowed[0]
            feeds, pos = {}, 0
            for name, dtype, shape in self.inputs:
                feeds[name] = np.zeros(full[pos : pos + len(shape)], dtype)
                pos += len(shape)
            out = self.session.run(feeds)
            self._traced[key] = [int(np.prod(out[n].shape)) for n, _, _ in self.outputs]
        return self._traced[key]


def _load_from_file(model_path: str) -> tuple[int, int]:
    ret = _ready("acl.mdl.load_from_file")
    if ret:
        return 0, ret
    om = Path(model_path)
    if not om.is_file():
        return 0, _refuse(ACL_ERROR_INVALID_FILE, f"acl.mdl.load_from_file: {om} does not exist")
    root = om.parent.parent
    summary = json.loads((root / "compile.json").read_text())
    rel = f"{om.parent.name}/{om.name}"
    entry = next((b for b in summary["builds"] if b["om"] == rel), None)
    if entry is None:
        return 0, _refuse(ACL_ERROR_INVALID_FILE, f"acl.mdl.load_from_file: no build of {root} writes {rel}")
    h = STATE.handle()
    STATE.models[h] = _Model(root, entry)
    return h, ACL_SUCCESS


def _unload(model_id: int) -> int:
    ret = _ready("acl.mdl.unload")
    if ret:
        return ret
    if model_id not in STATE.models:
        return _refuse(ACL_ERROR_INVALID_MODEL_ID, f"acl.mdl.unload({model_id:#x}): not a loaded model")
    del STATE.models[model_id]
    STATE.dead.add(model_id)
    return ACL_SUCCESS


def _create_desc() -> int:
    if _ready("acl.mdl.create_desc", context=False):
        return 0
    h = STATE.handle()
    STATE.descs[h] = None
    return h


def _get_desc(model_desc: int, model_id: int) -> int:
    ret = _ready("acl.mdl.get_desc")
    if ret:
        return ret
    if model_desc not in STATE.descs or model_id not in STATE.models:
        return _refuse(ACL_ERROR_INVALID_PARAM, "acl.mdl.get_desc on a dead desc or model")
    STATE.descs[model_desc] = model_id
    return ACL_SUCCESS


def _destroy_desc(model_desc: int) -> int:
    return _destroy(STATE.descs, model_desc, "acl.mdl.destroy_desc")


def _desc_model(model_desc: int, what: str) -> _Model | None:
    if _ready(what, context=False):
        return None
    model_id = STATE.descs.get(model_desc)
    if model_id is None or model_id not in STATE.models:
        _refuse(ACL_ERROR_INVALID_PARAM, f"{what} on a desc with no live model (get_desc first)")
        return None
    return STATE.models[model_id]


def _get_num_inputs(model_desc: int) -> int:
    m = _desc_model(model_desc, "acl.mdl.get_num_inputs")
    return 0 if m is None else m.num_inputs


def _get_num_outputs(model_desc: int) -> int:
    m = _desc_model(model_desc, "acl.mdl.get_num_outputs")
    return 0 if m is None else len(m.outputs)


def _get_input_size_by_index(model_desc: int, index: int) -> int:
    m = _desc_model(model_desc, "acl.mdl.get_input_size_by_index")
    return 0 if m is None or not 0 <= index < m.num_inputs else m.input_size(index)


def _get_output_size_by_index(model_desc: int, index: int) -> int:
    m = _desc_model(model_desc, "acl.mdl.get_output_size_by_index")
    return 0 if m is None or not 0 <= index < len(m.outputs) else m.output_size(index)


def _get_input_index_by_name(model_desc: int, name: str) -> tuple[int, int]:
    m = _desc_model(model_desc, "acl.mdl.get_input_index_by_name")
    if m is None:
        return 0, ACL_ERROR_INVALID_PARAM
    names = [n for n, _, _ in m.inputs] + ([DYNAMIC_INPUT] if m.gears else [])
    if name not in names:
        return 0, _refuse(
            ACL_ERROR_INVALID_PARAM, f"acl.mdl.get_input_index_by_name: the model has no input {name}"
        )
    return names.index(name), ACL_SUCCESS


def _get_cur_output_dims(model_desc: int, index: int) -> tuple[dict, int]:
    m = _desc_model(model_desc, "acl.mdl.get_cur_output_dims")
    if m is None or not 0 <= index < len(m.outputs):
        return {}, ACL_ERROR_INVALID_PARAM
    if m.cur_out is None:
        return {}, _refuse(ACL_ERROR_INVALID_PARAM, "acl.mdl.get_cur_output_dims before any execute")
    dims = m.cur_out[index]
    return {"name": m.outputs[index][0], "dimCount": len(dims), "dims": list(dims)}, ACL_SUCCESS


def _create_dataset() -> int:
    if _ready("acl.mdl.create_dataset", context=False):
        return 0
    h = STATE.handle()
    STATE.datasets[h] = []
    return h


def _destroy_dataset(dataset: int) -> int:
    return _destroy(STATE.datasets, dataset, "acl.mdl.destroy_dataset")


def _add_dataset_buffer(dataset: int, data_buffer: int) -> tuple[int, int]:
    ret = _ready("acl.mdl.add_dataset_buffer", context=False)
    if ret:
        return dataset, ret
    if dataset not in STATE.datasets or data_buffer not in STATE.buffers:
        return dataset, _refuse(
            ACL_ERROR_INVALID_PARAM, "acl.mdl.add_dataset_buffer with a dead dataset or data buffer"
        )
    STATE.datasets[dataset].append(data_buffer)
    return dataset, ACL_SUCCESS


def _get_dataset_num_buffers(dataset: int) -> int:
    _count("acl.mdl.get_dataset_num_buffers")
    return len(STATE.datasets.get(dataset, []))


def _get_dataset_buffer(dataset: int, index: int) -> int:
    _count("acl.mdl.get_dataset_buffer")
    bufs = STATE.datasets.get(dataset, [])
    return bufs[index] if 0 <= index < len(bufs) else 0


def _set_input_dynamic_dims(model_id: int, dataset: int, index: int, dims: dict) -> int:
    ret = _ready("acl.mdl.set_input_dynamic_dims")
    if ret:
        return ret
    m = STATE.models.get(model_id)
    if m is None:
        return _refuse(ACL_ERROR_INVALID_MODEL_ID, "acl.mdl.set_input_dynamic_dims on an unloaded model")
    values = [int(v) for v in dims.get("dims", [])]
    count = int(dims.get("dimCount", -1))
    STATE.max_dim_count = max(STATE.max_dim_count, count, len(values))
    if count > ACL_MAX_DIM_CNT or len(values) > ACL_MAX_DIM_CNT:
        return _refuse(
            ACL_ERROR_STORAGE_OVER_LIMIT,
            f"set_input_dynamic_dims: dimCount {count} > ACL_MAX_DIM_CNT {ACL_MAX_DIM_CNT} (aclmdlIODims.dims)",
        )
    if count != len(values):
        return _refuse(
            ACL_ERROR_INVALID_PARAM, f"set_input_dynamic_dims: dimCount {count} but {len(values)} dims"
        )
    if not m.gears:
        return _refuse(ACL_ERROR_INVALID_PARAM, f"set_input_dynamic_dims on {m.spec.name}, a static model")
    if index != len(m.inputs):
        return _refuse(
            ACL_ERROR_INVALID_PARAM, f"set_input_dynamic_dims index {index} is not the {DYNAMIC_INPUT} input"
        )
    if values not in m.allowed:
        return _refuse(
            ACL_ERROR_INVALID_PARAM, f"set_input_dynamic_dims: {values} is no gear of {m.spec.name}"
        )
    bufs = STATE.datasets.get(dataset)
    if bufs is None or len(bufs) <= index:
        return _refuse(
            ACL_ERROR_INVALID_PARAM,
            f"set_input_dynamic_dims: the dataset has no buffer at {index} ({DYNAMIC_INPUT})",
        )
    addr, size = STATE.buffers[bufs[index]]
    gear = np.array(m.gears[m.allowed.index(values)], np.uint64)
    if size < gear.nbytes:
        return _refuse(
            ACL_ERROR_INVALID_PARAM, f"set_input_dynamic_dims: the {DYNAMIC_INPUT} buffer has {size} bytes"
        )
    where = _device_range(addr, gear.nbytes, f"{DYNAMIC_INPUT} buffer")
    if where is None:
        return ACL_ERROR_INVALID_PARAM
    where[0][where[1] : where[1] + gear.nbytes] = gear.tobytes()
    return ACL_SUCCESS


def _execute(model_id: int, input_dataset: int, output_dataset: int) -> int:
    ret = _ready("acl.mdl.execute")
    if ret:
        return ret
    m = STATE.models.get(model_id)
    if m is None:
        return _refuse(ACL_ERROR_INVALID_MODEL_ID, "acl.mdl.execute on an unloaded model")
    ins, outs = STATE.datasets.get(input_dataset), STATE.datasets.get(output_dataset)
    if ins is None or outs is None:
        return _refuse(ACL_ERROR_INVALID_PARAM, "acl.mdl.execute with a dead dataset")
    if len(ins) != m.num_inputs:
        missing = f" (no {DYNAMIC_INPUT} buffer)" if m.gears and len(ins) == len(m.inputs) else ""
        return _refuse(
            ACL_ERROR_MODEL_INPUT_NOT_MATCH,
            f"acl.mdl.execute({m.spec.name}): {len(ins)} input buffers, the model has {m.num_inputs}{missing}",
        )
    if m.gears:
        addr, size = STATE.buffers[ins[-1]]
        where = _device_range(addr, 8 * m.n_dynamic, f"{DYNAMIC_INPUT} buffer")
        if where is None:
            return ACL_ERROR_INVALID_PARAM
        gear = (
            np.frombuffer(bytes(where[0][where[1] : where[1] + 8 * m.n_dynamic]), np.uint64)
            .astype(int)
            .tolist()
        )
        if gear not in m.gears:
            return _refuse(
                ACL_ERROR_INVALID_PARAM,
                f"acl.mdl.execute({m.spec.name}): {DYNAMIC_INPUT} holds {gear}, no gear",
            )
        full = m.allowed[m.gears.index(gear)]
    else:
        full = m.allowed[0]
    feeds, pos = {}, 0
    for (name, dtype, shape), buf in zip(m.inputs, ins):
        dims = full[pos : pos + len(shape)]
        pos += len(shape)
        nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        addr, size = STATE.buffers[buf]
        if size < nbytes:
            return _refuse(
                ACL_ERROR_INVALID_PARAM,
                f"acl.mdl.execute({m.spec.name}): input {name} buffer has {size} bytes, the gear needs {nbytes}",
            )
        where = _device_range(addr, nbytes, f"input {name}")
        if where is None:
            return ACL_ERROR_INVALID_PARAM
        feeds[name] = np.frombuffer(bytes(where[0][where[1] : where[1] + nbytes]), dtype).reshape(dims)
    result = m.session.run(feeds)
    if len(outs) != len(m.outputs):
        return _refuse(
            ACL_ERROR_MODEL_OUTPUT_NOT_MATCH,
            f"acl.mdl.execute({m.spec.name}): {len(outs)} output buffers, the model has {len(m.outputs)}",
        )
    cur = []
    for (name, dtype, _), buf in zip(m.outputs, outs):
        value = np.ascontiguousarray(result[name]).astype(dtype, copy=False)
        addr, size = STATE.buffers[buf]
        if size < value.nbytes:
            return _refuse(
                ACL_ERROR_INVALID_PARAM,
                f"acl.mdl.execute({m.spec.name}): output {name} buffer has {size} bytes, needs {value.nbytes}",
            )
        where = _device_range(addr, value.nbytes, f"output {name}")
        if where is None:
            return ACL_ERROR_INVALID_PARAM
        where[0][where[1] : where[1] + value.nbytes] = value.tobytes()
        cur.append(list(value.shape))
    m.cur_out = cur
    return ACL_SUCCESS


def module() -> types.ModuleType:
    """The stand-in as an importable ``acl`` module (with ``acl.rt``, ``acl.mdl``, ``acl.util``)."""
    acl = types.ModuleType("acl")
    acl.__spec__ = importlib.machinery.ModuleSpec("acl", None)
    acl.__doc__ = __doc__
    acl.init, acl.finalize = init, finalize
    acl.create_data_buffer, acl.destroy_data_buffer = create_data_buffer, destroy_data_buffer
    acl.update_data_buffer = update_data_buffer
    acl.rt = types.SimpleNamespace(
        set_device=_set_device,
        reset_device=_reset_device,
        create_context=_create_context,
        destroy_context=_destroy_context,
        malloc=_malloc,
        free=_free,
        memset=_memset,
        memcpy=_memcpy,
    )
    acl.util = types.SimpleNamespace(numpy_to_ptr=_numpy_to_ptr)
    acl.mdl = types.SimpleNamespace(
        load_from_file=_load_from_file,
        unload=_unload,
        create_desc=_create_desc,
        get_desc=_get_desc,
        destroy_desc=_destroy_desc,
        get_num_inputs=_get_num_inputs,
        get_num_outputs=_get_num_outputs,
        get_input_size_by_index=_get_input_size_by_index,
        get_output_size_by_index=_get_output_size_by_index,
        get_input_index_by_name=_get_input_index_by_name,
        get_cur_output_dims=_get_cur_output_dims,
        create_dataset=_create_dataset,
        destroy_dataset=_destroy_dataset,
        add_dataset_buffer=_add_dataset_buffer,
        get_dataset_num_buffers=_get_dataset_num_buffers,
        get_dataset_buffer=_get_dataset_buffer,
        set_input_dynamic_dims=_set_input_dynamic_dims,
        execute=_execute,
    )
    acl.STATE = STATE
    return acl


def install(monkeypatch) -> _State:
    """Put a fresh stand-in on ``sys.modules['acl']`` for one test; returns its state."""
    STATE.reset()
    monkeypatch.setitem(sys.modules, "acl", module())
    return STATE


def placeholder_oms(root: Path) -> None:
    """An empty file where each build's .om would be: ATC never ran here, the stand-in runs the graph."""
    summary = json.loads((Path(root) / "compile.json").read_text())
    for b in summary["builds"]:
        om = Path(root) / b["om"]
        om.parent.mkdir(parents=True, exist_ok=True)
        om.write_bytes(b"")
