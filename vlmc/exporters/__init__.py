"""Exporters: turn a transformers VLM (hub id, local directory or built-in) into a vlmc Package.

One module per family registers itself in ``FAMILIES``; a family module provides
``MODEL_TYPES`` (config.model_type values), ``model_class()`` and ``export(source, package)``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from vlmc import limits, manifest, paths, ui
from vlmc.errors import VlmcError
from vlmc.exporters import checkpoint, processor, zoo
from vlmc.package import Package

logger = logging.getLogger(__name__)

# family name -> module; the order is the order `vlmc export --list` shows
FAMILY_MODULES = {
    "llava": "vlmc.exporters.llava",
    "qwen2_vl": "vlmc.exporters.qwen2_vl",
    "qwen3_vl": "vlmc.exporters.qwen3_vl",
    "glm4v": "vlmc.exporters.glm4v",
    "blip2": "vlmc.exporters.blip2",
    # the generic tier (vlmc/exporters/generic.py)
    "llava_next": "vlmc.exporters.llava_next",
    "llava_onevision": "vlmc.exporters.llava_onevision",
    "gemma3": "vlmc.exporters.gemma3",
    "internvl": "vlmc.exporters.internvl",
    # native rebuilds of remote-code repositories (their own load_local: no repo code runs)
    "qwen_vl": "vlmc.exporters.qwen_vl",
    "phi3_v": "vlmc.exporters.phi3_v",
}


def families() -> dict[str, ModuleType]:
    """Family name -> exporter module, for the families whose module is present."""
    out = {}
    for name, mod in FAMILY_MODULES.items():
        try:
            out[name] = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
    return out


def supported_model_types() -> dict[str, str]:
    return {mt: fam for fam, mod in families().items() for mt in mod.MODEL_TYPES}


@dataclass
class Source:
    """A loaded source model and what is known about where it came from."""

    name: str  # what the user passed
    model: object  # the transformers model (eval mode, eager attention)
    config: object
    family: str
    directory: Path | None = None  # local directory with config/tokenizer/processor files
    builtin: bool = False
    extra: dict = field(default_factory=dict)
    streamed: bool = False  # model is the reduced-depth cut of a lazy load (see load_source)
    trusted: bool = False  # loaded with --trust-remote-code: the processor's own code may run too

    @property
    def architecture(self) -> str:
        return type(self.model).__name__

    @property
    def config_hash(self) -> str:
        return config_hash(self.config)


def config_hash(config) -> str:
    d = config.to_dict()
    for k in (
        "transformers_version",
        "_name_or_path",
        "_attn_implementation_autoset",
        "torch_dtype",
        "dtype",
    ):
        d.pop(k, None)
    return "sha256:" + hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _family_for_config(config, where: str) -> str:
    types = supported_model_types()
    model_type = getattr(config, "model_type", None)
    if model_type in types:
        return types[model_type]
    arch = (getattr(config, "architectures", None) or [model_type or "unknown"])[0]
    raise VlmcError(
        f"{where}: unsupported architecture {arch} (model_type {model_type!r}); "
        f"supported families: {', '.join(families())}"
    )


def _require_export_extra() -> None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ModuleNotFoundError as exc:
        raise VlmcError(
            f"exporting needs the export extra ({exc.name} is missing): pip install 'vlmc[export]'"
        ) from exc


def load_source(
    name: str,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    revision: str | None = None,
    lazy: bool = False,
) -> Source:
    """Resolve a model reference and load it in transformers (fp32, eager attention).

    ``lazy`` (what `vlmc export` and `vlmc build` ask for): where the family supports it and the
    weights are safetensors, load only what tracing needs, the model with its repeated layer stacks
    cut to two layers, and let the exporter stream the other layers' weights from the checkpoint
    (vlmc/exporters/streaming.py). ``Source.model`` is then that reduced model and ``Source.config``
    the full one. Without ``lazy`` (tests, verify, anything that runs the model) it is all there.
    """
    _require_export_extra()
    families()  # family modules register their built-ins on import
    if name in zoo.BUILTINS:
        family, _ = zoo.BUILTINS[name]
        model = zoo.build(name)
        _eager(model)
        return Source(name=name, model=model, config=model.config, family=family, builtin=True)
    path = Path(name).expanduser()
    looks_local = (
        path.exists() or name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1]
    )
    if path.exists():
        return _load_local(path, trust_remote_code, allow_pickle, lazy)
    if looks_local or name.count("/") > 1:
        raise VlmcError(
            f"model path {name} does not exist; pass a local Hugging Face model directory, a hub id "
            f"(org/name) or a built-in ({', '.join(sorted(zoo.BUILTINS))})"
        )
    return _load_hub(name, trust_remote_code, allow_pickle, revision, lazy)


# config.json sizes that shape the model built from it: positive ints under vlmc's bounds (limits.py).
_CONFIG_SIZES = {
    "num_hidden_layers": "MAX_LAYERS",
    "num_attention_heads": "MAX_HEADS",
    "num_key_value_heads": "MAX_HEADS",
    "hidden_size": "MAX_HIDDEN",
    "intermediate_size": "MAX_HIDDEN",
    "head_dim": "MAX_HIDDEN",
    "vocab_size": "MAX_VOCAB",
    "max_position_embeddings": "MAX_POSITIONS",
    "image_size": "MAX_IMAGE_SIDE",
    "patch_size": "MAX_IMAGE_SIDE",
    "num_query_tokens": "MAX_TOKENS_PER_IMAGE",
    # vision towers of the Qwen / GLM families name their sizes differently
    "num_heads": "MAX_HEADS",
    "depth": "MAX_LAYERS",
    "embed_dim": "MAX_HIDDEN",
    "out_hidden_size": "MAX_HIDDEN",
    "spatial_merge_size": "MAX_IMAGE_SIDE",
    "temporal_patch_size": "MAX_IMAGE_SIDE",
    "mm_tokens_per_image": "MAX_TOKENS_PER_IMAGE",
    "image_seq_length": "MAX_TOKENS_PER_IMAGE",
}
# (width, heads) pairs of one (sub-)config: without head_dim, the heads split the width evenly. (A Qwen2-VL
# tower's hidden_size is its merger's output, not what its num_heads split: only embed_dim pairs with those.)
_HEAD_SPLITS = (("hidden_size", "num_attention_heads"), ("embed_dim", "num_heads"))
# Lists of layer indices into the stack of the same (sub-)config.
_LAYER_INDEX_KEYS = ("deepstack_visual_indexes", "fullatt_block_indexes")
_SELECT_STRATEGIES = ("default", "full")


def check_config_sizes(config: dict, where: str, prefix: str = "") -> None:
    """Refuse a config.json whose sizes are not positive ints under the bounds, naming the key (exit 2)."""
    for key, value in config.items():
        if isinstance(value, dict) and len(prefix) < 200:
            check_config_sizes(value, where, f"{prefix}{key}.")
            continue
        bound = _CONFIG_SIZES.get(key)
        if bound is None or value is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]  # [h, w] sizes (InternVL)
        for v in values:
            top = getattr(limits, bound)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top:
                raise VlmcError(
                    f"{where}: {prefix}{key}={v!r} must be an integer from 1 to {top} "
                    f"(VLMC_{bound}); the config is damaged or not a real model's"
                )


def check_config(config: dict, where: str) -> None:
    """Refuse a config.json the exporters would trip over, in one line naming the key (exit 2).

    Run on the file as it is (before transformers reads it: its own validators fail with tracebacks or a
    ZeroDivisionError) and again on the config transformers built (defaults filled in). Checked generically,
    in every sub-config: the sizes (:func:`check_config_sizes`), heads that divide the width and the
    key-value heads, ``layer_types`` (one known kind per layer), layer indices inside their stack,
    ``vision_feature_layer`` inside the vision tower's hidden states, the feature select strategy.
    """
    check_config_sizes(config, where)
    _check_structure(config, where, "")
    f = config.get("vision_feature_layer")
    if f is not None:
        vision = config.get("vision_config")
        depth = vision.get("num_hidden_layers") if isinstance(vision, dict) else None
        for v in f if isinstance(f, list) else [f]:
            if not isinstance(v, int) or isinstance(v, bool):
                raise VlmcError(f"{where}: vision_feature_layer={v!r} must be a layer index (an integer)")
            if isinstance(depth, int) and not -(depth + 1) <= v <= depth:
                raise VlmcError(
                    f"{where}: vision_feature_layer={v} is past the vision tower's {depth} layers "
                    f"(hidden states {-(depth + 1)} to {depth})"
                )
    strategy = config.get("vision_feature_select_strategy")
    if strategy is not None and strategy not in _SELECT_STRATEGIES:
        raise VlmcError(
            f"{where}: vision_feature_select_strategy={str(strategy)[:40]!r} must be one of "
            f"{', '.join(_SELECT_STRATEGIES)}"
        )


def _check_structure(config: dict, where: str, prefix: str) -> None:
    for key, value in config.items():
        if isinstance(value, dict) and len(prefix) < 200:
            _check_structure(value, where, f"{prefix}{key}.")
    ints = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    for width, heads in _HEAD_SPLITS:
        if width in ints and heads in ints and config.get("head_dim") is None and ints[width] % ints[heads]:
            raise VlmcError(
                f"{where}: {prefix}{width}={ints[width]} is not divisible by {prefix}{heads}={ints[heads]}"
            )
    heads, kv = ints.get("num_attention_heads"), ints.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise VlmcError(
            f"{where}: {prefix}num_attention_heads={heads} is not a multiple of {prefix}num_key_value_heads={kv}"
        )
    depth = ints.get("num_hidden_layers", ints.get("depth"))
    types = config.get("layer_types")
    if types is not None:
        allowed = _layer_kinds()
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise VlmcError(f"{where}: {prefix}layer_types must be a list of layer kinds (strings)")
        bad = [t for t in types if allowed and t not in allowed]
        if bad:
            raise VlmcError(
                f"{where}: {prefix}layer_types has {bad[0][:40]!r}; known kinds: {', '.join(sorted(allowed))}"
            )
        if depth is not None and len(types) != depth:
            raise VlmcError(f"{where}: {prefix}layer_types lists {len(types)} layers, the stack has {depth}")
    for key in _LAYER_INDEX_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise VlmcError(f"{where}: {prefix}{key} must be a list of layer indices")
        if depth is not None and any(not 0 <= v < depth for v in value):
            raise VlmcError(f"{where}: {prefix}{key}={value[:8]} has an index outside the {depth} layers")


def _layer_kinds() -> set[str]:
    """The attention layer kinds transformers knows (``layer_types`` values), with their legacy names."""
    from transformers import configuration_utils

    kinds = set(getattr(configuration_utils, "ALLOWED_ATTN_LAYER_TYPES", ()))
    return kinds | set(getattr(configuration_utils, "_LEGACY_LAYER_TYPE_REMAP", {})) if kinds else set()


def _load_local(path: Path, trust_remote_code: bool, allow_pickle: bool, lazy: bool = False) -> Source:
    """Load a local model directory, after checking it as untrusted input (docs/security.md): every file
    transformers may open confined and bounded (vlmc/paths.py), config.json sane (:func:`check_config`),
    safetensors headers and the weights against the config (vlmc/exporters/checkpoint.py)."""
    from transformers import AutoConfig

    from vlmc.exporters import streaming  # imports torch (the export extra)

    if not path.is_dir() or not os.path.lexists(path / "config.json"):
        raise VlmcError(f"{path} is not a Hugging Face model directory (no config.json)")
    paths.model_files(path)
    raw = paths.model_json(path, "config.json")
    check_config(raw, f"{path}/config.json")
    native = _native_family(raw)
    if native is not None:
        # a remote-code repository vlmc rebuilds natively: its code never runs, --trust-remote-code or not
        trust_remote_code = False
    try:
        with streaming.quiet_loading():
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise VlmcError(
            f"{path}: cannot read config.json ({_first_line(exc)}); "
            f"if the model needs custom code, pass --trust-remote-code"
        ) from None
    except Exception as exc:  # transformers' config classes validate (and fail) in their own ways
        # a strict-dataclass validation error says which validator on its first line and why on the next
        why = " ".join(line.strip() for line in str(exc).strip().splitlines()[:2])[:300]
        raise VlmcError(f"{path}: cannot read config.json ({type(exc).__name__}: {why})") from None
    family = _family_for_config(config, str(path))
    check_config_sizes(config.to_dict(), f"{path}/config.json")
    has_safetensors = any(path.glob("*.safetensors"))
    has_pickle = any(path.glob("*.bin")) or any(path.glob("*.pt"))
    if not has_safetensors:
        if has_pickle and not allow_pickle:
            raise VlmcError(
                f"{path} has only pickle weights (.bin), which can run code when loaded; "
                "convert them to safetensors or pass --allow-pickle if you trust the source"
            )
        if not has_pickle:
            raise VlmcError(f"{path} has no weights (*.safetensors)")
    mod = families()[family]
    if native is not None:
        if not has_safetensors:
            raise VlmcError(f"{path}: {family} is exported from safetensors weights; convert the .bin files")
        checkpoint.tensors(path)
        if lazy and hasattr(mod, "load_reduced"):
            # its layer stacks cut to the traced depth, the other layers streamed (vlmc/exporters/streaming.py)
            loaded = mod.load_reduced(path, config)
            if loaded is not None:
                model, full_config = loaded
                return Source(
                    name=str(path),
                    model=model,
                    config=full_config,
                    family=family,
                    directory=path,
                    streamed=True,
                )
        model = mod.load_local(path, config)
        return Source(name=str(path), model=model, config=model.config, family=family, directory=path)
    if has_safetensors:
        held = checkpoint.tensors(path)
        try:
            lay = streaming.layout(path, mod.model_class(), config, held, trust_remote_code)
        except VlmcError:
            raise
        except Exception as exc:  # transformers builds the model the config describes, or fails its own way
            raise VlmcError(
                f"{path}: transformers cannot build the model config.json describes "
                f"({type(exc).__name__}: {_first_line(exc)})"
            ) from None
        if lazy and not trust_remote_code:
            src = _load_reduced(path, mod, config, family, lay)
            if src is not None:
                return src
    try:
        with streaming.quiet_loading():
            model, info = mod.model_class().from_pretrained(
                str(path),
                use_safetensors=has_safetensors,
                trust_remote_code=trust_remote_code,
                dtype="float32",
                attn_implementation="eager",
                output_loading_info=True,
            )
    except Exception as exc:  # safetensors raises its own SafetensorError on a damaged file
        raise VlmcError(f"{path}: cannot load weights ({type(exc).__name__}: {_first_line(exc)})") from None
    checkpoint.refuse_missing(path, info)
    model.eval()
    _eager(model)
    return Source(
        name=str(path),
        model=model,
        config=model.config,
        family=family,
        directory=path,
        trusted=trust_remote_code,
    )


def _native_family(raw) -> str | None:
    """The family of a config.json whose model_type a family rebuilds natively (a ``load_local``), else None."""
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    for name, mod in families().items():
        if model_type in mod.MODEL_TYPES and hasattr(mod, "load_local"):
            return name
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _load_reduced(path: Path, mod: ModuleType, config, family: str, lay) -> Source | None:
    """The family's cut of the model for a streaming export, or None where it has none."""
    from vlmc.exporters import streaming

    depths = mod.stream_depths(config) if hasattr(mod, "stream_depths") else {}
    if not depths:
        return None
    try:
        loaded = streaming.load_reduced(path, mod.model_class(), config, depths, lay)
    except (OSError, ValueError, RuntimeError) as exc:
        raise VlmcError(f"{path}: cannot load weights ({_first_line(exc)})") from exc
    if loaded is None:
        return None
    model, full_config = loaded
    _eager(model)
    return Source(
        name=str(path), model=model, config=full_config, family=family, directory=path, streamed=True
    )


