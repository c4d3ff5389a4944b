"""Package: a directory holding vlmc.json, ONNX graphs (weights as external data) and reports.

In memory, each graph is an onnx-ir model whose weights stay in their files (memory-mapped when
read) until a pass replaces them, so opening, checking and saving a multi-GB package costs little
memory. Passes change a package through :meth:`Package.set_graph` (or by editing the IR model from
:meth:`Package.model` in place); the pass manager sees what changed by fingerprint.
:meth:`Package.save` writes the package once, through :func:`vlmc.outdir.atomic`, so a package on
disk is always complete and the input package is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import onnx_ir as ir

from vlmc import interop, manifest, outdir, paths, report
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

_REPORT_FILES = ("report.md", "report.json", "verify.json")  # describe one package state; never carried over


def signature(model: ir.Model) -> dict:
    """The graph's inputs and outputs: names, dtypes and (symbolic) shapes, as the manifest states them
    (``graphs.<name>.inputs`` / ``outputs``)."""
    return {
        "inputs": [_value_entry(v) for v in model.graph.inputs if not v.is_initializer()],
        "outputs": [_value_entry(v) for v in model.graph.outputs],
    }


def _value_entry(v: ir.Value) -> dict:
    shape: list[int | str] = []
    for d in v.shape or ():
        if isinstance(d, int):
            shape.append(d)
        else:
            shape.append(d.value if d.value is not None else "?")
    dtype = np.dtype(v.dtype.numpy()).name if v.dtype is not None else "undefined"
    return {"name": v.name, "dtype": dtype, "shape": shape}


class Package:
    """A VLM package: a manifest plus its graphs, optionally backed by a directory on disk.

    A graph is in one of two states: only on disk (never read), or loaded as an onnx-ir model
    (:meth:`model`) whose weights stay memory-mapped from their files. Tools written against
    ModelProto get a bounded proto through :mod:`vlmc.interop`, never from the package.
    """

    def __init__(self, manifest: dict, root: Path | None = None) -> None:
        self.manifest = manifest
        self.root = Path(root) if root is not None else None
        self._ir: dict[str, ir.Model] = {}
        # graph -> the file its content was read from (under root or in the scratch directory) and the
        # fingerprint it had then; the graph is "unchanged" while its fingerprint is still that one.
        self._file: dict[str, Path] = {}
        self._file_fp: dict[str, str] = {}
        # graph -> whether its file keeps all its external weights in ``<file>.data`` (so saving may
        # copy the pair), learnt whenever the file is opened or written, so saving reads no file again.
        self._own_data: dict[str, bool] = {}
        # Extra files written beside the graphs: relative name -> bytes, or the path of a file (in the
        # scratch directory, or the saved package) too large to hold in memory (paged_kv's samples).
        self.files: dict[str, bytes | Path] = {}
        self.report: dict = {}  # build report data (timings etc.), never part of the manifest
        self._scratch: Path | None = None
        self._fp_memo: dict[str, str] | None = None  # fingerprints taken inside unedited()

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Package:
        """Open a package directory (graphs are read when first used)."""
        root = Path(path)
        if not root.exists():
            raise VlmcError(f"package {root} does not exist")
        mpath = root / manifest.MANIFEST_NAME
        if not mpath.is_file():
            raise VlmcError(
                f"{root} is not a vlmc package (no {manifest.MANIFEST_NAME}); create one with `vlmc export`"
            )
        # Every file of the package obeys the confinement rule (vlmc/paths.py), checked before any is read.
        paths.package_files(root, str(root))
        text = paths.read_text(root, manifest.MANIFEST_NAME, "manifest", str(mpath))
        data = manifest.loads(text, where=str(mpath))
        own: dict[str, bool] = {}
        for name, g in data["graphs"].items():
            key = f"graphs.{name}.file"
            if not paths.inside(root, g["file"], key, str(mpath)).exists():
                raise VlmcError(f"{root}: graph {name!r} file {g['file']} is missing")
            paths.regular_file(root, g["file"], key, str(mpath))
            if g.get("weights_file"):
                paths.inside(root, g["weights_file"], f"graphs.{name}.weights_file", str(mpath))
            own[name] = _check_graph_file(root, name, g, str(mpath))
        text_facts = data["text"]
        for key in ("tokenizer_file", "chat_template"):
            if text_facts.get(key):  # refused at open, before anything reads them
                paths.regular_file(root, text_facts[key], f"text.{key}", str(mpath))
        pkg = cls(data, root)
        for name, g in data["graphs"].items():
            pkg._file[name] = root / g["file"]
        pkg._own_data.update(own)
        report_file = root / "report.json"
        if report_file.is_file():
            try:
                pkg.report = json.loads(report_file.read_text())
            except (OSError, ValueError, RecursionError):  # a damaged report only loses the timings
                pkg.report = {}
        return pkg

    # ---- graph access --------------------------------------------------------------------
    @property
    def graph_names(self) -> list[str]:
        return list(self.manifest["graphs"])

    def graphs_with_role(self, role: str) -> list[str]:
        return [n for n, g in self.manifest["graphs"].items() if g["role"] == role]

    def info(self, name: str) -> dict:
        try:
            return self.manifest["graphs"][name]
        except KeyError:
            raise VlmcError(
                f"package has no graph {name!r} (graphs: {', '.join(self.graph_names)})"
            ) from None

    def model(self, name: str) -> ir.Model:
        """The graph as an onnx-ir model (the IR passes edit); weights stay on disk until read."""
        self.info(name)
        if name not in self._ir:
            path = self._file.get(name)
            if path is None:
                raise VlmcError(f"graph {name!r} has no data")
            model = _open(path)
            self._ir[name] = model
            self._own_data.setdefault(name, _own_data_only(model, path))
            self._file_fp.setdefault(name, _fingerprint(model))
        return self._ir[name]

    def set_graph(
        self,
        name: str,
        model: ir.Model,
        role: str | None = None,
        precision: str | None = None,
        **extra: object,
    ) -> None:
        """Add or replace a graph (an onnx-ir model); its manifest signature is recomputed."""
        if not isinstance(model, ir.Model):
            raise TypeError(f"set_graph({name!r}) takes an onnx_ir.Model, not {type(model).__name__}")
        entry = self._entry(name, role, precision, extra)
        entry.update(signature(model))
        self.manifest["graphs"][name] = entry
        self._ir[name] = model
        if self._fp_memo is not None:
            self._fp_memo.pop(name, None)  # a memo taken in unedited() is of the graph it replaces

    def set_graph_file(
        self, name: str, path: Path, role: str | None = None, precision: str | None = None, **extra: object
    ) -> None:
        """Add a graph whose content is a file (with its external data beside it); nothing is read but its IO."""
        entry = self._entry(name, role, precision, extra)
        model = _open(path)
        entry.update(signature(model))
        self.manifest["graphs"][name] = entry
        self._ir.pop(name, None)
        self._file[name] = Path(path)
        self._file_fp.pop(name, None)
        self._own_data[name] = _own_data_only(model, path)
        if self._fp_memo is not None:
            self._fp_memo.pop(name, None)

    def _entry(self, name: str, role: str | None, precision: str | None, extra: dict) -> dict:
        entry = dict(self.manifest["graphs"].get(name, {}))
        role = role or entry.get("role")
        if role not in manifest.ROLES:
            raise VlmcError(f"graph {name!r}: role {role!r} is not one of {', '.join(manifest.ROLES)}")
        entry.update(
            {
                "file": entry.get("file", f"{name}.onnx"),
                "role": role,
                "precision": precision or entry.get("precision", "fp32"),
            }
        )
        entry.update(extra)
        return entry

    def remove_graph(self, name: str) -> None:
        self.manifest["graphs"].pop(name, None)
        for d in (self._ir, self._file, self._file_fp, self._own_data, self._fp_memo or {}):
            d.pop(name, None)

    def is_loaded(self, name: str) -> bool:
        return name in self._ir

    def _current_fp(self, name: str) -> str | None:
        if name not in self._ir:
            return None
        memo = self._fp_memo
        if memo is not None and name in memo:
            return memo[name]
        fp = _fingerprint(self._ir[name])
        if memo is not None:
            memo[name] = fp
        return fp

    def fingerprint(self, name: str) -> str:
        """The content hash of a loaded graph (:func:`vlmc.interop.fingerprint`)."""
        fp = self._current_fp(name)
        if fp is None:
            raise VlmcError(f"graph {name!r} is not loaded")
        return fp

    @contextlib.contextmanager
    def unedited(self, memo: dict[str, str] | None = None):
        """A block in which no graph is edited: each loaded graph is fingerprinted at most once in it.

        The pass manager reads a package's state, file paths and fingerprints several times before and
        after a pass; inside this block they share one hash per graph instead of one per question.
        ``memo`` carries the hashes from one block to the next when nothing edits the package in
        between (the manager's state after one pass is the state before the next); ``set_graph``
        and ``set_graph_file`` drop the hash of the graph they replace.
        """
        outer = self._fp_memo
        self._fp_memo = (memo if memo is not None else {}) if outer is None else outer
        try:
            yield self
        finally:
            self._fp_memo = outer

    def source(self, name: str) -> tuple[Path | ir.Model, dict]:
        """What runs graph ``name`` as it is now, and its manifest entry: the file while its content is
        unchanged since read (a session opens it from disk), else the IR model."""
        info = self.info(name)
        path = self.path_of(name)
        return (path if path is not None else self.model(name)), info

    def path_of(self, name: str) -> Path | None:
        """The file holding the graph's current content (unchanged since read), else None."""
        path = self._file.get(name)
        if path is None:
            return None
        if self.is_loaded(name) and self._current_fp(name) != self._file_fp.get(name):
            return None
        return path

    # ---- scratch: where exporters write graphs before the package is saved ------------------
    def use_scratch(self, directory: str | Path) -> None:
        """Write new graph files (exports) under ``directory``, which the caller owns and removes."""
        self._scratch = Path(directory)
        self._scratch.mkdir(parents=True, exist_ok=True)

    def scratch_path(self, name: str) -> Path:
        """A fresh path for graph ``name``'s file in the scratch directory (made on first use)."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="vlmc-"))
            weakref.finalize(self, shutil.rmtree, str(self._scratch), True)
        d = Path(tempfile.mkdtemp(dir=self._scratch, prefix=f"{name}-"))
        return d / self._entry_file(name)

    def _entry_file(self, name: str) -> str:
        return self.manifest["graphs"].get(name, {}).get("file", f"{name}.onnx")

    # ---- change tracking (used by the pass manager) ---------------------------------------
    def state(self) -> dict[str, str]:
        """A token per graph that changes exactly when the graph's content changes.

        Graphs never read, and graphs read but unchanged, give ``file:<path>``; others their fingerprint.
        """
        return {name: self._token(name) for name in self.manifest["graphs"]}

    def _token(self, name: str) -> str:
        # One fingerprint per graph (path_of and then the token would hash a changed graph twice).
        path = self._file.get(name)
        fp = self._current_fp(name)
        if path is not None and (fp is None or fp == self._file_fp.get(name)):
            return f"file:{path}"
        return fp or "missing"

    def snapshot(self) -> Package:
        """A view of the package as it is now, for comparing with what a pass makes of it.

        The manifest is copied; graphs are shared (files, and the in-memory objects as they are), so a
        pass that is compared against a snapshot replaces graphs with set_graph rather than editing
        them in place.
        """
        import copy

        snap = Package(copy.deepcopy(self.manifest), self.root)
        snap._ir = dict(self._ir)
        snap._file, snap._file_fp = dict(self._file), dict(self._file_fp)
        snap._own_data = dict(self._own_data)
        snap.files = dict(self.files)
        return snap

    # ---- convenience facts -----------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.manifest["model"]["family"]

    def facts(self, section: str) -> dict:
        return self.manifest.get(section, {})

    # ---- saving ------------------------------------------------------------------------------
    def save(self, out: str | Path, force: bool = False, adopt: bool = True) -> Path:
        """Write the package to ``out`` (atomically) and return its path; afterwards the package is that directory.

        Changed graphs are written by streaming their weights from wherever they are; unchanged ones
        are moved out of the scratch directory or copied (cloned where the filesystem can) from the
        source package. ``force`` replaces an existing directory only if it is a vlmc output.
        With ``adopt=False`` (a copy for a build directory) scratch files are copied, not moved, and
        the package stays as it was.
        """
        manifest.validate(self.manifest, where="manifest to save")
        with outdir.atomic(out, force, source=self.root) as tmp:
            shared: dict[str, list[str]] = {}  # weights_file -> graphs storing their weights in it
            unchanged: dict[str, Path] = {}
            for name, info in self.manifest["graphs"].items():
                if info.get("weights_file"):
                    shared.setdefault(info["weights_file"], []).append(name)
                    continue
                path = self.path_of(name)
                if path is None or not self._owns_data(name, path):
                    interop.save(self.model(name), tmp / info["file"])
                else:
                    unchanged[name] = path
            for data_file, names in sorted(shared.items()):
                # Graphs that share weights (merge) are written together so each weight is stored once.
                dest = paths.inside(tmp, data_file, f"graphs.{names[0]}.weights_file", "manifest to save")
                interop.save_shared({tmp / self.info(n)["file"]: self.model(n) for n in names}, dest)
            # Unchanged files go last: a changed graph may still read weights from them.
            for name, src in unchanged.items():
                self._place(src, tmp / self.info(name)["file"], move=adopt)
            for rel, blob in sorted(self.files.items()):
                try:
                    target = paths.inside(tmp, rel, "package file", "package to save")
                except VlmcError:
                    raise VlmcError(f"package file {rel!r} would be written outside the package") from None
                target.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(blob, Path):
                    self._place_file(blob, target, move=adopt)
                else:
                    target.write_bytes(blob)
            if self.root is not None and self.root.resolve() != Path(out).resolve():
                _carry_files(self.root, tmp, keep=set(self.files))
            (tmp / manifest.MANIFEST_NAME).write_text(manifest.dumps(self.manifest))
            (tmp / "report.json").write_text(
                json.dumps(self.report, indent=2, sort_keys=True, default=str) + "\n"
            )
            (tmp / "report.md").write_text(report.render_markdown(self._view(tmp), tmp))
        out = Path(out).resolve()
        if adopt:
            self.reroot(out)
        return out

    def _owns_data(self, name: str, path: Path) -> bool:
        own = self._own_data.get(name)
        if own is None:  # a file never opened here (a package saved before): read its header once
            own = self._own_data[name] = _own_data_only(_open(path), path)
        return own

    def _view(self, root: Path) -> Package:
        """This package's manifest and files read from a directory its graphs were saved to."""
        view = Package(self.manifest, root)
        view._file = {name: root / info["file"] for name, info in self.manifest["graphs"].items()}
        view.report, view.files = self.report, self.files
        return view

    def reroot(self, root: Path) -> None:
        """Make the package the saved directory ``root``: graphs are read from there again when used."""
        self.root = Path(root)
        self._ir.clear()
        self._file_fp.clear()
        self._file = {name: self.root / info["file"] for name, info in self.manifest["graphs"].items()}
        # What save() wrote: each graph's weights in its own data file, or in a shared weights_file.
        self._own_data = {n: not info.get("weights_file") for n, info in self.manifest["graphs"].items()}
        for rel, blob in self.files.items():
            if isinstance(blob, Path):  # saved there with the graphs
                self.files[rel] = self.root / rel

    def _place_file(self, src: Path, dest: Path, move: bool) -> None:
        """Put one file into the output: moved when it is the package's own scratch file, else copied."""
        if move and self._scratch is not None and self._scratch.resolve() in src.resolve().parents:
            try:
                os.replace(src, dest)
                return
            except OSError:  # another filesystem
                pass
        outdir.copy_file(src, dest)

    def _place(self, src: Path, dest: Path, move: bool) -> None:
        """Put an unchanged graph file (and its data) into the output: moved out of scratch, else copied."""
        data = src.parent / (src.name + ".data")
        owned = move and self._scratch is not None and self._scratch.resolve() in src.resolve().parents
        for s, d in ((src, dest), (data, dest.parent / (dest.name + ".data"))):
            if not s.exists():
                continue
            try:
                if owned:
                    os.replace(s, d)  # scratch files are ours: a rename instead of a copy of the weights
                    continue
            except OSError:  # another filesystem
                pass
            outdir.copy_file(s, d)


def _open(path: Path) -> ir.Model:
    """A graph file of the package as IR, its external data entries checked first (weights stay in the
    file). The one place a package reads a graph file: opening, checking at load and registering an
    exported file share it, and it reports what saving needs to know (:func:`_own_data_only`)."""
    return interop.open_checked(path)


def _fingerprint(model: ir.Model) -> str:
    """:func:`vlmc.interop.fingerprint`: the one place a package hashes a graph."""
    return interop.fingerprint(model)


def _check_graph_file(root: Path, name: str, info: dict, where: str) -> bool:
    """Fail at load time, with one line, on a truncated graph, missing weights or a hand-edited signature.

    Only the small protobuf is parsed (weights stay on disk), so opening a large package stays cheap;
    catching these here keeps them from surfacing later as onnxruntime errors mid-run.
    """
    path = root / info["file"]
    model = _open(path)
    actual = signature(model)
    for io in ("inputs", "outputs"):
        want = [(e.get("name"), e.get("dtype")) for e in info[io]]
        have = [(e["name"], e["dtype"]) for e in actual[io]]
        if want != have:
            diff = next(
                ((w, h) for w, h in zip(want, have) if w != h),
                (want[len(have) :] or None, have[len(want) :] or None),
            )
            raise VlmcError(
                f"{where}: graphs.{name}.{io} do not match {info['file']} (manifest {diff[0]}, file {diff[1]}); "
                "the manifest was edited or the file replaced: re-export the package"
            )
    return _own_data_only(model, path)


def _own_data_only(model: ir.Model, path: Path) -> bool:
    """True if graph file ``path`` (opened as ``model``) keeps all its external weights in
    ``<file>.data`` (so the pair can be copied).

    A graph that was saved beside others in a shared weights file (merge) and no longer shares it
    must be written out again instead.
    """
    locations = {
        v.const_value.location
        for v in model.graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor)
    }
    return locations <= {path.name + ".data"}


def _carry_files(src_root: Path, dest_root: Path, keep: set[str]) -> None:
    """Copy auxiliary files (samples, tokenizer, pictures) from the source package."""
    # Every file is checked by the one confinement rule: a regular file resolving inside the source
    # package (a symlink out of it refuses the package instead of copying what it points at).
    for rel, p in paths.package_files(src_root, str(src_root)):
        if rel in keep or rel == manifest.MANIFEST_NAME or rel in _REPORT_FILES:
            continue
        if rel.endswith(".onnx") or rel.endswith(".onnx.data"):
            continue  # graphs are written from the manifest; stale ones must not leak
        target = dest_root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        outdir.copy_file(p, target)
