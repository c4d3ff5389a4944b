"""The vlmc command line: a thin click layer over the library.

User errors print one line on stderr and exit 2 (a failed check exits 1); ``-v`` shows tracebacks.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from vlmc import __version__, ui
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


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
        except KeyboardInterrupt:
            click.echo("vlmc: interrupted; nothing was written", err=True)
            ctx.exit(130)
        except OSError as exc:
            if ui.is_verbose():
                logger.exception("error")
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            click.echo(f"vlmc: error: {exc.strerror or exc}{where}", err=True)
            ctx.exit(2)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as exc:  # a vlmc bug: still one line unless -v
            if ui.is_verbose():
                raise
            first = (str(exc).strip().splitlines() or [""])[0]
            click.echo(f"vlmc: internal error: {type(exc).__name__}: {first} (run with -v for the traceback)", err=True)
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


def _export_options(f):
    f = click.option("--trust-remote-code", is_flag=True, help="Allow the model's own Python code (off by default).")(f)
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
    from vlmc import package as P

    P.check_output_dir(output.resolve(), force)
    source = exporters.load_source(model, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    pkg = exporters.export(source)
    path = pkg.save(output, force=force)
    ui.info(f"wrote {path}")
    _summary(pkg)


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("-r", "--recipe", "recipe_path", required=True, type=click.Path(path_type=Path), help="Recipe YAML.")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Package directory to write.")
@click.option("--check", is_flag=True, help="Check numerics-preserving passes on onnxruntime.")
@click.option("--force", is_flag=True, help="Replace an existing vlmc package at the output.")
def optimize(package, recipe_path, output, check, force):
    """Run a recipe's passes over a package and write a new package.

    Example:

        vlmc optimize out/tiny-llava --recipe recipes/demo.yaml -o out/tiny-llava-opt --check
    """
    from vlmc import manager, recipe
    from vlmc import package as P

    r = recipe.load(recipe_path)
    P.check_output_dir(output.resolve(), force)
    pkg = P.Package.load(package)
    pkg = manager.run(pkg, r.steps, check=check)
    path = pkg.save(output, force=force)
    ui.info(f"wrote {path}")
    _summary(pkg)


@main.command()
@click.option("-r", "--recipe", "recipe_path", required=True, type=click.Path(path_type=Path), help="Recipe YAML.")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Build directory to write.")
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
    result = B.build(r, output, check=check, force=force, trust_remote_code=trust_remote_code,
                     allow_pickle=allow_pickle)
    _summary(result.package)
    ui.info(f"wrote {output}")


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--image", "images", multiple=True, help="Image file (repeatable), or 'demo' for a built-in picture.")
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text (repeatable: a batch).")
@click.option("--max-new-tokens", default=20, show_default=True, type=click.IntRange(1, 4096))
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
    """Give each prompt as many images as it has placeholders (one each if it has none)."""
    out, k = [], 0
    for p in prompts:
        n = p.count(marker) or (1 if images else 0)
        out.append(images[k:k + n])
        k += n
    if k != len(images):
        raise VlmcError(f"{len(images)} image(s) given but the prompts take {k}")
    return out


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--max-new-tokens", default=20, show_default=True, type=click.IntRange(1, 4096))
@click.option("--image", "images", multiple=True, help="Image file(s); default: built-in demo pictures.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt(s); default: 'Describe the image.'")
@click.option("--max-logit-diff", type=float, help="Fail above this prefill logits max |diff| (default 1e-4 for exact packages).")
@click.option("--min-token-agreement", type=float, help="Fail below this fraction of equal tokens (default 1.0 for exact packages).")
@_export_options
def verify(package, max_new_tokens, images, prompts, max_logit_diff, min_token_agreement, trust_remote_code, allow_pickle):
    """Compare the package with transformers on the same inputs; exit 1 past the thresholds.

    Example:

        vlmc verify out/demo/package --max-new-tokens 20
    """
    from vlmc import verify as V
    from vlmc.package import Package

    pkg = Package.load(package)
    prompts = list(prompts) or None
    per = _distribute(prompts, list(images), pkg.manifest["text"].get("image_marker", "<image>")) if images and prompts else (
        [[i] for i in images] if images else None)
    if per is not None and prompts is None:
        prompts = V.DEFAULT_PROMPTS * len(per)
    res = V.verify(pkg, max_new_tokens, prompts, per, max_logit_diff, min_token_agreement, trust_remote_code, allow_pickle)
    V.write(pkg, res)
    rows = [["prefill logits max |diff|", f"{res.prefill_logits_max_abs_diff:.3g}"],
            ["prefill logits cosine", f"{res.prefill_logits_cosine:.6f}"],
            ["top-1 agreement", f"{res.top1_agreement:.3f}"],
            ["token agreement", f"{res.token_agreement:.3f} over {max_new_tokens} new tokens"],
            ["common prefix", str(res.common_prefix)],
            ["result", "PASS" if res.passed else "FAIL"]]
    ui.show(ui.table(f"verify {res.source} ({'exact' if res.exact_package else 'lossy'} package)", ["metric", "value"], rows))
    if not res.passed:
        from vlmc.errors import CheckFailed

        raise CheckFailed(f"verify failed: logits max |diff| {res.prefill_logits_max_abs_diff:.3g}, "
                          f"token agreement {res.token_agreement:.3f} (thresholds {res.thresholds})")


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
def inspect(package, as_json):
    """Show a package: graphs with IO, ops, weights, precision, KV layout and pass history.

    Example:

        vlmc inspect out/demo/package
    """
    from vlmc import report
    from vlmc.package import Package

    pkg = Package.load(package)
    if as_json:
        click.echo(json.dumps(report.summary(pkg), indent=2, sort_keys=True, default=str))
        return
    ui.stdout.print(report.render_markdown(pkg), markup=False, highlight=False)


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


def _summary(pkg) -> None:
    rows = [[n, g["role"], g["precision"], len(g["inputs"]), len(g["outputs"])] for n, g in pkg.manifest["graphs"].items()]
    ui.show(ui.table(f"package {pkg.manifest['model']['source']} ({pkg.family})", ["graph", "role", "precision", "inputs", "outputs"], rows))
    if pkg.report.get("passes"):
        prow = [[p["index"], p["pass"], p["modified"], f"{p['seconds']:.2f}s"] for p in pkg.report["passes"]]
        ui.show(ui.table("passes", ["#", "pass", "modified", "time"], prow))


def run_main() -> None:  # pragma: no cover - console entry used by python -m
    sys.exit(main())
