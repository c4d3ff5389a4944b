"""Package: a directory holding vlmc.json, ONNX graphs (weights as external data) and reports.

Graphs are loaded lazily. Passes change a package in place through :meth:`Package.set_graph`,
which also refreshes the graph's IO signature in the manifest; the pass manager detects changes by
fingerprint. :meth:`Package.save` writes to a temporary sibling directory and renames it into
place, so a package on disk is always complete and the input package is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import onnx

from vlmc import graphs as G
from vlmc import manifest as M
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

# Extra files a pass or exporter may attach (calibration samples, pictures): name -> bytes.
_REPORT_FILES = ("report.md", "report.json", "verify.json")  # describe one package state; never carried over


class Package:
    """A VLM package: a manifest plus its graphs, optionally backed by a directory on disk."""

    def __init__(self, manifest: dict, root: Path | None = None) -> None:
        self.manifest = manifest
        self.root = Path(root) if root is not None else None
        self._models: dict[str, onnx.ModelProto] = {}
        self._loaded_fp: dict[str, str] = {}
        self.files: dict[str, bytes] = {}  # extra files written beside the graphs (relative name -> bytes)
        self.report: dict = {}  # build report data (timings etc.), never part of the manifest
        # Staging (see stage()): graphs released from memory live in files there, never in ``root``,
        # which may be the user's input package.
        self.staging: Path | None = None
        self._staged: dict[str, Path] = {}  # graph -> staging file holding its current content
        self._staged_fp: dict[str, str] = {}  # graph -> fingerprint of that content
        self._disk_fp: dict[str, str] = {}  # graph -> fingerprint of its file under root, once read
        self._superseded: list[Path] = []  # staging files replaced since the last purge_staging()

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Package:
        """Open a package directory (graphs are read when first used)."""
        root = Path(path)
        if not root.exists():
            raise VlmcError(f"package {root} does not exist")
        mpath = root / M.MANIFEST_NAME
        if not mpath.is_file():
            raise VlmcError(
                f"{root} is not a vlmc package (no {M.MANIFEST_NAME}); create one with `vlmc export`"
            )
        try:
            text = mpath.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise VlmcError(f"{mpath} cannot be read: {exc}") from exc
        manifest = M.loads(text, where=str(mpath))
        for name, g in manifest["graphs"].items():
            if not (root / g["file"]).is_file():
                raise VlmcError(f"{root}: graph {name!r} file {g['file']} is missing")
            _check_graph_file(root, name, g, str(mpath))
        pkg = cls(manifest, root)
        report = root / "report.json"
        if report.is_file():
            try:
                pkg.report = json.loads(report.read_text())
            except (OSError, json.JSONDecodeError):
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

    def path_of(self, name: str) -> Path | None:
        """The on-disk file of a graph not loaded in memory (in the package or staged), else None."""
        if name in self._models:
            return None
        if name in self._staged:
            return self._staged[name]
        if self.root is None:
            return None
        return self.root / self.info(name)["file"]

    def is_loaded(self, name: str) -> bool:
        return name in self._models

    def is_staged(self, name: str) -> bool:
        """True when the graph's current content is a file in the staging directory (see stage())."""
        return name in self._staged

    def graph(self, name: str) -> onnx.ModelProto:
        """The graph's ModelProto with weights, loading it on first use."""
        if name not in self._models:
            info = self.info(name)
            if name in self._staged:
                model = G.load(self._staged[name])
                # save/load round-trips exactly, so the content is the one fingerprinted at release
                self._loaded_fp[name] = self._staged_fp[name]
            elif self.root is None:
                raise VlmcError(f"graph {name!r} has no data")
            else:
                model = G.load(self.root / info["file"])
                self._loaded_fp[name] = self._disk_fp[name] = G.fingerprint(model)
            self._models[name] = model
        return self._models[name]

    def set_graph(
        self,
        name: str,
        model: onnx.ModelProto,
        role: str | None = None,
        precision: str | None = None,
        **extra: object,
    ) -> None:
        """Add or replace a graph; its manifest signature is recomputed from the model."""
        entry = self.manifest["graphs"].get(name, {})
        role = role or entry.get("role")
        if role not in M.ROLES:
            raise VlmcError(f"graph {name!r}: role {role!r} is not one of {', '.join(M.ROLES)}")
        entry = dict(entry)
        entry.update(
            {
                "file": entry.get("file", f"{name}.onnx"),
                "role": role,
                "precision": precision or entry.get("precision", "fp32"),
            }
        )
        entry.update(extra)
        entry.update(G.signature(model))
        self.manifest["graphs"][name] = entry
        self._models[name] = model

    def remove_graph(self, name: str) -> None:
        self.manifest["graphs"].pop(name, None)
        self._models.pop(name, None)
        self._loaded_fp.pop(name, None)
        self._unstage_graph(name)

    # ---- staging: keeping graphs on disk instead of in memory -----------------------------
    def stage(self, directory: str | Path) -> None:
        """Let :meth:`release` keep graphs in files under ``directory`` instead of in memory.

        Builds of multi-GB models use this so that only the graph being worked on is resident. The
        directory belongs to the caller, who removes it once the package has been saved elsewhere.
        """
        self.staging = Path(directory)
        self.staging.mkdir(parents=True, exist_ok=True)

    def release(self, *names: str) -> None:
        """Drop graphs (default: all loaded ones) from memory; changed ones are written to staging first.

        Without a staging directory, or for graphs that share a weights file, this does nothing:
        their only copy is the one in memory. A released graph is loaded again on next use.
        """
        if self.staging is None:
            return
        for name in names or list(self._models):
            if name not in self._models or self.info(name).get("weights_file"):
                continue
            model = self._models[name]
            fp = G.fingerprint(model)
            if fp != self._loaded_fp.get(name):  # changed since loaded, or never on disk
                # A new file each time: the previous one may still be read (the manager's --check
                # snapshot); purge_staging() deletes it once that is over.
                # Under the graph's own file name: the .onnx names its data file, and save() copies both.
                path = self.staging / uuid.uuid4().hex[:8] / Path(self.info(name)["file"]).name
                path.parent.mkdir()
                G.save(model, path)
                self._unstage_graph(name)
                self._staged[name], self._staged_fp[name] = path, fp
            del self._models[name]
            self._loaded_fp.pop(name, None)

    def purge_staging(self) -> None:
        """Delete staging files whose graphs have since been replaced."""
        for path in self._superseded:
            shutil.rmtree(path.parent, ignore_errors=True)
        self._superseded.clear()

    def unstage(self) -> None:
        """Forget the staging directory; call after :meth:`save`, whose output now holds every graph."""
        self.purge_staging()
        self._staged.clear()
        self._staged_fp.clear()
        self.staging = None

    def _unstage_graph(self, name: str) -> None:
        old = self._staged.pop(name, None)
        self._staged_fp.pop(name, None)
        if old is not None:
            self._superseded.append(old)

    def loaded(self) -> Iterator[tuple[str, onnx.ModelProto]]:
        yield from list(self._models.items())

    # ---- change tracking (used by the pass manager) ---------------------------------------
    def state(self) -> dict[str, str]:
        """Fingerprints of every graph: a content hash if loaded or staged, else 'disk' (unchanged since load)."""
        out = {}
        for name in self.manifest["graphs"]:
            if name in self._models:
                out[name] = G.fingerprint(self._models[name])
            else:
                # a graph read from root and released unchanged keeps the fingerprint it was read with,
                # so "loaded before the pass, released by it" compares equal
                out[name] = self._staged_fp.get(name) or self._disk_fp.get(name, "disk")
        return out

    def original_fingerprint(self, name: str) -> str | None:
        """Fingerprint of the graph as it was read (from the package or staging), if it was read."""
        return self._loaded_fp.get(name) or self._disk_fp.get(name)

    # ---- convenience facts -----------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.manifest["model"]["family"]

    def facts(self, section: str) -> dict:
        return self.manifest.get(section, {})

    # ---- saving ------------------------------------------------------------------------------
    def save(self, out: str | Path, force: bool = False) -> Path:
        """Write the package atomically to ``out`` and return its path.

        Unmodified graphs are copied (cloned where the filesystem can) from the source package. ``force`` replaces an
        existing directory only if it is itself a vlmc package.
        """
        out = Path(out).resolve()
        check_output_dir(out, force, source=self.root)
        M.validate(self.manifest, where="manifest to save")
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.mkdir()
            shared: dict[str, list[str]] = {}  # weights_file -> graphs storing their weights in it
            for name, info in self.manifest["graphs"].items():
                dest = tmp / info["file"]
                if info.get("weights_file"):
                    shared.setdefault(info["weights_file"], []).append(name)
                elif name in self._models:
                    G.save(self._models[name], dest)
                else:
                    src = self._staged.get(name) or self.root / info["file"]
                    _link_or_copy(src, dest)
                    data = src.parent / (src.name + ".data")
                    if data.exists():
                        _link_or_copy(data, tmp / (info["file"] + ".data"))
            for data_file, names in sorted(shared.items()):
                # Graphs that share weights (merge) are rewritten together so each weight is stored once.
                G.save_shared({tmp / self.info(n)["file"]: self.graph(n) for n in names}, tmp / data_file)
            for rel, blob in sorted(self.files.items()):
                target = (tmp / rel).resolve()
                if tmp.resolve() not in target.parents:
                    raise VlmcError(f"package file {rel!r} would be written outside the package")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(blob)
            if self.root is not None and self.root.resolve() != out:
                _carry_files(self.root, tmp, keep=set(self.files))
            (tmp / M.MANIFEST_NAME).write_text(M.dumps(self.manifest))
            from vlmc import report as R

            (tmp / "report.json").write_text(
                json.dumps(self.report, indent=2, sort_keys=True, default=str) + "\n"
            )
            (tmp / "report.md").write_text(R.render_markdown(self, tmp))
            _replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.root = out
        return out


