"""The vlmc command line: a thin click layer over the library.

User errors print one line on stderr and exit 2 (a failed check exits 1); ``-v`` shows tracebacks.
"""

from __future__ import annotations

import errno
import json
import logging
import signal
import threading
from pathlib import Path

import click

from vlmc import __version__, ui
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every atomic write removes its temporary directory."""


def _raise_on_sigterm(ctx: click.Context) -> None:
    # The default SIGTERM action kills the process without unwinding, leaving .tmp-* directories behind.
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))


class _Group(click.Group):
    """Turns VlmcError (and interrupts) into one-line messages with the right exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except VlmcError as exc:
            if ui.is_verbose():
                logger.exception("error")
            click.echo(f"vlmc: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            click.echo("vlmc: interrupted; nothing was written", err=True)
            ctx.exit(143 if isinstance(exc, _Terminated) else 130)
        except OSError as exc:
            if ui.is_verbose():
                logger.exception("error")
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            hint = (
                "; free some space or write elsewhere, nothing was written"
                if exc.errno == errno.ENOSPC
                else ""
            )
            click.echo(f"vlmc: error: {exc.strerror or exc}{where}{hint}", err=True)
            ctx.exit(2)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as exc:  # a vlmc bug: still one line unless -v
            if ui.is_verbose():
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            click.echo(
                f"vlmc: internal error: {type(exc).__name__}: {first} (run with -v for the traceback)",
                err=True,
            )
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlmc")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging and full tracebacks.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors.")
def main(verbose: bool, quiet: bool) -> None:
    """vlmc: compile Hugging Face vision-language models into checked ONNX packages and Ascend builds.

    Example:

        vlmc build --recipe recipes/demo.yaml -o out/demo
    """
    ui.configure(quiet=quiet, verbose=verbose)
    _raise_on_sigterm(click.get_current_context())


def _export_options(f):
    f = click.option(
        "--trust-remote-code", is_flag=True, help="Allow the model's own Python code (off by default)."
    )(f)
    f = click.option("--allow-pickle", is_flag=True, help="Allow pickle (.bin) weights (off by default).")(f)
    return f


@main.command()
@click.argument("model", required=False)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Package directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing vlmc package at the output.")
@click.option("--list", "list_", is_flag=True, help="List built-in models and supported families.")
@_export_options
def export(model, output, force, list_, trust_remote_code, allow_pickle):
    """Export a Hugging Face VLM (hub id, local directory or built-in) to a vlmc package.

    Example:

        vlmc export tiny-llava -o out/tiny-llava
    """
    from vlmc import exporters
    from vlmc.exporters import zoo

    if list_:
        fams = exporters.families()
        rows = [[name, fam, ""] for name, (fam, _) in sorted(zoo.BUILTINS.items())]
        rows += [["", name, ", ".join(mod.ARCHITECTURES)] for name, mod in fams.items()]
        ui.show(ui.table("built-ins and families", ["built-in", "family", "architectures"], rows))
        return
    if not model or not output:
        raise click.UsageError("export needs MODEL and -o/--output (or --list)")
    from vlmc import outdir

    outdir.check(output.resolve(), force)
    source = exporters.load_source(
        model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, lazy=True
    )
    pkg = exporters.export(source)
    del source
    path = pkg.save(output, force=force)
    ui.info(f"wrote {path}")
    _summary(pkg)


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option(
    "-r", "--recipe", "recipe_path", required=True, type=click.Path(path_type=Path), help="Recipe YAML."
)
@click.option(
    "-o", "--output", required=True, type=click.Path(path_type=Path), help="Package directory to write."
)
@click.option("--check", is_flag=True, help="Check numerics-preserving passes on onnxruntime.")
@click.option("--force", is_flag=True, help="Replace an existing vlmc package at the output.")
def optimize(package, recipe_path, output, check, force):
    """Run a recipe's passes over a package and write a new package.

    Example:

        vlmc optimize out/tiny-llava --recipe recipes/demo.yaml -o out/tiny-llava-opt --check
    """
    from vlmc import manager, outdir, recipe
    from vlmc import package as P

    r = recipe.load(recipe_path)
    outdir.check(output.resolve(), force, source=package)
    pkg = P.Package.load(package)
    pkg = manager.run(pkg, r.steps, check=check)
    path = pkg.save(output, force=force)
    ui.info(f"wrote {path}")
    _summary(pkg)


