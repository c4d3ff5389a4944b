"""The collective that joins the ranks of a tensor-parallel run: one seam, chosen from the executor.

A rank runs its segments, then a sum all-reduce of the segment's partial output over every rank, then
the next segment (the host plan, docs/tensor_parallel.md). Which library does the all-reduce depends
only on where the segments run:

- ``ort`` (a package on onnxruntime) and ``reference`` (a compile output's lowered graphs on CPU):
  torch.distributed with the **gloo** backend, over TCP on this host's loopback address. Verified here.
- ``acl`` (the ``.om`` files on 910B cards): torch.distributed with torch_npu's **hccl** backend, which
  calls ``HcclAllReduce`` (hicann/hccl ``include/hccl.h``: ``HcclAllReduce(void *sendBuf, void *recvBuf,
  uint64_t count, HcclDataType dataType, HcclReduceOp op, HcclComm comm, aclrtStream stream)``; A2 takes
  int8/int16/int32/fp16/fp32/bf16 with sum). UNVERIFIED: no NPU exists where vlmc is developed.

What the hccl path relies on, read in Ascend/pytorch (torch_npu) at commit 9e73e708a:

- ``import torch_npu`` registers the backend: ``torch_npu/_init/registry/distributed.py``
  ``register_distributed_backend_for_npu`` calls ``torch.distributed.Backend.register_backend("hccl",
  ..., extended_api=True, devices=["npu"])``, which builds ``torch_npu._C._distributed_c10d.ProcessGroupHCCL``.
  Without that import ``init_process_group("hccl")`` does not know the name.
- The rank's device is the device of the tensors it reduces (``ProcessGroupHCCL::allreduce`` ->
  ``collective`` over ``tensors[0]``'s device), so the rank calls ``torch.npu.set_device`` first and moves
  each partial to ``npu:<device>``; torch_npu reads no ``ASCEND_DEVICE_ID`` (only
  ``ASCEND_RT_VISIBLE_DEVICES``, torch_npu/npu/__init__.py). vlmc takes the device from the build's
  ``rank_table.json`` (the entry whose ``rank_id`` is the rank).
- Dtypes: ``kScalarTypeToHcclDataType`` (torch_npu/csrc/distributed/HCCLUtils.cpp) maps Half/Float/BFloat16
  to HCCL_DATA_TYPE_FP16/FP32/BFP16, and ``checkSupportedDataType`` (ProcessGroupHCCL.cpp) accepts
  int8/int16/int32/int64/fp16/fp32/bf16 for allreduce; the segment outputs vlmc reduces are fp32 or fp16.
- Rendezvous: with ``RANK_TABLE_FILE`` unset (``OptionsManager::GetRankTableFilePath``) torch_npu makes
  the communicator from a root info that rank 0 gets with ``HcclGetRootInfo`` and shares through the
  c10d store (``ProcessGroupHCCL::broadcastMasterID``), i.e. the same ``tcp://`` init method gloo uses
  here. With ``RANK_TABLE_FILE`` set to a readable, complete rank table it uses
  ``HcclCommInitClusterInfoConfig`` instead (``createHCCLCommEx``) and warns unless
  ``HCCL_CONNECT_TIMEOUT`` >= 300. vlmc's ``rank_table.json`` is a template (no device IPs), so vlmc does
  not set ``RANK_TABLE_FILE`` itself; a user's own environment is passed through.
- ``HCCL_EXEC_TIMEOUT`` / ``HCCL_CONNECT_TIMEOUT`` are read by torch_npu (OptionsManager.cpp) from the
  environment the ranks inherit.

Where the ranks meet (:class:`Rendezvous`, docs/security.md "Tensor-parallel ranks"): a torch.distributed
``FileStore`` in a directory only this user can open (``tempfile.mkdtemp``, mode 0700), under a
``PrefixStore`` whose prefix is a per-run secret the parent hands each rank over its pipe. Nothing listens
for the rendezvous, so no one can join it over the network; gloo's own sockets are bound to one address,
127.0.0.1 unless ``VLMC_TP_ADDRESS`` names another (a gloo device made with
``ProcessGroupGloo.create_device(hostname=...)``, not the default device, which binds the address the
machine's host name resolves to). Every all-reduce has a timeout (``VLMC_TP_TIMEOUT`` seconds, default
:data:`COLLECTIVE_TIMEOUT_S`): a rank whose peer died or stopped raises :class:`PeerLost` instead of
waiting for ever. Stores and options: https://pytorch.org/docs/stable/distributed.html

This module imports no torch at import time: the seam's choice (:func:`for_executor`) and its
one-line refusals work without it.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
import ipaddress
import logging
import os
import socket
from datetime import timedelta

import numpy as np

from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# A rank waits this long in one all-reduce for the others before it gives up (a dead or stopped peer).
# The ranks run in lockstep, so the wait is the skew between them, not a segment's compute time.
COLLECTIVE_TIMEOUT_S = 30.0
TIMEOUT_ENV = "VLMC_TP_TIMEOUT"
# How long forming the group may take (every rank opening the store and connecting to the others).
START_TIMEOUT_S = 300.0
# The address gloo's sockets bind; another than loopback only when the user names it (docs/security.md).
ADDRESS_ENV = "VLMC_TP_ADDRESS"
LOOPBACK = "127.0.0.1"

NEEDS_TORCH = (
    "running a tensor-parallel package on CPU needs torch (torch.distributed with the gloo backend joins "
    "the ranks); install the export extra: pip install 'vlmc[export]'"
)


class PeerLost(VlmcError):
    """A collective failed because another rank went away (closed its connection) or stopped answering."""


def collective_timeout() -> float:
    """Seconds one all-reduce may wait: ``VLMC_TP_TIMEOUT``, or :data:`COLLECTIVE_TIMEOUT_S`."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return COLLECTIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 24 * 3600:  # also refuses nan
        raise VlmcError(f"{TIMEOUT_ENV}={raw[:40]!r}: give the all-reduce timeout in seconds, above 0")
    return value


