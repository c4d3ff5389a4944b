"""The source directory's own processor (transformers AutoProcessor) and the tokenizer facts packages carry.

Used by the exporters (to store the tokenizer exactly as the processor builds it, its chat template and image
token) and by verify (whose reference inputs come from this processor, never from vlmc's runtime).
"""

from __future__ import annotations

import logging
from pathlib import Path

from vlmc import paths
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer/tokenizer.json"
CHAT_TEMPLATE_FILE = "tokenizer/chat_template.jinja"


def _declared_class(directory: Path) -> str | None:
    for name in ("processor_config.json", "preprocessor_config.json"):
        cls = (paths.model_json(directory, name) or {}).get("processor_class")
        if isinstance(cls, str) and cls:
            return cls
    return None


def _images_only(cls):
    """The processor class without its video processor (transformers builds those only with torchvision).

    Everything the image path runs (image processor, tokenizer, placeholder expansion, chat template) is the
    class's own code; only the video sub-processor is left out of the attributes it loads.
    """
    keep = [a for a in cls.get_attributes() if "video" not in a]
    return type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda c: list(keep))})


def load(directory, trust_remote_code: bool = False):
    """AutoProcessor.from_pretrained(directory), or the tokenizer alone when the directory has no processor.

    Raises:
        VlmcError: transformers cannot load the directory's processor or tokenizer.
    """
    import transformers
    from transformers import AutoProcessor

    directory = Path(directory)
    paths.model_files(directory)  # regular files inside the directory (or its hub cache folder), bounded
    declared = paths.custom_code(directory)
    if declared and not trust_remote_code:
        raise VlmcError(
            f"{directory}: the processor or tokenizer needs the model's own code (auto_map in {declared}), "
            "which runs only with --trust-remote-code; read that code first"
        )
    try:
        return AutoProcessor.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except (ImportError, ValueError) as exc:
        # transformers says "needs torchvision" with an ImportError for some video processors and a ValueError
        # from AutoVideoProcessor for others (InternVL); any other ValueError is a broken directory.
        name = _declared_class(directory)
        if "torchvision" not in str(exc).lower() or not hasattr(transformers, name or ""):
            raise VlmcError(
                f"{directory}: cannot load the processor ({str(exc).strip().splitlines()[0]})"
            ) from exc
        logger.warning(
            "%s: loading %s without its video processor (transformers needs torchvision for it); images only",
            directory,
            name,
        )
        return _images_only(getattr(transformers, name)).from_pretrained(
            str(directory), trust_remote_code=trust_remote_code
        )
    except (OSError, TypeError) as exc:
        raise VlmcError(
            f"{directory}: cannot load the processor ({str(exc).strip().splitlines()[0]})"
        ) from exc


def tokenizer_of(proc):
    return getattr(proc, "tokenizer", proc)


def image_token(proc) -> str | None:
    tok = getattr(proc, "image_token", None)
    return None if tok is None else str(getattr(tok, "content", tok))


def chat_template(proc) -> str | None:
    template = getattr(proc, "chat_template", None) or getattr(tokenizer_of(proc), "chat_template", None)
    if isinstance(template, dict):  # named templates: the processor uses "default" unless told otherwise
        template = template.get("default")
    return template if isinstance(template, str) else None


def attach(directory, pkg, trust_remote_code: bool = False) -> None:
    """Store the processor's tokenizer (as a `tokenizers` JSON), chat template and image token in ``pkg``.

    transformers may rebuild a tokenizer from tokenizer.json with its own class's pipeline (LlamaTokenizer's
    Metaspace settings come from its ``legacy`` flag, not from the file), so the file the runtime uses is the
    backend the processor actually tokenizes with, serialized.
    """
    proc = load(directory, trust_remote_code)
    tok = tokenizer_of(proc)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise VlmcError(
            f"{directory}: the tokenizer ({type(tok).__name__}) has no `tokenizers` backend, "
            "which vlmc runs; "
            "save the model with a fast tokenizer (tokenizer.json)"
        )
    text = pkg.manifest["text"]
    pkg.files[TOKENIZER_FILE] = backend.to_str().encode("utf-8")
    text["tokenizer"] = "source"
    text["tokenizer_file"] = TOKENIZER_FILE
    text["special_tokens"] = {k: str(v) for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    template = chat_template(proc)
    if template is not None:
        pkg.files[CHAT_TEMPLATE_FILE] = template.encode("utf-8")
        text["chat_template"] = CHAT_TEMPLATE_FILE
    image_id = int(pkg.manifest["vision"]["image_token_id"])
    if text.get("image_expansion"):
        # The prompt's marker expands into more than the image token run (e.g. Gemma3: <start_of_image>,
        # whose processor calls the marker its image_token): the placeholder is whichever of the tokenizer's
        # and processor's image tokens the tokenizer maps to the config's image token id.
        names = [getattr(tok, "image_token", None), image_token(proc), text.get("image_token")]
        names = [str(getattr(n, "content", n)) for n in names if n is not None]
        hit = next((n for n in names if backend.token_to_id(n) == image_id), None)
        key, value = "image_token", hit if hit is not None else (names[0] if names else None)
    else:
        key, value = "image_marker", image_token(proc)
    if value is not None:
        text[key] = value
    found = backend.token_to_id(text.get(key) or text.get("image_marker", "<image>"))
    if found != image_id:
        raise VlmcError(
            f"{directory}: the tokenizer maps the image token {text.get(key)!r} to {found}, "
            "but the "
            f"config's image token id is {image_id}; the tokenizer and config.json do not belong together"
        )