@main.command()
@click.option(
    "-r", "--recipe", "recipe_path", required=True, type=click.Path(path_type=Path), help="Recipe YAML."
)
@click.option(
    "-o", "--output", required=True, type=click.Path(path_type=Path), help="Build directory to write."
)
@click.option("--check", is_flag=True, help="Check numerics-preserving passes on onnxruntime.")
@click.option("--force", is_flag=True, help="Replace an existing vlmc build at the output.")
@_export_options
def build(recipe_path, output, check, force, trust_remote_code, allow_pickle):
    """Export, optimize and (if the recipe names a target) compile in one step.

    Writes OUTPUT/package (and OUTPUT/build when compiled).

    Example:

        vlmc build --recipe recipes/demo.yaml -o out/demo
    """
    from vlmc import build as B
    from vlmc import recipe

    r = recipe.load(recipe_path)
    result = B.build(
        r, output, check=check, force=force, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle
    )
    _summary(result.package)
    ui.info(f"wrote {output}")


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option(
    "--image", "images", multiple=True, help="Image file (repeatable), or 'demo' for a built-in picture."
)
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text (repeatable: a batch).")
@click.option(
    "--max-new-tokens",
    default=20,
    show_default=True,
    type=click.IntRange(1, 4096),
    help="Tokens to generate per prompt (fewer if every prompt reaches end-of-sequence).",
)
@click.option("--json", "as_json", is_flag=True, help="Print tokens and text as JSON.")
def run(package, images, prompts, max_new_tokens, as_json):
    """Generate text for prompts (and images) with the package on onnxruntime CPU.

    With several prompts, images are shared out in order, one per placeholder.

    Example:

        vlmc run out/demo/package --image demo --prompt "Describe the image."
    """
    from vlmc.package import Package
    from vlmc.runtime import Pipeline

    pkg = Package.load(package)
    pipe = Pipeline(pkg)
    per_prompt = _distribute(list(prompts), list(images), pkg.manifest["text"].get("image_marker", "<image>"))
    result = pipe.generate(list(prompts), per_prompt, max_new_tokens)
    if as_json:
        click.echo(json.dumps({"tokens": result.tokens, "texts": result.texts}))
        return
    for p, text, toks in zip(prompts, result.texts, result.tokens):
        ui.stdout.print(f"[bold]{p}[/bold] -> {text!r}  ({len(toks)} tokens: {toks})")