def bind_address() -> str:
    """The address the ranks' sockets bind: 127.0.0.1, or ``VLMC_TP_ADDRESS`` checked to be this machine's."""
    raw = os.environ.get(ADDRESS_ENV, "").strip() or LOOPBACK
    try:
        address = ipaddress.ip_address(raw)
    except ValueError:
        raise VlmcError(f"{ADDRESS_ENV}={raw[:64]!r} is not an IP address") from None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(address), 0))
    except OSError as exc:
        raise VlmcError(f"{ADDRESS_ENV}={address}: cannot bind it here ({exc.strerror or exc})") from None
    if not address.is_loopback:
        logger.warning(
            "%s=%s: the ranks' gloo sockets listen on %s; anyone who can reach it can open a connection "
            "to them, and the tensors between ranks cross it unencrypted",
            ADDRESS_ENV,
            address,
            address,
        )
    return str(address)


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one run meet (see the module docstring); made by the parent, sent to every rank."""

    store: str  # the FileStore's file, inside a directory only this user can open
    secret: str  # the PrefixStore prefix every key of this run carries
    address: str = LOOPBACK  # what gloo's sockets bind
    timeout: float = COLLECTIVE_TIMEOUT_S  # seconds one all-reduce may wait
    start_timeout: float = START_TIMEOUT_S  # seconds forming the group may take

    def open_store(self, size: int):
        """The run's store, in a rank's process."""
        import torch.distributed as dist

        store = dist.FileStore(self.store, size)
        store.set_timeout(timedelta(seconds=self.start_timeout))
        return dist.PrefixStore(self.secret, store)


class Collective(abc.ABC):
    """A sum all-reduce across the ranks of one run, numpy in, numpy out.

    ``check()`` runs in the launching process before any rank starts and raises a one-line
    :class:`VlmcError` naming what is missing; ``join`` runs in each rank's process; ``all_reduce``
    between segments; ``close`` at the end.
    """

    backend: str = ""
    modules: tuple[str, ...] = ()  # what must import for this collective (named in the refusal)

    def missing(self) -> list[str]:
        """The modules of :attr:`modules` that do not import here (found without importing them)."""
        out = []
        for name in self.modules:
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):  # a parent package that is missing or blocked
                found = False
            if not found:
                out.append(name)
        return out

    @abc.abstractmethod
    def check(self) -> None:
        """See the class docstring."""

    @abc.abstractmethod
    def join(self, rank: int, size: int, rendezvous: Rendezvous, device_id: int | None) -> None:
        """See the class docstring."""

    @abc.abstractmethod
    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """See the class docstring."""

    def backend_in_use(self) -> str:
        """The backend torch.distributed reports for the default group (what actually joined the ranks)."""
        import torch.distributed as dist

        return str(dist.get_backend())

    def close(self) -> None:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # the group may never have formed
            pass


def require_torch():
    """torch.distributed with gloo, or a one-line VlmcError saying why it is needed."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise VlmcError(NEEDS_TORCH) from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise VlmcError("this torch build has no gloo backend, which the tensor-parallel CPU runtime needs")
    return dist


