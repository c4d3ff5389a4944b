"""Run a compile output: map each graph run of the generation loop onto a build and a gear, on a device.

The loop is the runtime's (vlmc/runtime/pipeline.py). :class:`BuildExecutor` is its executor for a
``vlmc compile`` output: for every graph run it picks the build of that graph and the smallest gear
that holds the real shapes, pads the feeds up to the gear, runs the build on a *device* and strips the
padding off the outputs. The device is :class:`vlmc.runtime.executors.reference.ReferenceDevice` (the lowered graphs on CPU, strict about
shapes and dtypes) or :class:`vlmc.runtime.executors.acl.AclDevice` (the .om files through pyACL on a 910B).

Everything here reads compile.json (``builds[*].inputs/outputs/gears/gear_symbols/bindings``), never the
package's graphs: what the host does is decided by the build's declared IO.

Padding keeps the outputs' real part exact, the way the runtime already pads a batch:
- sequence axes (``sequence``, ``past_sequence``, ``total_sequence``) are padded on the left, with
  attention_mask 0, slot_mapping -1 (a padding slot: masked and never stored, docs/paged_kv.md),
  input_ids the pad token and zeros elsewhere; outputs lose the same leading positions;
- ``batch`` and ``images`` are padded at the end with copies of the first row (independent rows that
  are dropped from the outputs);
- ``max_blocks`` (block_tables) is padded with the null block 0, which the mask never reads;
- the dims compile.json ``resolution.row_padded`` names (anyres' ``image_tokens``: each output token is
  its own gather) are padded like ``batch``.
Any other dim (``num_blocks``, ``patches``, static dims) must match exactly: the runtime's preprocessing
fits images to the resolution gears first (vlmc.runtime.preprocess.fit_to_gears).
"""

from __future__ import annotations

import logging
import operator
import os
import stat
from itertools import repeat
from pathlib import Path
from typing import Protocol

import numpy as np

from vlmc import compile_schema, interop, limits, metrics, parsing, paths, tensor_names
from vlmc import manifest as manifest_io
from vlmc.errors import VlmcError
from vlmc.outdir import BUILD_MARKER
from vlmc.package import Package
from vlmc.runtime import paged
from vlmc.runtime.executors import acl
from vlmc.runtime.executors.reference import ReferenceDevice

logger = logging.getLogger(__name__)

LEFT_PADDED = ("sequence", "past_sequence", "total_sequence")
ROW_PADDED = ("batch", "images")
NULL_PADDED = ("max_blocks",)
_FILL = {"attention_mask": 0, "slot_mapping": -1}
EXECUTORS = ("acl", "reference")


def dims_vector(input_shape: list[tuple[str, list[int]]], gear: list[int]) -> list[int]:
    """The dims aclmdlSetInputDynamicDims takes for one gear: every input's full shape, concatenated.

    ``input_shape`` is ``[(name, dims)]``, an ATC ``--input_shape`` with -1 for each dynamic dim. The
    gear's values replace the -1 entries in order. For ``data:1,1,40,-1;label:1,-1;mask:-1,-1``
    and the gear ``20,20,1,1`` that is ``[1,1,40,20, 1,20, 1,1]``, 8 dims (the aclmdlSetInputDynamicDims
    page, https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/aclcppdevg_03_0312.html,
    and pyACL's ``acl.mdl.set_input_dynamic_dims``, aclpythondevg_01_0168).

    Raises:
        VlmcError: the gear has more or fewer values than the shape has -1 entries.
    """
    values = list(gear)
    n_dynamic = sum(1 for _, dims in input_shape for d in dims if d == -1)
    if len(values) != n_dynamic:
        raise VlmcError(
            f"gear {values} has {len(values)} values but the input shape has {n_dynamic} -1 entries"
        )
    it = iter(values)
    return [next(it) if d == -1 else int(d) for _, dims in input_shape for d in dims]