def _distribute(prompts: list[str], images: list[str], marker: str) -> list[list[str]]:
    """Give each prompt as many images as it has placeholders (one each if it has none; a single plain
    prompt takes them all, the chat template places them)."""
    out, k = [], 0
    for p in prompts:
        n = p.count(marker) or (len(images) if len(prompts) == 1 else 1 if images else 0)
        out.append(images[k : k + n])
        k += n
    if k != len(images):
        raise VlmcError(
            f"{len(images)} image(s) given but the prompts take {k}; "
            f"put one {marker!r} in the prompts for each --image"
        )
    return out


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option(
    "--max-new-tokens",
    default=20,
    show_default=True,
    type=click.IntRange(1, 4096),
    help="Greedy tokens compared between transformers and the package.",
)
@click.option("--image", "images", multiple=True, help="Image file(s); default: built-in demo pictures.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt(s); default: 'Describe the image.'")
@click.option(
    "--max-logit-diff",
    type=float,
    help="Fail above this prefill logits max |diff| (default 1e-4 for exact packages).",
)
@click.option(
    "--min-token-agreement",
    type=float,
    help="Fail below this fraction of equal tokens (default 1.0 for exact packages).",
)
@_export_options
def verify(
    package,
    max_new_tokens,
    images,
    prompts,
    max_logit_diff,
    min_token_agreement,
    trust_remote_code,
    allow_pickle,
):
    """Compare the package with transformers on the same inputs; exit 1 past the thresholds.

    Example:

        vlmc verify out/demo/package --max-new-tokens 20
    """
    from vlmc import verify as V
    from vlmc.package import Package

    pkg = Package.load(package)
    prompts = list(prompts) or None
    per = (
        _distribute(prompts, list(images), pkg.manifest["text"].get("image_marker", "<image>"))
        if images and prompts
        else ([[i] for i in images] if images else None)
    )
    if per is not None and prompts is None:
        prompts = V.DEFAULT_PROMPTS * len(per)
    res = V.verify(
        pkg,
        max_new_tokens,
        prompts,
        per,
        max_logit_diff,
        min_token_agreement,
        trust_remote_code,
        allow_pickle,
    )
    V.write(pkg, res)
    rows = _input_rows(res.inputs) + [
        ["(b) prefill logits max |diff|", f"{res.prefill_logits_max_abs_diff:.3g}"],
        ["(b) prefill logits cosine", f"{res.prefill_logits_cosine:.6f}"],
        ["(c) top-1 agreement", f"{res.top1_agreement:.3f}"],
        ["(c) token agreement", f"{res.token_agreement:.3f} over {max_new_tokens} new tokens"],
        ["(c) common prefix", str(res.common_prefix)],
        ["result", "PASS" if res.passed else "FAIL"],
    ]
    if res.prefill_logits_kl is not None:
        at = next(i for i, r in enumerate(rows) if r[0] == "(c) top-1 agreement")
        rows[at:at] = [["(b) prefill KL(reference || package)", f"{res.prefill_logits_kl:.4g}"]]
        rows[at + 2 : at + 2] = [["(c) top-5 agreement", f"{res.top5_agreement:.3f}"]]
    if res.visual_tokens and res.visual_tokens["package"] != res.visual_tokens["reference"]:
        rows.insert(
            0,
            [
                "visual tokens per image",
                f"{res.visual_tokens['package']} (reference {res.visual_tokens['reference']})",
            ],
        )
    ui.show(
        ui.table(
            f"verify {res.source} ({'exact' if res.exact_package else 'lossy'} package)",
            ["metric", "value"],
            rows,
        )
    )
    if not res.passed:
        from vlmc.errors import CheckFailed

        inputs = res.inputs or {}
        if res.exact_package and not inputs.get("passed", True):
            raise CheckFailed(
                "verify failed: the runtime's inputs differ from the source processor's: "
                + (inputs.get("first_difference") or inputs.get("vision_difference"))
            )
        raise CheckFailed(
            f"verify failed: logits max |diff| {res.prefill_logits_max_abs_diff:.3g}, "
            f"token agreement {res.token_agreement:.3f} (thresholds {res.thresholds})"
        )


def _input_rows(inputs: dict | None) -> list[list[str]]:
    """verify's (a) rows: the runtime's ids and pixels against the source processor's."""
    if not inputs or not inputs.get("checked"):
        return [["(a) inputs vs processor", f"not checked: {(inputs or {}).get('reason', 'no processor')}"]]
    rows = [
        [
            f"(a) token ids vs {inputs.get('processor', 'processor')}",
            "identical" if inputs["ids_equal"] else inputs["first_difference"],
        ]
    ]
    if inputs.get("pixel_max_abs_diff") is not None:
        rows.append(["(a) pixel values max |diff|", f"{inputs['pixel_max_abs_diff']:.3g}"])
    if "image_grid_thw_equal" in inputs:
        rows.append(["(a) image grids", "identical" if inputs["image_grid_thw_equal"] else "differ"])
    if inputs.get("vision_difference"):
        rows.append(["(a) vision inputs", inputs["vision_difference"]])
    return rows


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@click.option(
    "--pruning",
    "pruning_image",
    help="For a pruned package: draw the patches kept for this image (a file, or 'demo') into a PNG.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="PNG to write with --pruning (default pruning.png).",
)
def inspect(package, as_json, pruning_image, output):
    """Show a package: graphs with IO, ops, weights, precision, KV layout and pass history.

    Example:

        vlmc inspect out/demo/package

        vlmc inspect out/pruned --pruning demo -o kept.png
    """
    from vlmc import report
    from vlmc.package import Package

    pkg = Package.load(package)
    if pruning_image:
        from vlmc import pruning

        out = output or Path("pruning.png")
        out.write_bytes(pruning.picture(pkg, pruning_image))
        p = pruning.facts(pkg)
        ui.info(f"wrote {out}: {p['keep']} of {p['tokens_before']} visual tokens kept ({p['method']})")
        return
    if as_json:
        click.echo(json.dumps(report.summary(pkg), indent=2, sort_keys=True, default=str))
        return
    click.echo(report.render_markdown(pkg), nl=False)  # byte for byte the package's report.md