def _load_hub(
    name: str, trust_remote_code: bool, allow_pickle: bool, revision: str | None, lazy: bool = False
) -> Source:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"] + (
        ["*.bin"] if allow_pickle else []
    )
    try:
        local = snapshot_download(name, revision=revision, allow_patterns=patterns)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError, OSError) as exc:
        raise VlmcError(
            f"cannot download {name!r}: the hub is unreachable (offline?) and it is not cached; "
            "download it elsewhere and pass the local directory instead"
        ) from exc
    except HfHubHTTPError as exc:
        raise VlmcError(f"cannot download {name!r} from the hub: {str(exc).splitlines()[0]}") from exc
    src = _load_local(Path(local), trust_remote_code, allow_pickle, lazy)
    src.name = name
    return src


def _eager(model) -> None:
    # Exported graphs use the plain attention math; sdpa/flash kernels do not export to opset 17 cleanly.
    for cfg in _configs(model.config):
        cfg._attn_implementation = "eager"


def _configs(config):
    yield config
    for key in ("text_config", "vision_config", "qformer_config"):
        sub = getattr(config, key, None)
        if sub is not None:
            yield sub


def export(source: Source, scratch: str | Path | None = None) -> Package:
    """Export a loaded source model into a Package whose graphs are files in a scratch directory.

    Each stage graph's weights are streamed from the torch model to its file as it is exported
    (:func:`vlmc.exporters.base.export_graph`), so no graph is ever held in memory beside the source
    model. ``scratch`` is a directory the caller owns and removes (default: a temporary directory
    removed with the package); :meth:`Package.save` moves the files out of it.
    """
    from vlmc.exporters import streaming

    mod = families()[source.family]
    m = manifest.new(source.family, source.architecture, source.name, source.config_hash)
    pkg = Package(m)
    if scratch is not None:
        pkg.use_scratch(scratch)
    with ui.progress(f"exporting {source.name} ({source.family})"):
        try:
            mod.export(source, pkg)
        except streaming.StitchError as exc:
            if not source.streamed:
                raise
            # The layers are not one repeated subgraph after all: export the whole model instead.
            ui.warn(f"{source.name}: streaming export not possible ({exc}); loading the whole model")
            whole = _load_local(source.directory, trust_remote_code=False, allow_pickle=False)
            whole.name = source.name
            return export(whole, scratch)
    if source.directory is not None:
        _attach_source_files(source.directory, pkg, source.trusted)
    manifest.validate(pkg.manifest, where="exported manifest")
    return pkg


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
    "added_tokens.json",
    "generation_config.json",
)


def _attach_source_files(directory: Path, pkg: Package, trusted: bool = False) -> None:
    """Copy tokenizer and processor files so the package runs without its source.

    Each is a regular file inside the model directory's fence, bounded (vlmc/paths.py: load_source checked
    them already; they are read through the rule again here, where they are copied)."""
    found = []
    for fname in _TOKENIZER_FILES:
        data = paths.model_bytes(directory, fname)
        if data is not None:
            pkg.files[f"source/{fname}"] = data
            found.append(fname)
    has_tok = any(f in found for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    # a family that stored the tokenizer itself (a native rebuild of remote code: its processor is code vlmc
    # does not run) keeps it
    if has_tok and pkg.manifest["text"].get("tokenizer") != "source":
        processor.attach(directory, pkg, trusted)
    if "preprocessor_config.json" in found or "processor_config.json" in found:
        pkg.manifest["vision"]["processor"] = "source"
