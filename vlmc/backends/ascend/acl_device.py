"""The .om files on a 910B through pyACL: the one module that calls the device. UNVERIFIED ON HARDWARE.

No NPU or CANN exists where vlmc is developed, so nothing here has run. The host logic around it (which
build, which gear, padding, the dims vector, the decode loop, the block allocator) is shared with the
CPU reference device and is what the tests check; this adapter only moves bytes and calls:

- ``acl.init`` / ``acl.rt.set_device`` / ``acl.rt.create_context``; ``acl.mdl.load_from_file``,
  ``acl.mdl.create_desc`` + ``acl.mdl.get_desc``; ``acl.mdl.create_dataset`` / ``acl.create_data_buffer`` /
  ``acl.mdl.add_dataset_buffer``; ``acl.mdl.execute``; ``acl.mdl.get_cur_output_dims``; ``acl.rt.malloc`` / ``acl.rt.memcpy`` with
  ``acl.util.numpy_to_ptr`` (pyACL API reference,
  e.g. https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/aclpythondevg_01_0168.html
  and its neighbouring pages);
- for a build with gears: the index of the ``ascend_mbatch_shape_data`` input from
  ``acl.mdl.get_input_index_by_name`` and ``acl.mdl.set_input_dynamic_dims(model_id, dataset, index,
  {"dimCount": n, "name": "", "dims": [...]})`` with every input's full shape (runner.dims_vector); that
  input's buffer must still be allocated (``acl.mdl.get_input_size_by_index``) and added to the dataset;
- paged pools: allocated once as torch_npu float16 tensors and bound as the build's inputs by address every
  step; each step's rows are stored with ATB ReshapeAndCache through ``torch_npu._npu_reshape_and_cache``
  (key, value, key_cache, value_cache, slot_indices), the call vllm-ascend makes, which updates both caches
  in place (ATB ReshapeAndCacheOperation, ascendtb_01_0073). ``slot_mapping < 0`` rows are dropped on the
  host first, since older CANN pages do not say negative slots are skipped (ascendtb_01_0242).

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
    """One paged KV pool in device memory (a torch_npu tensor); rows are stored by ReshapeAndCache.

    Key and value rows of a layer arrive separately (PagedKV.update writes pool by pool); the write runs
    once both are there, since ReshapeAndCache stores a layer's key and value in one call.
    """

    def __init__(self, device: AclDevice, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        import torch

        self.device, self.name, self.shape, self.dtype = device, name, tuple(shape), np.dtype(dtype)
        if self.dtype != np.float16:
            raise VlmcError(f"{name}: device pools are float16 (ReshapeAndCache), not {self.dtype}")
        self.tensor = torch.zeros(self.shape, dtype=torch.float16, device=f"npu:{device.device_id}")
        self.kind, self.layer = name.split("_cache.")

    @property
    def ptr(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel() * self.tensor.element_size())

    def write(self, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
        self.device._stage(self, rows, slot_mapping)


class AclDevice:
    """Loads each build's .om and executes it with host feeds and device-resident pools."""

    def __init__(self, device_id: int = 0) -> None:
        if not available():
            raise VlmcError(
                "pyACL (acl) does not import here: install the CANN toolkit and source set_env.sh, or run "
                "--executor reference"
            )
        import acl

        self.acl = acl
        self.device_id = int(device_id)
        ret = acl.init()
        # A tensor-parallel rank imports torch_npu (the hccl collective) first, which may have run aclInit
        # already: ACL_ERROR_REPEAT_INITIALIZE is then not an error (torch_npu treats it the same way the
        # other way round, torch_npu/csrc/core/npu/sys_ctrl/npu_sys_ctrl.cpp).
        if ret != ACL_ERROR_REPEAT_INITIALIZE:
            _check(ret, "acl.init")
        _check(acl.rt.set_device(self.device_id), "acl.rt.set_device")
        self.context, ret = acl.rt.create_context(self.device_id)
        _check(ret, "acl.rt.create_context")
        self.models: dict[str, tuple[int, object]] = {}  # build -> (model id, desc)
        self.pools: dict[str, DevicePool] = {}
        self._pending: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}

    # ---- builds --------------------------------------------------------------------------
    def load(self, build, root: Path) -> None:
        om = (root / build.om).resolve()
        if not om.is_file():
            raise VlmcError(f"{build.name}: {om} is missing; run build.sh on a CANN host first")
        model_id, ret = self.acl.mdl.load_from_file(str(om))
        _check(ret, f"acl.mdl.load_from_file({om.name})")
        desc = self.acl.mdl.create_desc()
        _check(self.acl.mdl.get_desc(desc, model_id), "acl.mdl.get_desc")
        self.models[build.name] = (model_id, desc)

    def execute(self, build, feeds: dict[str, object], dims: list[int] | None) -> dict[str, np.ndarray]:
        acl = self.acl
        model_id, desc = self.models[build.name]
        inputs = acl.mdl.create_dataset()
        owned: list[int] = []  # device buffers to free after the run
        try:
            for value in feeds.values():
                if isinstance(value, DevicePool):
                    ptr, size = value.ptr, value.nbytes
                else:
                    host = np.ascontiguousarray(value)
                    ptr, size = self._to_device(host), host.nbytes
                    owned.append(ptr)
                _, ret = acl.mdl.add_dataset_buffer(inputs, acl.create_data_buffer(ptr, size))
                _check(ret, "acl.mdl.add_dataset_buffer")
            if dims is not None:
                index, ret = acl.mdl.get_input_index_by_name(desc, DYNAMIC_INPUT)
                _check(ret, f"acl.mdl.get_input_index_by_name({DYNAMIC_INPUT})")
                size = acl.mdl.get_input_size_by_index(desc, index)
                ptr, ret = acl.rt.malloc(size, _MALLOC_HUGE_FIRST)
                _check(ret, "acl.rt.malloc")
                owned.append(ptr)
                _, ret = acl.mdl.add_dataset_buffer(inputs, acl.create_data_buffer(ptr, size))
                _check(ret, "acl.mdl.add_dataset_buffer")
                spec = {"dimCount": len(dims), "name": "", "dims": [int(d) for d in dims]}
                _check(
                    acl.mdl.set_input_dynamic_dims(model_id, inputs, index, spec),
                    "acl.mdl.set_input_dynamic_dims",
                )
            outputs = acl.mdl.create_dataset()
            sizes = [acl.mdl.get_output_size_by_index(desc, i) for i in range(len(build.outputs))]
            out_ptrs = []
            for size in sizes:
                ptr, ret = acl.rt.malloc(size, _MALLOC_HUGE_FIRST)
                _check(ret, "acl.rt.malloc")
                owned.append(ptr)
                out_ptrs.append(ptr)
                _, ret = acl.mdl.add_dataset_buffer(outputs, acl.create_data_buffer(ptr, size))
                _check(ret, "acl.mdl.add_dataset_buffer")
            _check(acl.mdl.execute(model_id, inputs, outputs), f"acl.mdl.execute({build.name})")
            result = {}
            for i, spec in enumerate(build.outputs):
                cur, ret = acl.mdl.get_cur_output_dims(desc, i)
                _check(ret, "acl.mdl.get_cur_output_dims")
                shape = [int(d) for d in cur["dims"][: cur["dimCount"]]]
                result[spec["name"]] = self._to_host(out_ptrs[i], shape, np.dtype(spec["dtype"]))
            return result
        finally:
            for ptr in owned:
                acl.rt.free(ptr)

    def _to_device(self, host: np.ndarray) -> int:
        acl = self.acl
        ptr, ret = acl.rt.malloc(max(host.nbytes, 1), _MALLOC_HUGE_FIRST)
        _check(ret, "acl.rt.malloc")
        src = acl.util.numpy_to_ptr(host)
        _check(acl.rt.memcpy(ptr, host.nbytes, src, host.nbytes, _MEMCPY_HOST_TO_DEVICE), "acl.rt.memcpy")
        return ptr

    def _to_host(self, ptr: int, shape: list[int], dtype: np.dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        dst = self.acl.util.numpy_to_ptr(out)
        _check(self.acl.rt.memcpy(dst, out.nbytes, ptr, out.nbytes, _MEMCPY_DEVICE_TO_HOST), "acl.rt.memcpy")
        return out

    # ---- paged pools -----------------------------------------------------------------------
    def new_pool(self, name: str, shape: tuple[int, ...], dtype) -> DevicePool:
        pool = DevicePool(self, name, shape, dtype)
        self.pools[name] = pool
        return pool

    def _stage(self, pool: DevicePool, rows: np.ndarray, slots: np.ndarray) -> None:
        layer = self._pending.setdefault(pool.layer, {})
        layer[pool.kind] = (rows, slots)
        if len(layer) == 2:
            (k_rows, k_slots), (v_rows, _) = layer["key"], layer["value"]
            del self._pending[pool.layer]
            self._reshape_and_cache(pool.layer, k_rows, v_rows, k_slots)

    def _reshape_and_cache(
        self, layer: str, k_rows: np.ndarray, v_rows: np.ndarray, slots: np.ndarray
    ) -> None:
        import torch
        import torch_npu

        flat = np.asarray(slots).reshape(-1)
        live = flat >= 0  # padding rows are dropped here rather than relying on negative-slot skipping
        heads, dim = k_rows.shape[2], k_rows.shape[3]
        dev = f"npu:{self.device_id}"
        key = torch.from_numpy(k_rows.reshape(-1, heads, dim)[live].astype(np.float16)).to(dev)
        value = torch.from_numpy(v_rows.reshape(-1, heads, dim)[live].astype(np.float16)).to(dev)
        slot = torch.from_numpy(flat[live].astype(np.int32)).to(dev)
        torch_npu._npu_reshape_and_cache(
            key=key,
            value=value,
            key_cache=self.pools[f"key_cache.{layer}"].tensor,
            value_cache=self.pools[f"value_cache.{layer}"].tensor,
            slot_indices=slot,
        )

    def close(self) -> None:
        for model_id, desc in self.models.values():
            self.acl.mdl.destroy_desc(desc)
            self.acl.mdl.unload(model_id)
        self.models.clear()
        self.pools.clear()
        self.acl.rt.destroy_context(self.context)
        self.acl.rt.reset_device(self.device_id)
        self.acl.finalize()