@main.command()
@click.argument("package", type=click.Path(path_type=Path), required=False)
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    help="Plan from a Hugging Face config.json or a vlmc sizing spec instead of a package.",
)
@click.option("--device-memory", required=True, help="Memory per card, e.g. 16GiB or 16GB.")
@click.option("--images", default=1, show_default=True, type=click.IntRange(0), help="Images per sequence.")
@click.option(
    "--text-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(0),
    help="Text tokens per sequence (prompt plus generated).",
)
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1), help="Concurrent sequences.")
@click.option(
    "--cards",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Cards sharing the model (tensor parallel).",
)
@click.option(
    "--block-size", type=click.IntRange(1), help="Paged block size (default: the package's, else 128)."
)
@click.option(
    "--max-context",
    type=click.IntRange(1),
    help="Tokens a contiguous cache reserves per sequence (default: max positions).",
)
@click.option(
    "--reserve", default="0", show_default=True, help="Memory the runtime keeps per card, e.g. 1GiB."
)
@click.option(
    "--precision",
    "precisions",
    multiple=True,
    help="With --config: ROLE=PRECISION, e.g. vision=int8 (default fp16).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(
    package,
    config_path,
    device_memory,
    images,
    text_tokens,
    batch,
    cards,
    block_size,
    max_context,
    reserve,
    precisions,
    as_json,
):
    """Plan device memory: weights, KV per token/block, image tokens, headroom -> sequences and context that fit.

    Compares the paged KV reservation with a contiguous cache's worst case for the request mix.

    Example:

        vlmc plan out/demo/package --device-memory 16GiB --images 4 --text-tokens 2048 --batch 2
    """
    from vlmc import plan as PL
    from vlmc.package import Package

    if (package is None) == (config_path is None):
        raise click.UsageError("plan needs a PACKAGE or --config (one of them)")
    prec = {}
    for item in precisions:
        role, _, value = item.partition("=")
        if not value or value not in PL.WEIGHT_BYTES:
            raise VlmcError(
                f"--precision {item!r}: write ROLE=PRECISION with PRECISION one of {', '.join(PL.WEIGHT_BYTES)}"
            )
        prec[role] = value
    if config_path is not None:
        spec = PL.load_spec(config_path, prec or None)
    else:
        if prec:
            raise click.UsageError(
                "--precision only applies with --config (a package states its own precisions)"
            )
        spec = PL.spec_from_package(Package.load(package))
    result = PL.plan(
        spec,
        device_memory,
        images=images,
        text_tokens=text_tokens,
        batch=batch,
        cards=cards,
        block_size=block_size,
        max_context=max_context,
        reserve=reserve,
    )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        return
    ui.show(ui.table(f"plan for {spec.name}", ["quantity", "value"], result.rows()))
    for note in result.notes:
        ui.info(f"note: {note}")