class BuildSpec:
    """One build as compile.json describes it (its runner facts)."""

    def __init__(self, entry: dict) -> None:
        self.name: str = entry["name"]
        self.graph: str = entry["graph"]
        self.variant: str = entry["variant"]
        self.file: str = entry["file"]
        self.om: str = entry["om"]
        self.inputs: list[dict] = entry["inputs"]
        self.outputs: list[dict] = entry["outputs"]
        self.gears: list[list[int]] = entry["gears"]
        self.gear_symbols: list[str] = entry["gear_symbols"]
        self.bindings: dict[str, list[int]] = entry["bindings"]
        # Facts the host loop asks every step, worked out once (compile.json does not change under a run).
        self.input_shape: list[tuple[str, list[int]]] = [(i["name"], list(i["shape"])) for i in self.inputs]
        self.input_names = frozenset(i["name"] for i in self.inputs)
        self._dims: dict[tuple[int, ...], list[int]] = {}
        self._points: list | None = None
        # The gear symbol of each rolled stacked present's past axis (stack_kv.py; BuildExecutor._fit).
        self.rolled = [
            o["dims"][tensor_names.ROLLED_AXIS + 1]
            for o in self.outputs
            if tensor_names.is_stacked_output(o["name"])
            and tensor_names.rolled_input(o["name"]) in self.input_names
        ]
        # Per input: (name, declared dims, rank, its symbolic axes [(axis, symbol)]) for _fit and _pad.
        self.in_facts = [
            (
                i["name"],
                i["dims"],
                len(i["dims"]),
                [(a, d) for a, d in enumerate(i["dims"]) if not isinstance(d, int)],
            )
            for i in self.inputs
        ]
        # Per output: (name, dims, stacked layer axis or None, rolled, per-layer member names) for run().
        self.out_facts = []
        for o in self.outputs:
            name, dims = o["name"], o["dims"]
            if not tensor_names.is_stacked_output(name):
                self.out_facts.append((name, dims, None, False, None))
                continue
            axis = tensor_names.layer_axis(name)
            rolled = tensor_names.rolled_input(name) in self.input_names
            self.out_facts.append(
                (name, dims, axis, rolled, tensor_names.output_members(name, int(dims[axis])))
            )
        # BuildExecutor._fit's results by the feeds' shapes: a paged decode step at batch 1 mostly repeats
        # the last one's.
        self.fits: dict[tuple, object] = {}

    def dims(self, gear: list[int]) -> list[int]:
        """:func:`dims_vector` of this build at ``gear``, computed once per gear (the caller must not change it)."""
        key = tuple(gear)
        if key not in self._dims:
            self._dims[key] = dims_vector(self.input_shape, gear)
        return self._dims[key]

    def points(self) -> list[tuple[list[int] | None, dict[str, int]]]:
        """Every shape the build takes: (gear or None for a static build, symbol -> value); one list,
        made once, that callers read and do not change."""
        if self._points is None:
            static = {s: v[0] for s, v in self.bindings.items() if len(v) == 1}
            if not self.gears:
                self._points = [(None, static)]
            else:
                self._points = [
                    (gear, {**static, **dict(zip(self.gear_symbols, gear))}) for gear in self.gears
                ]
        return self._points

    def allowed_dims(self) -> list[list[int]]:
        """The full dims vector of every gear (one entry, the static shape, for a static build)."""
        if not self.gears:
            return [[d for _, dims in self.input_shape for d in dims]]
        return [self.dims(g) for g in self.gears]