def _check_graph_file(root: Path, name: str, info: dict, where: str) -> None:
    """Fail at load time, with one line, on a truncated graph, missing weights or a hand-edited signature.

    Only the small protobuf is parsed (weights stay on disk), so opening a large package stays cheap;
    catching these here keeps them from surfacing later as onnxruntime errors mid-run.
    """
    path = root / info["file"]
    model = G.load(path, load_weights=False)
    G.check_external_data(model, path.parent)
    actual = G.signature(model)
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


def is_package(path: Path) -> bool:
    return (path / M.MANIFEST_NAME).is_file()


def check_output_dir(
    out: Path, force: bool, marker: str = M.MANIFEST_NAME, source: Path | None = None
) -> None:
    """Refuse to overwrite a directory unless --force and it is a previous vlmc output.

    With ``source`` (the input package), an output nested inside it or around it is refused too:
    writing there would change the input (or, with --force, delete it).
    """
    if source is not None:
        src, dest = Path(source).resolve(), Path(out).resolve()
        if src in dest.parents:
            raise VlmcError(
                f"output {out} is inside the input package {source}; choose a directory outside it"
            )
        if dest in src.parents:
            raise VlmcError(
                f"output {out} contains the input package {source}; choose a directory outside it"
            )
    if not out.exists():
        return
    if not force:
        raise VlmcError(f"output {out} already exists; pass --force to replace it")
    if not out.is_dir() or not ((out / marker).is_file() or (out / "vlmc-build.json").is_file()):
        raise VlmcError(
            f"output {out} exists and is not a vlmc output; refusing to replace it even with --force"
        )