@main.command()
@click.option("--schema", is_flag=True, help="Print the recipe JSON Schema instead.")
def passes(schema):
    """List the registered passes and their options.

    Example:

        vlmc passes
    """
    from vlmc import pass_api, recipe

    if schema:
        click.echo(json.dumps(recipe.json_schema(), indent=2, sort_keys=True))
        return
    rows = []
    for name, cls in pass_api.registry().items():
        opts = ", ".join(f"{o.name}={o.default!r}" for o in cls.options) or "-"
        rows.append([name, cls.summary, opts])
    ui.show(ui.table("passes", ["pass", "what it does", "options (defaults)"], rows))


@main.command(name="compile")
@click.argument("package", type=click.Path(path_type=Path))
@click.option(
    "-o", "--output", required=True, type=click.Path(path_type=Path), help="Build directory to write."
)
@click.option(
    "--target",
    "backend",
    default="ascend",
    show_default=True,
    type=click.Choice(["ascend", "ort"]),
    help="Backend: ascend (ATC builds) or ort (a package runnable here).",
)
@click.option(
    "--soc", default=None, help="Ascend SoC: an exact variant (Ascend910B1…B4-1) or the family Ascend910B."
)
@click.option(
    "--soc-variant", default=None, help="910B variant to use when --soc is the family and npu-smi is absent."
)
@click.option(
    "-r",
    "--recipe",
    "recipe_path",
    type=click.Path(path_type=Path),
    help="Take the backend and its options from a recipe's target (explicit flags win).",
)
@click.option("--run", "run_atc", is_flag=True, help="Run atc when it is on PATH and collect the .om files.")
@click.option("--force", is_flag=True, help="Replace an existing vlmc build at the output.")
def compile_(package, output, backend, soc, soc_variant, recipe_path, run_atc, force):
    """Lower a package for a backend and write the build (ATC commands, build.sh, compile.json).

    Everything is prechecked before anything is written; without atc on PATH the build directory
    is still complete and `--run` says atc is missing.

    Example:

        vlmc compile out/demo/package --soc Ascend910B -o out/demo-910b
    """
    from click.core import ParameterSource

    from vlmc import backends
    from vlmc import recipe as R
    from vlmc.package import Package

    target = dict(R.load(recipe_path).target or {}) if recipe_path else {}
    explicit = click.get_current_context().get_parameter_source("backend") is not ParameterSource.DEFAULT
    if explicit and target.get("backend", backend) != backend:
        target = {}  # the recipe's options belong to another backend
    elif target:
        backend = target["backend"]
    target["backend"] = backend
    if backend == "ascend":
        for key, value in (("soc", soc), ("soc_variant", soc_variant)):
            if value is not None:
                target[key] = value
        if run_atc:
            target["run"] = True
    elif soc or soc_variant or run_atc:
        raise click.UsageError("--soc, --soc-variant and --run apply to --target ascend only")
    target = backends.validate_target(target, where="compile target")
    pkg = Package.load(package)
    summary = backends.get(backend).compile(pkg, output, target, force=force)
    rows = [
        [name, pkg.info(name)["role"] if name in pkg.manifest["graphs"] else "", g.get("precision", "")]
        for name, g in summary.get("graphs", {}).items()
    ]
    ui.show(
        ui.table(
            f"compiled for {backend}"
            + (f" ({summary.get('soc_version')})" if summary.get("soc_version") else ""),
            ["graph", "role", "precision"],
            rows,
        )
    )
    ui.info(f"wrote {output}")


def _summary(pkg) -> None:
    rows = [
        [n, g["role"], g["precision"], len(g["inputs"]), len(g["outputs"])]
        for n, g in pkg.manifest["graphs"].items()
    ]
    ui.show(
        ui.table(
            f"package {pkg.manifest['model']['source']} ({pkg.family})",
            ["graph", "role", "precision", "inputs", "outputs"],
            rows,
        )
    )
    if pkg.report.get("passes"):
        prow = [[p["index"], p["pass"], p["modified"], f"{p['seconds']:.2f}s"] for p in pkg.report["passes"]]
        ui.show(ui.table("passes", ["#", "pass", "modified", "time"], prow))
