"""The pass contract: typed options, PassResult, and the registry of passes in ``vlmc.passes``.

A pass is a class with a ``name``, an ``options`` schema (a tuple of :class:`Option`) and
``run(package, plan) -> PassResult``. Passes change the package they are given in place (editing
the onnx-ir model from ``Package.model`` or handing a new graph to ``Package.set_graph``) and
return it. The pass manager (vlmc/manager.py) holds every pass to this contract:

- ``check_package`` refuses a package early and returns the plan; the manager hands exactly that to
  ``run`` (a pass keeps no state between the two).
- ``modified`` is worked out from content fingerprints; a pass may state it, and is then held to it.
- a ``lossy`` pass implements ``evaluate(before, after, result)``, which the manager calls, and
  declares ``changes_input = False``: it builds new graph objects (a clone, or a new model) and
  hands them to ``set_graph``, so the manager's snapshot is still the package as it was.
- a pass that declares ``changes_input = False`` (as onnx-ir's ``FunctionalPass`` does) is checked:
  every graph object the package held when it started must be unchanged when it returns.
- a ``VlmcError`` from ``check_package`` or ``run`` is a refusal (``PassRefused``, exit code 2).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vlmc import manifest_schema
from vlmc.errors import VlmcError

if TYPE_CHECKING:
    from vlmc.package import Package

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass(frozen=True)
class Option:
    """One typed, documented pass option.

    Attributes:
        name: key in the recipe.
        type: python type (bool, int, float, str, list, dict); ints are accepted for floats.
        default: value when the recipe omits the key; ``None`` means "not set".
        doc: one-line description, shown by ``vlmc passes`` and in the JSON Schema.
        choices: allowed values, if the option is an enum.
        min / max: inclusive numeric bounds (for a list of numbers: of each item). Every option that
            sizes work (counts, samples, gears, batch) has a ``max`` (vlmc/limits.py, docs/security.md).
        multiple_of: numeric values must be a multiple of this.
        items: element type for list options.
        max_items / min_items: most / fewest items a list option may have.
        fields: for a dict option, the schema of its keys (Options again, so nested recipe values are
            validated and documented by the same code as top-level ones); unknown keys are refused.
    """

    name: str
    type: type
    default: Any = None
    doc: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    multiple_of: int | None = None
    items: type | None = None
    required: bool = False
    max_items: int | None = None
    min_items: int | None = None
    fields: tuple[Option, ...] | None = None

    def schema_type(self) -> manifest_schema.T:
        """This option's value as a :mod:`vlmc.manifest_schema` type, which checks and documents it.

        Recipe values and the manifest share one schema language; what is particular to an option
        (``None`` as "not set", choices of any type, ``multiple_of``, a mapping's own Options) is
        added by :meth:`coerce` and :meth:`json_schema`.
        """
        if self.type is list:
            item = _value_type(self.items, self) if self.items is not None else manifest_schema.Facts()
            return manifest_schema.List(item, self.min_items or 0, self.max_items or MAX_RECIPE_ITEMS)
        return _value_type(self.type, self)

    def coerce(self, value: Any, where: str) -> Any:
        """Validate one value; raise VlmcError naming the key on a wrong type or range."""
        if value is None and not self.required:
            return None
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        path = f"{where}: {self.name}"
        if self.type is list and isinstance(value, list):  # the item counts first, named as the limit
            if self.max_items is not None and len(value) > self.max_items:
                raise VlmcError(f"{path} has {len(value)} items, above the maximum {self.max_items}")
            if self.min_items is not None and len(value) < self.min_items:
                raise VlmcError(f"{path} needs at least {self.min_items} item(s), got {len(value)}")
        self.schema_type().check(value, path)
        if self.choices is not None and value not in self.choices:
            raise VlmcError(f"{path}={value!r} is not one of {', '.join(map(str, self.choices))}")
        if self.multiple_of:
            for i, v in enumerate(value if self.type is list else [value]):
                if v % self.multiple_of:
                    at = f"{path}[{i}]" if self.type is list else path
                    raise VlmcError(f"{at}={v} must be a multiple of {self.multiple_of}")
        if self.fields is not None:
            validate(self.fields, value, path, noun="key")  # checked, kept as written
        return value

    def json_schema(self) -> dict:
        s = schema_json(self.fields) if self.fields is not None else self.schema_type().json()
        s["type"] = s.get("type", "object")
        s["description"] = self.doc
        if self.default is not None:
            s["default"] = self.default
        if not self.required:
            s["type"] = [s["type"], "null"]
        if self.choices is not None:
            s["enum"] = list(self.choices) + ([] if self.required else [None])
        if self.multiple_of:
            (s["items"] if self.type is list else s)["multipleOf"] = self.multiple_of
        return s


# Recipe strings (paths, prompts, globs) and lists are bounded like every value vlmc reads.
MAX_RECIPE_STR = 4096
MAX_RECIPE_ITEMS = 4096


def _value_type(t: type, o: Option) -> manifest_schema.T:
    """A scalar (or mapping) of python type ``t`` with the option's bounds, as a manifest_schema type."""
    if t is bool:
        return manifest_schema.Bool()
    if t is int:
        return manifest_schema.Int(o.min, o.max)
    if t is float:
        return manifest_schema.Num(o.min, o.max)
    if t is str:
        return manifest_schema.Str(max_len=MAX_RECIPE_STR)
    if t is dict:  # its keys: Options (``fields``, checked by validate) or bounded facts
        return manifest_schema.Obj({}, extra=manifest_schema.Facts(depth=4))
    raise TypeError(f"option {o.name!r}: type {t.__name__} is not one of bool, int, float, str, list, dict")


@dataclass
class PassResult:
    """What a pass returns: the package, whether it changed, and a plain-dict report.

    ``modified`` may be left as ``None``: the pass manager works it out from content fingerprints.
    When a pass does state it, the manager holds it to it exactly.
    """

    package: Package
    modified: bool | None = None
    report: dict = field(default_factory=dict)


# Preconditions a pass can declare in ``requires``; the manager checks them before check_package.
REQUIREMENTS = {
    "unmerged": (
        lambda pkg: not pkg.manifest.get("pipeline", {}).get("vlm"),
        "{name} cannot run on a merged package: graph {vlm!r} repeats the stages that the decode graphs keep, "
        "and changing one copy would make prefill and decode disagree; run {name} before merge, or run split first",
    ),
    "unsharded": (
        lambda pkg: not pkg.manifest.get("tensor_parallel"),
        "{name} cannot run on a tensor-parallel package: each rank's decoder is already cut into segments "
        "at the all-reduce points, and neither one merged graph nor a layer range can hold the host's "
        "collectives; run {name} without tensor_parallel",
    ),
}


class Pass:
    """Base class for passes. Subclasses set ``name``, ``summary``, ``options`` and implement ``run``.

    Class attributes:
        preserves_numerics: outputs are unchanged up to float rounding; ``--check`` verifies it.
        lossy: the pass moves outputs on purpose; it must implement ``evaluate`` (how far) and
            declare ``changes_input = False``. The manager refuses a lossy class without them.
        changes_input: False declares that ``run`` leaves every graph object it was given as it was
            (it builds new ones and hands them to ``set_graph``), as onnx-ir's ``FunctionalPass``
            declares ``changes_input``; the manager checks it against its snapshot.
        requires: preconditions on the package (keys of :data:`REQUIREMENTS`), checked by the manager.
        options: the typed schema; ``self.opts`` holds validated values after construction.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    preserves_numerics: ClassVar[bool] = False
    # Changes outputs on purpose (pruning, quantization): verify reports fidelity instead of exactness.
    lossy: ClassVar[bool] = False
    # onnx-ir's PassBase.changes_input: False for a pass that never edits the graph objects it is given.
    changes_input: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[Option, ...]] = ()
    # Passes whose options are keyed by graph name (e.g. quantize) accept extra keys and check them.
    allow_extra_keys: ClassVar[bool] = False

    def __init__(self, **opts: Any) -> None:
        self.opts = self.validate_options(opts, where=self.name)

    @classmethod
    def validate_options(cls, opts: dict, where: str) -> dict:
        out = validate(cls.options, opts, where, allow_extra=cls.allow_extra_keys)
        cls.check_options(out, where)
        return out

    @classmethod
    def check_options(cls, opts: dict, where: str) -> None:
        """Cross-option validation hook (raise VlmcError); runs before any work."""

    def check_package(self, package: Package) -> Any:
        """Refuse a package early with a clear message (raise VlmcError), and return the plan for ``run``.

        Whatever this returns is handed to ``run`` as ``plan``; a pass keeps no state between the two.
        """
        return None

    def run(self, package: Package, plan: Any = None) -> PassResult:  # pragma: no cover - passes override it
        raise TypeError(f"pass {self.name!r} ({type(self).__qualname__}) does not define run(package)")

    def evaluate(self, before: Package, after: Package, result: PassResult) -> dict | None:
        """For lossy passes: how far the change moved the outputs (merged into the report as ``fidelity``).

        ``before`` is the package as it was before ``run`` (its graphs are the unchanged files and
        objects: a lossy pass does not change its input), ``after`` the package ``run`` returned.
        Return None when there is nothing to measure. Every lossy pass overrides it.
        """
        return None

    @classmethod
    def json_schema(cls) -> dict:
        return schema_json(cls.options, cls.summary, bool(cls.allow_extra_keys))


def contract_violations(cls: type[Pass]) -> list[str]:
    """What a pass class declares that the contract does not allow, one sentence each (for its author)."""
    found = []
    if cls.lossy and cls.evaluate is Pass.evaluate:
        found.append(
            "it is lossy but does not implement evaluate(before, after, result); a lossy pass must say "
            "how far it moved the outputs (override Pass.evaluate and return the fidelity it measured)"
        )
    if cls.lossy and cls.changes_input:
        found.append(
            "it is lossy but does not declare changes_input = False; a lossy pass builds its graphs on "
            "new objects (Model.clone() or a new model handed to set_graph), so that evaluate's "
            "'before' package is the package as it was"
        )
    unknown = [r for r in cls.requires if r not in REQUIREMENTS]
    if unknown:
        found.append(f"it requires {unknown[0]!r}, which is not one of {', '.join(REQUIREMENTS)}")
    return found


def check_requirements(p: Pass, pkg: Package) -> None:
    """Raise VlmcError if the package does not meet a precondition the pass declared."""
    for req in p.requires:
        ok, message = REQUIREMENTS[req]
        if not ok(pkg):
            raise VlmcError(message.format(vlm=pkg.manifest.get("pipeline", {}).get("vlm"), name=p.name))


def validate(
    schema: tuple[Option, ...], opts: Any, where: str, allow_extra: bool = False, noun: str = "option"
) -> dict:
    """Validate a mapping against an option schema; fill defaults; unknown keys list the valid ones.

    ``noun`` names the keys in messages: "option" for a pass's options, "key" for a nested mapping.
    """
    by_name = {o.name: o for o in schema}
    if not isinstance(opts, dict):
        raise VlmcError(f"{where}: {noun}s must be a mapping of {noun} names to values")
    unknown = [k for k in opts if k not in by_name]
    if unknown and not allow_extra:
        valid = ", ".join(by_name) or "(none)"
        raise VlmcError(f"{where}: unknown {noun} {unknown[0]!r}; valid {noun}s: {valid}")
    out = {}
    for o in schema:
        if o.name in opts:
            out[o.name] = o.coerce(opts[o.name], where)
        elif o.required:
            raise VlmcError(f"{where}: {noun} {o.name!r} is required")
        else:
            out[o.name] = o.default
    for k in unknown:
        out[k] = opts[k]
    return out


def schema_json(schema: tuple[Option, ...], description: str = "", allow_extra: bool = False) -> dict:
    """JSON Schema object for an option schema."""
    return {
        "type": "object",
        "description": description,
        "properties": {o.name: o.json_schema() for o in schema},
        "additionalProperties": allow_extra,
    }


_REGISTRY: dict[str, type[Pass]] = {}


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator: add a pass to the registry; a second pass with the same name is an error."""
    if not cls.name:
        raise TypeError(f"{cls.__qualname__} has no name")
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
        raise ValueError(
            f"pass name {cls.name!r} is registered twice ({existing.__module__} and {cls.__module__})"
        )
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    import vlmc.passes as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"vlmc.passes.{info.name}")


def registry() -> dict[str, type[Pass]]:
    """All registered passes by name (importing every module in vlmc.passes once)."""
    if not getattr(registry, "_done", False):
        _discover()
        registry._done = True  # type: ignore[attr-defined]
    return dict(sorted(_REGISTRY.items()))


def get(name: str) -> type[Pass]:
    reg = registry()
    if name not in reg:
        raise VlmcError(f"unknown pass {name!r}; valid passes: {', '.join(reg)}")
    return reg[name]