def _link_or_copy(src: Path, dest: Path) -> None:
    """Copy an unchanged file into a new package: a copy-on-write clone where the filesystem can.

    Not a hard link: onnx.load and onnx.checker refuse external data files with more than one link
    (a hardlink-attack guard), so a hard-linked package would not open in users' own onnx code.
    """
    try:
        _reflink(src, dest)
    except OSError:
        shutil.copyfile(src, dest)  # uses the kernel's in-place copy (sendfile) on Linux


def _reflink(src: Path, dest: Path) -> None:
    import fcntl

    ficlone = 0x40049409  # FICLONE: share the extents (btrfs, xfs); raises on filesystems without it
    with open(src, "rb") as s, open(dest, "wb") as d:
        try:
            fcntl.ioctl(d.fileno(), ficlone, s.fileno())
        except OSError:
            d.close()
            os.unlink(dest)
            raise


def _carry_files(src_root: Path, dest_root: Path, keep: set[str]) -> None:
    """Copy auxiliary files (samples, tokenizer, pictures) from the source package."""
    for p in sorted(src_root.rglob("*")):
        rel = p.relative_to(src_root).as_posix()
        if p.is_dir() or rel in keep or rel == M.MANIFEST_NAME or rel in _REPORT_FILES:
            continue
        if rel.endswith(".onnx") or rel.endswith(".onnx.data"):
            continue  # graphs are written from the manifest; stale ones must not leak
        target = dest_root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(p, target)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move tmp into place; an existing (vlmc) directory is swapped out and removed after."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