class Device(Protocol):
    """Runs builds: ``load`` once per build, then ``execute`` with the feeds of exactly one gear."""

    def load(self, build: BuildSpec, root: Path) -> None: ...

    def execute(
        self, build: BuildSpec, feeds: dict[str, object], dims: list[int] | None
    ) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class PoolLayer:
    """One layer of a stacked pool (stack_kv.py): the per-layer pool PagedKV holds and writes, while the
    build binds the whole stack. ``parent`` is a :class:`HostPool` or an ``acl.DevicePool``."""

    def __init__(self, parent, layer: int) -> None:
        self.parent, self.layer = parent, int(layer)
        self.axis = tensor_names.layer_axis(parent.name)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.parent.shape)
        return shape[: self.axis] + shape[self.axis + 1 :]

    @property
    def dtype(self) -> np.dtype:
        return self.parent.dtype

    def write(self, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
        self.parent.write_layer(self.layer, rows, slot_mapping)


class DeviceStack:
    """A stacked KV output the device kept (``acl.DeviceOutput``, its buffer at the executed gear)
    and the real part of it: ``shape`` is the real stacked shape, the padding being where the runner puts
    it (sequence axes on the left, rows at the end). Fed back as a stacked input, it is bound on the device
    when its buffer already has the input's layout at the chosen gear, else brought to the host once."""

    def __init__(self, handle, shape: tuple[int, ...], dims: list, axis: int) -> None:
        self.handle, self.shape, self.dims, self.axis = handle, tuple(shape), list(dims), axis
        self.dtype = handle.dtype
        self.layer_shape = self.shape[:axis] + self.shape[axis + 1 :]  # each OutputLayer's
        self._rows = None
        self.views: list[OutputLayer] = []  # its OutputLayers in layer order (paged.layers_of reads them)

    def to_host(self) -> np.ndarray:
        """The real part, on the host (one device-to-host copy of the buffer)."""
        return _take_real(self.handle.to_host(), self.dims, self.shape)

    def row_index(self) -> list[int]:
        """For stacked rows [batch, sequence, layers, ...]: the buffer row (of its first two axes
        flattened) of each real (batch, sequence) position, in row-major order. A Python list: a decode
        step has a few positions, for which numpy's per-call cost is most of the work."""
        if self._rows is None:
            gs, (b, n) = self.handle.shape[1], self.shape[:2]
            start = gs - n if self.dims[1] in LEFT_PADDED else 0
            self._rows = [r * gs + start + k for r in range(b) for k in range(n)]
        return self._rows


class OutputLayer:
    """Layer ``layer`` of a :class:`DeviceStack`: what the loop holds as ``present.{i}.*`` / ``new_*.{i}``."""

    __slots__ = ("parent", "layer")  # 2 x layers of them per step: made and read as cheaply as can be

    def __init__(self, parent: DeviceStack, layer: int) -> None:
        self.parent, self.layer = parent, layer  # one per layer and step: nothing else worked out here

    @property
    def shape(self) -> tuple[int, ...]:
        return self.parent.layer_shape

    @property
    def dtype(self) -> np.dtype:
        return self.parent.dtype

    def __array__(self, dtype=None, copy=None):
        arr = np.take(self.parent.to_host(), self.layer, axis=self.parent.axis)
        return arr if dtype is None else arr.astype(dtype)


class BuildExecutor:
    """The executor of a compile output (:class:`vlmc.runtime.executors.ort.Executor`): graph runs -> builds and gears."""

    def __init__(self, root: Path, summary: dict, device: Device, pad_token_id: int = 0) -> None:
        self.root = Path(root)
        self.device = device
        self.pad_token_id = int(pad_token_id)
        self.builds: dict[str, list[BuildSpec]] = {}
        for entry in summary["builds"]:
            if "inputs" not in entry:
                raise VlmcError(
                    f"{root}: compile.json has no runner facts (builds[].inputs); re-run `vlmc compile` with this vlmc"
                )
            spec = BuildSpec(entry)
            self.builds.setdefault(spec.graph, []).append(spec)
        self._loaded: set[str] = set()
        # Dims padded by rows: batch and images, and the resolution gears compile.json says are (anyres'
        # image_tokens: each output token is its own gather, so copied rows change no real one).
        # ``unpadded`` names the ones a kind forbids (anyres' images: the newline row would move).
        resolution = summary.get("resolution") or {}
        self.row_padded = tuple(
            s
            for s in ROW_PADDED + tuple(resolution.get("row_padded") or ())
            if s not in (resolution.get("unpadded") or ())
        )
        self._paddable = frozenset(LEFT_PADDED + self.row_padded + NULL_PADDED)
        self.runs: dict[str, int] = {}  # build -> executions (the CLI reports it)
        # Stacked KV inputs (stack_kv.py) of each graph: stacked name -> layers.
        self._stacked: dict[str, dict[str, int]] = {
            graph: {
                i["name"]: int(i["shape"][tensor_names.layer_axis(i["name"])])
                for b in builds
                for i in b.inputs
                if tensor_names.is_stacked(i["name"])
            }
            for graph, builds in self.builds.items()
        }
        self._stack_pools: dict[str, object] = {}
        self._inputs: dict[str, list[dict]] = {}  # graph -> inputs(graph)
        # graph -> every input name any of its builds declares (_fit)
        self._graph_inputs = {
            g: frozenset().union(*(b.input_names for b in bs)) for g, bs in self.builds.items()
        }
        # stacked input -> its per-layer member names, stacked output -> its members (_stack, run)
        self._members: dict[tuple[str, int], list[str]] = {}
        self._member_sets: dict[tuple[str, int], frozenset[str]] = {}
        self._fit_names: dict[str, list[str]] = {}  # build -> the feeds whose shapes _fit reads
        # stacked input -> (its device pool, the PoolLayers _new_pool made of it, by layer), for _stack
        self._pool_views: dict[str, tuple[object, list]] = {}
        self._binds = getattr(device, "binds", None)  # the device keeps stacked outputs (acl.AclDevice)
        # Paged pools kept by the device (device memory on an NPU); absent for the reference device.
        self._device_pool = getattr(device, "new_pool", None)
        self.new_pool = self._new_pool if self._device_pool is not None else None

    # ---- Executor protocol ------------------------------------------------------------------
    def inputs(self, graph: str) -> list[dict]:
        """The inputs of the graph's widest build (a contiguous prefill build takes no past); one list per
        graph, made at the first call (the loop asks every step), which callers read and do not change."""
        if graph in self._inputs:
            return self._inputs[graph]
        builds = self._builds(graph)
        widest = max(builds, key=lambda b: len(b.inputs))
        out = []
        for i in widest.inputs:
            layers = self._stacked[graph].get(i["name"])
            names = [i["name"]] if layers is None else tensor_names.stack_members(i["name"], layers)
            out += [{"name": n, "dtype": i["dtype"]} for n in names]  # the graph's own per-layer names
        self._inputs[graph] = out
        return out

    def _new_pool(self, name: str, shape: tuple[int, ...], dtype):
        """A pool the device holds; a layer of a stacked pool when the builds take the pools stacked."""
        key = tensor_names.stack_group(name)
        layers = next((s[key[0]] for s in self._stacked.values() if key and key[0] in s), None)
        if layers is None or key[1] >= layers:  # not a layer of a stacked input (a later segment's own)
            return self._device_pool(name, shape, dtype)
        stacked, layer = key
        if layer == 0 or stacked not in self._stack_pools:  # layer 0 opens a new generation's pools
            axis = tensor_names.layer_axis(stacked)
            full = (*shape[:axis], layers, *shape[axis:])
            self._stack_pools[stacked] = self._device_pool(stacked, full, dtype)
            self._pool_views[stacked] = (self._stack_pools[stacked], [None] * layers)
        view = PoolLayer(self._stack_pools[stacked], layer)
        self._pool_views[stacked][1][layer] = view
        return view

    def _stack(self, graph: str, feeds: dict[str, object]) -> dict[str, object]:
        """The feeds with each group of per-layer KV inputs as the stacked input the builds take."""
        stacked = self._stacked.get(graph)
        if not stacked:
            return feeds
        out = dict(feeds)
        for name, layers in stacked.items():
            members = self._member_names(name, layers)
            if not feeds.keys() >= self._member_sets[(name, layers)]:
                continue
            values = list(map(out.pop, members))
            pool, views = self._pool_views.get(name, (None, ()))
            if len(values) == len(views) and all(map(operator.is_, values, views)):
                parent = pool  # the PoolLayers _new_pool handed out, as they were: no need to look closer
            else:
                parent = paged.layers_of(values)
            if parent is not None:
                out[name] = parent  # the device's own stack (a pool, or the last step's output), as it is
            elif all(isinstance(v, np.ndarray | OutputLayer) for v in values):
                out[name] = np.stack([np.asarray(v) for v in values], axis=tensor_names.layer_axis(name))
            else:
                raise VlmcError(
                    f"graph {graph}: the {name} inputs are not one stacked pool's layers in order"
                )
        return out

    def _member_names(self, stacked: str, layers: int) -> list[str]:
        """The per-layer names of a stacked input or output (tensor_names.stack_members / output_members),
        spelled once per run rather than every step."""
        key = (stacked, layers)
        if key not in self._members:
            members = (
                tensor_names.output_members
                if tensor_names.is_stacked_output(stacked)
                else tensor_names.stack_members
            )
            self._members[key] = members(stacked, layers)
            self._member_sets[key] = frozenset(self._members[key])
        return self._members[key]

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = self._stack(graph, feeds)
        reasons, best = [], None
        for build in self._builds(graph):
            fit = self._fit(build, feeds)
            if isinstance(fit, str):
                reasons.append(f"{build.name}: {fit}")
            elif best is None or fit[0] < best[0]:
                best = (*fit, build)
        if best is None:
            raise VlmcError(
                f"graph {graph}: no build takes these inputs ({'; '.join(reasons)}); compile again with gears "
                "that cover them (sequence_buckets, past_buckets, batch_sizes, images or dims), or shorten the input"
            )
        _, gear, values, actual, moved, build = best
        padded = {}
        for name, dims, _, symbolic in build.in_facts:
            value = feeds[name]
            if isinstance(value, DeviceStack):
                # The last step's KV, still on the device: bound as it is where its buffer has this gear's
                # layout (a decode step after a decode step), else brought to the host and padded once.
                target = tuple(d if isinstance(d, int) else values[d] for d in dims)
                value = value.handle if self._binds(value.handle, target) else value.to_host()
            # Only an input with a padded symbol (at batch 1, a paged step's block tables) is looked at.
            if moved and any(d in moved for _, d in symbolic):
                value = self._pad(name, symbolic, value, values, actual)
            padded[name] = value
        if build.name not in self._loaded:
            self.device.load(build, self.root)
            self._loaded.add(build.name)
        dims = build.dims(gear) if gear is not None else None
        outs = self.device.execute(build, padded, dims)
        self.runs[build.name] = self.runs.get(build.name, 0) + 1
        result = {}
        for name, dims, axis, rolled, members in build.out_facts:
            value = outs[name]
            if axis is None:
                result[name] = _strip(value, dims, values, actual) if moved else value
                continue
            # A stacked KV output (stack_kv.py): handed to the loop as its per-layer outputs.
            real = [d if isinstance(d, int) else actual.get(d, values.get(d)) for d in dims]
            if rolled:
                real[tensor_names.ROLLED_AXIS + 1] = actual[tensor_names.ROLLED_REAL]
            if isinstance(value, np.ndarray):
                real_part = _take_real(value, dims, real)
                for i, m in enumerate(members):
                    result[m] = np.ascontiguousarray(np.take(real_part, i, axis=axis))
            else:
                stack = DeviceStack(value, real, dims, axis)
                stack.views = list(map(OutputLayer, repeat(stack), range(len(members))))
                result.update(zip(members, stack.views))
        return result

    def close(self) -> None:
        """Release the device session (on an NPU: every buffer, dataset and model, then acl.finalize)."""
        self.device.close()

    def __enter__(self) -> BuildExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def largest(self, graph: str, symbol: str) -> int | None:
        """The largest value any build of ``graph`` takes for a gear symbol (e.g. ``batch``); None if none binds it."""
        values = [v[symbol] for b in self._builds(graph) for _, v in b.points() if symbol in v]
        return max(values) if values else None

    # ---- gear choice and padding --------------------------------------------------------------
    def _builds(self, graph: str) -> list[BuildSpec]:
        if graph not in self.builds:
            raise VlmcError(
                f"the compile output has no build of graph {graph!r} (builds: {', '.join(self.builds)})"
            )
        return self.builds[graph]

    def _fit(self, build: BuildSpec, feeds: dict[str, np.ndarray]):
        """(padding cost, gear, symbol values, real symbol values, padded symbols) for the cheapest gear;
        else why not.

        Decided by the feeds' shapes alone, so a result is kept per build and shapes (the dicts in it are
        shared: callers read them and do not change them)."""
        names = self._fit_names.get(build.name)
        if names is None:
            others = sorted(self._graph_inputs[build.graph] - build.input_names)
            names = self._fit_names[build.name] = [i["name"] for i in build.inputs] + others
        key = tuple(_shape(feeds[n]) if n in feeds else None for n in names)
        fit = build.fits.get(key)
        if fit is None:
            if len(build.fits) >= _FITS_KEPT:  # a contiguous decode's past grows every step: bounded
                build.fits.clear()
            fit = build.fits[key] = self._fit_shapes(build, dict(zip(names, key)))
        return fit

    def _fit_shapes(self, build: BuildSpec, shapes: dict[str, tuple[int, ...] | None]):
        """:meth:`_fit` from the feeds' shapes (None for a feed that is absent)."""
        for name in self._graph_inputs[build.graph] - build.input_names:
            # A build without an input the graph has (a contiguous prefill build has no past) fits only
            # while that feed is empty.
            if shapes.get(name) is not None and 0 not in shapes[name]:
                return f"takes no {name}"
        actual: dict[str, int] = {}
        for name, dims, rank, _ in build.in_facts:
            shape = shapes[name]
            if shape is None:
                return f"needs {name}"
            if len(shape) != rank:
                return f"{name} has rank {len(shape)}, the build {rank}"
            for axis, (d, n) in enumerate(zip(dims, shape)):
                if isinstance(d, int):
                    if d != n:
                        return f"{name}[{axis}] is {n}, the build's is {d}"
                elif actual.setdefault(d, int(n)) != n:
                    return f"{d} is {actual[d]} in one input and {n} in {name}"
        # A rolled present (stack_kv.py) drops its first position, which must be padding: its past gear
        # has to exceed the real past, i.e. hold the present's real length.
        rolled = [(sym, actual.get(tensor_names.ROLLED_REAL)) for sym in build.rolled]
        best = None
        for gear, values in build.points():
            if any(real is not None and values.get(sym, 0) < real for sym, real in rolled):
                continue
            cost = 0
            for sym, n in actual.items():
                target = values.get(sym)
                if target is None or target == n:
                    continue
                if n > target or sym not in self._paddable:
                    cost = None
                    break
                cost += target - n
            if cost is not None and (best is None or cost < best[0]):
                best = (cost, gear, values, actual)
        if best is None:
            have = ", ".join(
                f"{s}={n}"
                for s, n in actual.items()
                if len(build.bindings.get(s, [])) != 1 or build.bindings[s][0] != n
            )
            return f"no gear holds {have or 'these shapes'} (gears: {build.bindings})"
        _, gear, values, actual = best
        moved = frozenset(s for s, n in actual.items() if values.get(s, n) != n)  # the symbols padded
        return (*best, moved)

    def _pad(self, name: str, symbolic: list, arr, values: dict[str, int], actual: dict[str, int]):
        """``arr`` (input ``name``) padded up to the gear along its ``symbolic`` axes [(axis, symbol)]."""
        if not isinstance(arr, np.ndarray):
            return arr  # a device pool: static, never padded
        for axis, d in symbolic:
            if values.get(d, actual[d]) == actual[d]:
                continue
            extra = values[d] - actual[d]
            if d in self.row_padded:
                arr = np.concatenate(
                    [arr, np.repeat(np.take(arr, [0], axis=axis), extra, axis=axis)], axis=axis
                )
                continue
            fill = self.pad_token_id if name == "input_ids" else _FILL.get(name, 0)
            # np.full and one slice assignment: what np.pad with a constant does, at a fraction of its
            # per-call cost (several inputs are padded every decode step).
            shape = list(arr.shape)
            shape[axis] += extra
            out = np.full(shape, fill, arr.dtype)
            index = [slice(None)] * arr.ndim
            index[axis] = slice(extra, None) if d in LEFT_PADDED else slice(0, arr.shape[axis])
            out[tuple(index)] = arr
            arr = out
        return arr


def _strip(arr: np.ndarray, dims: list, values: dict[str, int], actual: dict[str, int]) -> np.ndarray:
    """Drop the padding from an output along every axis whose symbol was padded."""
    for axis, d in enumerate(dims):
        if isinstance(d, int) or d not in actual or values.get(d, actual[d]) == actual[d]:
            continue
        index = [slice(None)] * arr.ndim
        extra = values[d] - actual[d]
        index[axis] = slice(extra, None) if d in LEFT_PADDED else slice(0, actual[d])
        arr = arr[tuple(index)]
    return np.ascontiguousarray(arr)


def _take_real(arr: np.ndarray, dims: list, real) -> np.ndarray:
    """The real part of a padded output: the last ``real`` positions of a sequence axis, the first of others."""
    index = []
    for axis, (d, n) in enumerate(zip(dims, real)):
        full = arr.shape[axis]
        index.append(slice(full - n, None) if d in LEFT_PADDED else slice(0, n))
    return arr[tuple(index)]


def _shape(value) -> tuple[int, ...]:
    """The shape of a feed: a numpy array, or a device pool (which has ``shape`` but is no array)."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return np.shape(value)
    if type(shape) is tuple:  # numpy's and the device objects' own: already Python ints
        return shape
    return tuple(int(d) for d in shape)


_FITS_KEPT = 256  # _fit results kept per build


def _shapes(feeds: dict[str, object]) -> str:
    return ", ".join(f"{n}{list(_shape(v))}" for n, v in feeds.items())


def _inside(root: Path, rel: str) -> Path:
    """``root / rel`` under the one confinement rule (vlmc/paths.py): compile.json may come from elsewhere."""
    return paths.inside(root, rel, "a build file", where=f"{root}/compile.json")


def agreement(reference, got) -> dict:
    """How far a build's generation is from the package's on onnxruntime (two GenerationResults).

    Tokens are compared position by position up to the first divergence (after it the two runs decode
    different contexts); logits are compared where both decoded the same context, and the first token's
    logits also by cosine, top-1 and top-5 agreement (vlmc.metrics.logits_agreement).
    """
    agree, total, first = 0, 0, None
    for r, g in zip(reference.tokens, got.tokens):
        n = 0
        while n < min(len(r), len(g)) and r[n] == g[n]:
            n += 1
        agree, total = agree + n, total + max(len(r), len(g))
        if n < max(len(r), len(g)) and first is None:
            first = n
    steps = min(
        len(reference.step_logits), len(got.step_logits), (first if first is not None else 1 << 30) + 1
    )
    diff = max(
        float(np.abs(a - b).max()) for a, b in zip(reference.step_logits[:steps], got.step_logits[:steps])
    )
    prefill = metrics.logits_agreement(reference.prefill_logits, got.prefill_logits)
    return {
        "tokens_agree": agree,
        "tokens": total,
        "first_divergence": first,
        "max_logit_diff": diff,
        "prefill_logit_diff": float(np.abs(reference.prefill_logits - got.prefill_logits).max()),
        # the first token's logits (what fp16/int8 arithmetic moves even where the tokens agree)
        "prefill_logits_cosine": prefill["cosine"],
        "prefill_top1": prefill["top1"],
        "prefill_top5": prefill["top5"],
    }


def is_build_dir(path: Path) -> bool:
    """True for a `vlmc compile` output of the ascend backend, or a directory that claims to be one.

    A marker that is anything but a small regular file (a symlink out, a FIFO, a device) still makes
    the directory a build here, so that :func:`read_build` refuses it in one line rather than the
    caller taking it for a package; nothing but ``lstat`` touches it until then.
    """
    marker = Path(path) / BUILD_MARKER
    try:
        info = os.lstat(marker)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_MARKER_BYTES:
        return True
    try:
        claimed = parsing.load_json(marker.read_bytes(), str(marker))
    except (OSError, VlmcError):
        return True
    return not isinstance(claimed, dict) or claimed.get("backend") in ("ascend", None)


# The build marker is a few dozen bytes (vlmc/backends/__init__.py writes it).
_MAX_MARKER_BYTES = 4096


def _build_json(root: Path, rel: str, key: str, where: str) -> object:
    """A JSON file of a build directory: inside it (symlinks followed), a regular file, size-bounded, bounded JSON."""
    blob = paths.read_bytes(root, rel, key, where, limit=limits.MAX_BUILD_JSON_BYTES)
    return parsing.load_json(blob, f"{root}/{rel}")


def default_executor() -> str:
    """``acl`` where pyACL imports, else ``reference``."""
    return "acl" if acl.available() else "reference"


def read_build(build_dir: str | Path) -> tuple[dict, Package]:
    """compile.json and the runtime package (manifest and tokenizer, no graphs) of a compile output.

    A build directory is untrusted input (docs/security.md): the marker, compile.json and
    ``runtime/vlmc.json`` must be regular files inside the build, each read only after its size is
    checked; compile.json is checked against its schema (vlmc/compile_schema.py) and the runtime
    package, and the memory its largest gear and paged pools need against this machine's, before
    anything else is read or allocated.

    Raises:
        VlmcError: not an ascend compile output, from an older vlmc, or any of the above broken.
    """
    root = Path(build_dir)
    where = f"{root}/compile.json"
    marker = _build_json(root, BUILD_MARKER, "the build marker", f"{root}/{BUILD_MARKER}")
    if not isinstance(marker, dict) or marker.get("backend") != "ascend":
        raise VlmcError(f"{root} is not a `vlmc compile` output for ascend (no {BUILD_MARKER} naming it)")
    summary = _build_json(root, "compile.json", "compile.json", where)
    if isinstance(summary, dict) and (
        "runner" not in summary
        or any(isinstance(b, dict) and "inputs" not in b for b in summary.get("builds") or [])
    ):
        raise VlmcError(f"{root} was compiled by an older vlmc (no runner facts); re-run `vlmc compile`")
    compile_schema.check(summary, where)
    pkg_root = _inside(root, summary["runner"]["runtime_package"])
    if not pkg_root.is_dir():
        raise VlmcError(
            f"{where}: runner.runtime_package {summary['runner']['runtime_package']!r} is not a directory"
        )
    text = paths.read_text(pkg_root, manifest_io.MANIFEST_NAME, "the runtime manifest", str(pkg_root))
    manifest = manifest_io.loads(text, where=str(pkg_root / manifest_io.MANIFEST_NAME))
    compile_schema.cross_check(summary, manifest, where)
    need = compile_schema.check_memory(summary, manifest, where)
    logger.debug("%s: the largest gear and the pools need %d bytes", root, need)
    return summary, Package(manifest, pkg_root)


def _check_files(root: Path, builds: list[dict], executor: str) -> None:
    """Every graph (and, for acl, .om) file the builds name: a regular file inside the build, and each
    graph's external data confined to the build and present (vlmc's own check, as for package graphs)."""
    where = f"{root}/compile.json"
    seen: set[str] = set()
    for b in builds:
        files = [(b["file"], "graph")] + ([(b["om"], "om")] if executor == "acl" else [])
        for rel, kind in files:
            if rel in seen:
                continue
            seen.add(rel)
            key = f"build {b['name']} {kind} file"
            if kind == "om" and not os.path.lexists(paths.inside(root, rel, key, where)):
                continue  # not built yet: the device says to run build.sh (acl.AclDevice.load)
            path = paths.regular_file(root, rel, key, where)
            if kind == "graph":  # opened without its weights; the device loads it afterwards
                interop.open_checked(path)


def open_build(
    build_dir: str | Path, executor: str = "reference", device_id: int = 0, rank: int | None = None
) -> tuple[Package, BuildExecutor]:
    """The runtime package and the executor of a compile output.

    Args:
        build_dir: what `vlmc compile --target ascend` wrote.
        executor: ``reference`` (the lowered graphs on CPU) or ``acl`` (the .om files on an NPU).
        device_id: the NPU (acl only).
        rank: for a tensor-parallel build, the rank this process runs: the executor then holds only the
            rank's builds and the replicated ones (compile.json ``builds[*].rank``), so a rank cannot run
            another rank's shard. None for an unsharded build.

    Raises:
        VlmcError: not an ascend compile output, from an older vlmc, or acl is not importable.
    """
    root = Path(build_dir)
    summary, pkg = read_build(root)
    if rank is not None:
        size = int((summary.get("tensor_parallel") or {}).get("size", 0))
        if not 0 <= rank < size:
            raise VlmcError(f"{root}: rank {rank} is not one of the build's {size} tensor-parallel ranks")
        summary = {**summary, "builds": [b for b in summary["builds"] if b.get("rank", rank) == rank]}
    if executor == "reference":
        device: Device = ReferenceDevice()
    elif executor == "acl":
        device = acl.AclDevice(device_id)
    else:
        raise VlmcError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    try:
        _check_files(root, summary["builds"], executor)
        pad = int(pkg.manifest["text"].get("pad_token_id") or 0)
        return pkg, BuildExecutor(root, summary, device, pad_token_id=pad)
    except BaseException:
        device.close()  # the caller never gets the executor, so it cannot release the device
        raise


def rank_devices(build_dir: str | Path, size: int) -> list[int]:
    """The NPU of every rank of a tensor-parallel build: ``device_id`` of the rank's entry in its rank table.

    Raises:
        VlmcError: the table is missing, unreadable, or does not give every rank one device.
    """
    root = Path(build_dir)
    summary, _ = read_build(root)
    name = (summary.get("tensor_parallel") or {}).get("rank_table")
    if not name:
        raise VlmcError(
            f"{root} is not a tensor-parallel build (compile.json has no tensor_parallel.rank_table)"
        )
    path = root / name
    blob = paths.read_bytes(
        root, name, "tensor_parallel.rank_table", f"{root}/compile.json", limits.MAX_BUILD_JSON_BYTES
    )
    table = parsing.load_json(blob, f"{path} is not a rank table")
    try:
        entries = [d for server in table["server_list"] for d in server["device"]]
        devices = {int(d["rank_id"]): int(d["device_id"]) for d in entries}
    except (KeyError, TypeError, ValueError) as exc:
        raise VlmcError(
            f"{path} is not a rank table (server_list[].device[].rank_id/device_id): {exc}"
        ) from None
    if sorted(devices) != list(range(size)) or len(entries) != size:
        raise VlmcError(f"{path} gives ranks {sorted(devices)}, the build has {size} (one device per rank)")
    return [devices[r] for r in range(size)]
