"""Family-agnostic runtime: every family's manifest drives the same loop, and shared code names no family."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vlmc import exporters, verify
from vlmc.cli import main
from vlmc.exporters import zoo
from vlmc.package import Package
from vlmc.runtime import Pipeline

REPO = Path(__file__).resolve().parents[2]
# Shared code that must stay family-agnostic: all of the runtime (generation loop, preprocessing,
# positions, KV state), the pass manager, the passes and the backends. Manifest kinds name what they
# do (e.g. preprocessing kind "packed_patches"), never the family that writes them.
SHARED = [
    *sorted((REPO / "vlmc/runtime").glob("*.py")),
    REPO / "vlmc/manager.py",
    *sorted((REPO / "passes").glob("*.py")),
    *sorted((REPO / "vlmc/backends").rglob("*.py")),
]


def _builtin_per_family() -> dict[str, str]:
    fams = exporters.families()  # importing the family modules registers their built-ins
    out: dict[str, str] = {}
    for name, (family, _) in sorted(zoo.BUILTINS.items()):
        if family in fams:
            out.setdefault(family, name)
    return out


BUILTIN_FAMILIES = _builtin_per_family()


def _family_words() -> set[str]:
    # Every registered family name, plus the stems people write in code ("qwen", "blip", "llava").
    words = {"llava", "qwen", "blip"}
    for fam in exporters.FAMILY_MODULES:
        words.add(fam.lower())
        words.add(re.split(r"[\d_]", fam)[0].lower())
    return {w for w in words if len(w) >= 4}


# Python >= 3.12 splits f-strings into FSTRING_MIDDLE pieces; earlier versions give one STRING token.
_TEXT_TOKENS = {tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
_LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical", "warn"}


def _prose_lines(tree: ast.AST) -> set[int]:
    """Lines of docstrings and of raise/log/warn messages: naming a family there is an example, not a branch."""
    lines: set[int] = set()

    def cover(node: ast.AST) -> None:
        lines.update(range(node.lineno, node.end_lineno + 1))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                cover(body[0])
        elif isinstance(node, ast.Raise) and node.exc is not None:
            cover(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _LOG_CALLS
        ):
            cover(node)
    return lines


def family_mentions(source: str) -> list[str]:
    """Code lines that name a model family (case-insensitive word stem) in an identifier or string.

    Comments, docstrings and error/log messages are skipped; any other mention (a comparison, a
    dispatch key, an attribute) is how a family branch shows up.
    """
    pattern = re.compile("|".join(sorted(_family_words())), re.IGNORECASE)
    prose = _prose_lines(ast.parse(source))
    hits: list[int] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if (
            tok.type in _TEXT_TOKENS
            and tok.start[0] not in prose
            and pattern.search(tok.string)
            and tok.start[0] not in hits
        ):
            hits.append(tok.start[0])
    lines = source.splitlines()
    return [lines[n - 1].strip() for n in hits]


class RecordingPipeline(Pipeline):
    """The runtime unchanged, remembering which graphs it ran (to see the manifest chain was walked)."""

    def __init__(self, pkg: Package) -> None:
        super().__init__(pkg)
        self.ran: list[str] = []

    def run_graph(self, name, available):
        self.ran.append(name)
        return super().run_graph(name, available)


@pytest.fixture(scope="module", params=sorted(BUILTIN_FAMILIES))
def family_package(request, exported):
    family = request.param
    return family, Package.load(exported(BUILTIN_FAMILIES[family]))


def test_builtins_cover_llava_and_blip2():
    assert {"llava", "blip2"} <= set(BUILTIN_FAMILIES)
    assert BUILTIN_FAMILIES["blip2"] == "tiny-blip2" and BUILTIN_FAMILIES["llava"] == "tiny-llava"


def test_runtime_walks_each_family_manifest(family_package):
    family, pkg = family_package
    m = pkg.manifest
    assert m["model"]["family"] == family
    pipe = RecordingPipeline(pkg)
    res = pipe.generate(["Describe the image.", "Hi"], [["demo:1"], ["demo:2"]], max_new_tokens=3)
    chain = m["pipeline"]
    image_graphs = [g for g in pipe.ran if g in chain["image"]]
    # the image chain ran once, in the manifest's order, before the decoder
    assert image_graphs == chain["image"]
    assert pipe.ran.index(chain["decoder"][0]) > pipe.ran.index(chain["image"][-1])
    assert set(pipe.ran) == set(chain["image"]) | {chain["embed"]} | set(chain["decoder"])
    assert res.prefill_logits.shape == (2, m["text"]["vocab_size"])
    assert all(1 <= len(t) <= 3 for t in res.tokens)
    one = pipe.prepare(["x"], [["demo:1"]])
    expected_slots = sum(pipe.tokens_for_images(one.vision, 1, one.image_tiles)) * 2
    assert res.image_tokens == expected_slots


def test_each_family_package_is_token_exact_through_the_shared_loop(family_package):
    _, pkg = family_package
    res = verify.verify(
        pkg, max_new_tokens=8, prompts=["Describe the image.", "Hi"], images=[["demo:1"], ["demo:2"]]
    )
    assert res.passed and res.tokens_package == res.tokens_reference
    assert res.prefill_logits_max_abs_diff <= 1e-4


def test_image_chain_features_fill_exactly_the_placeholders(family_package):
    _, pkg = family_package
    pipe = Pipeline(pkg)
    inp = pipe.prepare(["Describe the image."], [["demo:5"]])
    embeds = pipe.prefill_embeds(inp)
    slots = inp.input_ids[0] == pkg.manifest["vision"]["image_token_id"]
    feats = pipe.image_features(inp.vision)
    np.testing.assert_array_equal(embeds[0, slots], feats)
    np.testing.assert_array_equal(embeds[0, ~slots], pipe.embed(inp.input_ids)[0, ~slots])


@pytest.mark.parametrize("path", SHARED, ids=lambda p: str(p.relative_to(REPO)))
def test_shared_code_names_no_family(path):
    assert family_mentions(path.read_text()) == []


def test_family_check_catches_a_branch():
    # The check above must be able to fail: a family branch in any spelling is caught ...
    code = (
        'if m["model"]["family"] == "blip2":\n    pass\nx = 1\nif "Qwen2-VL" in arch:\n    pass\n'
        'KINDS = {"llava": run}\nuse_llava_layout = True\n'
    )
    assert family_mentions(code) == [
        'if m["model"]["family"] == "blip2":',
        'if "Qwen2-VL" in arch:',
        'KINDS = {"llava": run}',
        "use_llava_layout = True",
    ]
    # ... while prose that names a family as an example is not a branch.
    prose = (
        '"""Prune tokens (e.g. Qwen2-VL merges patches)."""\n'
        "x = 1  # BLIP-2 has a fusion stage\n"
        'if role == "fusion":\n    raise VlmcError("learned queries (e.g. BLIP-2\'s Q-Former) cannot be pruned")\n'
        'logger.warning("llava: %d nodes", 3)\n'
    )
    assert family_mentions(prose) == []


def test_export_list_shows_builtins_and_families():
    result = CliRunner().invoke(main, ["export", "--list"])
    assert result.exit_code == 0, result.output
    for name in zoo.BUILTINS:
        assert name in result.output
    for family, mod in exporters.families().items():
        assert family in result.output
        assert mod.ARCHITECTURES[0] in result.output


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        architectures=["LlamaForCausalLM"],
    )


def _tiny_paligemma_config():
    from transformers import PaliGemmaConfig

    return PaliGemmaConfig(architectures=["PaliGemmaForConditionalGeneration"])


@pytest.mark.parametrize(
    ("make", "arch", "model_type"),
    [
        (_tiny_llama_config, "LlamaForCausalLM", "llama"),
        (_tiny_paligemma_config, "PaliGemmaForConditionalGeneration", "paligemma"),
    ],
)
def test_unsupported_architecture_fails_with_one_line(tmp_path, make, arch, model_type):
    src = tmp_path / "src"
    make().save_pretrained(src)
    result = CliRunner().invoke(main, ["export", str(src), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert f"unsupported architecture {arch}" in lines[0] and repr(model_type) in lines[0]
    listed = lines[0].split("supported families:", 1)[1]
    assert [f.strip() for f in listed.split(",")] == list(exporters.families())
    assert not (tmp_path / "out").exists()


def test_shared_list_covers_the_generation_loop_and_manager():
    names = {str(p.relative_to(REPO)) for p in SHARED}
    assert {
        "vlmc/runtime/pipeline.py",
        "vlmc/runtime/kv.py",
        "vlmc/runtime/preprocess.py",
        "vlmc/runtime/patches.py",
        "vlmc/manager.py",
    } <= names
    assert any(n.startswith("passes/") for n in names)