class Gloo(Collective):
    """torch.distributed's gloo backend over TCP on this host: the CPU collective (ort, reference)."""

    backend = "gloo"
    modules = ("torch",)

    def check(self) -> None:
        # Found, not imported: the parent never imports torch (seconds, and a Ctrl-C inside a C extension's
        # import aborts the interpreter). Each rank imports it and checks for gloo when it joins.
        if self.missing():
            raise VlmcError(NEEDS_TORCH)

    def join(self, rank: int, size: int, rendezvous: Rendezvous, device_id: int | None) -> None:
        dist = require_torch()
        import torch

        torch.set_num_threads(1)
        options = dist.ProcessGroupGloo._Options()
        # One device on the named address: gloo's default device binds whatever the host name resolves to.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=rendezvous.address)]
        options._timeout = timedelta(seconds=rendezvous.start_timeout)
        self._group = dist.ProcessGroupGloo(rendezvous.open_store(size), rank, size, options)
        self._reduce = dist.AllreduceOptions()
        self._reduce.reduceOp = dist.ReduceOp.SUM
        self._reduce.timeout = timedelta(seconds=rendezvous.timeout)  # every all-reduce, not only the start
        self._timeout = rendezvous.timeout
        self._torch = torch

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        t = self._torch.from_numpy(np.ascontiguousarray(x).copy())
        try:
            self._group.allreduce([t], self._reduce).wait()
        except RuntimeError as exc:  # gloo's C++ text: kept for -v, replaced by what it means
            logger.debug("gloo all-reduce: %s", exc)
            if "Timed out" in str(exc):
                raise PeerLost(f"an all-reduce waited {self._timeout:g} s for the other ranks") from None
            raise PeerLost("another rank closed its connection during an all-reduce") from None
        return t.numpy()

    def barrier(self) -> None:
        """Wait for every rank (an all-reduce of one number, under the same timeout)."""
        self.all_reduce(np.zeros(1, np.float32))

    def backend_in_use(self) -> str:
        """What the rank's process group runs (gloo's own name for itself)."""
        return str(self._group.name())

    def close(self) -> None:
        self._group = None


# The dtypes torch_npu's ProcessGroupHCCL all-reduces (checkSupportedDataType) that a segment can output.
HCCL_DTYPES = ("float16", "float32")


class Hccl(Collective):
    """torch_npu's hccl backend (HcclAllReduce on the cards): the collective of ``--executor acl``.

    UNVERIFIED ON HARDWARE. Each partial is copied to the rank's card, reduced there and copied back,
    because the build executor hands the host numpy outputs; a device-resident hand-off (the .om's
    output buffer straight into HcclAllReduce) is left for when a 910B is at hand.
    """

    backend = "hccl"
    modules = ("torch", "torch_npu")

    def check(self) -> None:
        absent = self.missing()
        if absent:
            raise VlmcError(
                f"--executor acl joins the ranks with torch_npu's hccl backend, but {' and '.join(absent)} "
                "does not import here: install the torch_npu that matches the CANN toolkit (Ascend/pytorch), "
                "or run --executor reference (gloo on CPU)"
            )

    def join(self, rank: int, size: int, rendezvous: Rendezvous, device_id: int | None) -> None:
        self.check()
        import torch
        import torch.distributed as dist
        import torch_npu  # noqa: F401  registers the "hccl" backend with torch.distributed

        self.device_id = int(device_id or 0)
        torch.npu.set_device(self.device_id)
        dist.init_process_group(
            "hccl",
            store=rendezvous.open_store(size),
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=rendezvous.timeout),
        )
        self._dist, self._torch = dist, torch

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        if x.dtype.name not in HCCL_DTYPES:
            raise VlmcError(
                f"HcclAllReduce of a {x.dtype} tensor: vlmc reduces only {', '.join(HCCL_DTYPES)}"
            )
        host = np.require(x, requirements=["C", "W"])  # torch.from_numpy wants a writable array
        t = self._torch.from_numpy(host).to(f"npu:{self.device_id}")
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM)
        return t.cpu().numpy()


# What runs the segments -> the collective between them. ``ort``: a package on onnxruntime.
COLLECTIVES: dict[str, type[Collective]] = {"ort": Gloo, "reference": Gloo, "acl": Hccl}


def for_executor(executor: str) -> Collective:
    """The collective for the executor that runs the segments (see :data:`COLLECTIVES`)."""
    try:
        return COLLECTIVES[executor]()
    except KeyError:
        raise VlmcError(
            f"no collective for executor {executor!r}; choose one of {', '.join(sorted(COLLECTIVES))}"
        ) from None
