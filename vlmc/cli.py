"""The vlmc command line: a thin click layer over the library.

User errors print one line on stderr and exit 2 (a failed check exits 1); ``-v`` shows tracebacks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import signal
import threading
from pathlib import Path

import click

from vlmc import __version__, errors, interrupts, limits, ui
from vlmc.errors import VlmcError

logger = logging.getLogger(__name__)


_Terminated = interrupts.Terminated


def _raise_on_sigterm(ctx: click.Context) -> None:
    """SIGTERM and SIGINT raise (Terminated, KeyboardInterrupt) and are recorded for interrupts.check."""
    # The default SIGTERM action kills the process without unwinding, leaving .tmp-* directories behind.
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        interrupts.record(signum)  # raised again at the next block of work if this one is swallowed
        raise _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    interrupts.clear()
    # SIGINT only where Python's own handler is in place: a process started with it ignored (nohup, a
    # background job) keeps ignoring it.
    sigs = [signal.SIGTERM] + [signal.SIGINT] * (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    previous = {sig: signal.signal(sig, handler) for sig in sigs}

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)
        interrupts.clear()

    ctx.call_on_close(restore)


class _FiniteFloat(click.ParamType):
    """A float option that refuses nan and inf (they would make every threshold comparison pass or fail)."""

    name = "float"

    def convert(self, value, param, ctx):
        import math

        try:
            f = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(f) or f < 0:
            self.fail(f"{value!r} must be a finite number of at least 0", param, ctx)
        return f


def _interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt an exception was raised from, if any: a Ctrl-C inside a C extension's import
    comes out as ``ImportError: initialization failed`` (pybind11), raised while handling it."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


class _Group(click.Group):
    """Turns VlmcError (and interrupts) into one-line messages with the right exit code."""

    def __call__(self, *args, **kwargs):
        # Called as the program (the console script, `python -m vlmc`), not through click's CliRunner,
        # which calls .main(): only then may an interrupt end the process itself (_interrupted).
        self._whole_process = True
        return super().__call__(*args, **kwargs)

    def _interrupted(self, ctx, exc: KeyboardInterrupt):
        click.echo("vlmc: interrupted; nothing was written", err=True)
        code = 143 if isinstance(exc, _Terminated) else 130
        if getattr(self, "_whole_process", False):
            # Every write has unwound and removed its temporary files by now. The exit handlers run
            # (logging, multiprocessing, finalizers), then the process ends without the interpreter's
            # module teardown: freeing sympy's caches (onnx_ir imports it) alone takes 1-2 s on a busy
            # 2-core machine, and an interrupted run must answer within a second.
            import atexit
            import os
            import sys

            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)
        ctx.exit(code)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except VlmcError as exc:
            if ui.is_verbose():
                logger.exception("error")
            click.echo(f"vlmc: error: {errors.one_line(exc)}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            self._interrupted(ctx, exc)
        except OSError as exc:
            if (interrupt := _interrupt_behind(exc)) is not None:
                self._interrupted(ctx, interrupt)
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
        except click.UsageError as exc:  # a bad option value: one line too, naming the command's help
            sub = exc.ctx.command_path if exc.ctx is not None else "vlmc"
            message = " ".join(exc.format_message().split())
            click.echo(f"vlmc: error: {message} (see `{sub} --help`)", err=True)
            ctx.exit(2)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as exc:  # a vlmc bug: still one line unless -v
            if (interrupt := _interrupt_behind(exc)) is not None:
                self._interrupted(ctx, interrupt)
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
        # Two tables, so an architecture name keeps the full width (a 3-column table cut the longest ones).
        builtins = [[name, fam] for name, (fam, _) in sorted(zoo.BUILTINS.items())]
        ui.show(ui.table("built-ins", ["built-in", "family"], builtins))
        rows = [[name, ", ".join(mod.ARCHITECTURES)] for name, mod in fams.items()]
        ui.show(ui.table("families", ["family", "architectures"], rows))
        return
    if not model or not output:
        raise click.UsageError("export needs MODEL and -o/--output (or --list)")
    from vlmc import outdir

    outdir.check(output, force, inputs=[Path(model)] if Path(model).is_dir() else [])
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
    from vlmc.package import Package

    r = recipe.load(recipe_path)
    outdir.check(output, force, source=package)
    pkg = Package.load(package)
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
    from vlmc import build, recipe

    r = recipe.load(recipe_path)
    result = build.build(
        r, output, check=check, force=force, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle
    )
    _summary(result.package)
    ui.info(f"wrote {output}")


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option(
    "--image", "images", multiple=True, help="Image file (repeatable), or 'demo' for a built-in picture."
)
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable: a batch).")
@click.option(
    "--max-new-tokens",
    default=20,
    show_default=True,
    type=click.IntRange(1, 4096),
    help="Tokens to generate per prompt (fewer if every prompt reaches end-of-sequence).",
)
@click.option("--json", "as_json", is_flag=True, help="Print tokens and text as JSON.")
@click.option(
    "--executor",
    type=click.Choice(["acl", "reference"]),
    default=None,
    help="For a compile output: acl (the .om files on an NPU; the default where pyACL imports) or "
    "reference (the lowered graphs on CPU, strict gear shapes and dtypes).",
)
@click.option(
    "--device-id",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="NPU to run on (acl; a tensor-parallel build takes each rank's from its rank_table.json).",
)
@click.option(
    "--against",
    type=click.Path(path_type=Path),
    default=None,
    help="For a compile output: also run this package on onnxruntime and report how far the build's tokens "
    "and logits are from it.",
)
@click.option(
    "--chat",
    is_flag=True,
    help="A conversation on standard input: one user turn per line, `/image PATH` attaches an image to the "
    "next turn, `/quit` ends. On a paged package the history's KV and images are reused between turns.",
)
def run(package, images, prompts, max_new_tokens, as_json, executor, device_id, against, chat):
    """Generate text for prompts (and images) with a package on onnxruntime CPU, or with a compile output.

    PACKAGE is a package directory, or a directory `vlmc compile --target ascend` wrote: its builds run
    through --executor, in the same generation loop. With several prompts, images are shared out in
    order, one per placeholder. A tensor-parallel package (the tensor_parallel pass), or a compile output
    of one, runs as one process per rank joined by torch.distributed: gloo on CPU (onnxruntime or
    --executor reference; needs torch, the export extra), torch_npu's hccl with --executor acl (each rank
    on the card its rank_table.json names).

    Example:

        vlmc run out/demo/package --image demo --prompt "Describe the image."

        vlmc run out/demo-910b --executor reference --image demo --prompt "Describe the image."

        vlmc run out/demo-910b --against out/demo/package --prompt "Describe the image."

        vlmc run out/tiny-llava-paged --chat --image demo
    """
    from vlmc import runtime

    what = runtime.target(package, executor, device_id)
    if what.build and executor is None and what.executor == "reference":
        ui.info("pyACL does not import here: running the reference executor (the lowered graphs on CPU)")
    if against is not None and not (what.build or what.ort_build):
        raise VlmcError(f"--against applies to a compile output; {package} is a package (run it without it)")
    if chat:
        if what.ranks is not None:
            raise VlmcError("--chat runs one process: a tensor-parallel package or build cannot chat yet")
        if against is not None or len(prompts) > 1:
            raise VlmcError("--chat takes at most one --prompt (the first turn) and no --against")
        pipe = what.start()
        try:
            _chat(pipe, list(prompts), list(images), max_new_tokens)
        finally:
            pipe.close()
        return
    if not prompts:
        raise click.UsageError("run needs --prompt (or --chat)")
    per_prompt = _distribute(
        list(prompts), list(images), what.manifest["text"].get("image_marker", "<image>")
    )
    # A build with resolution gears (its runtime manifest's vision.preprocess.gears) fits each image to
    # one; say how, once (the pipeline fits them the same way).
    fitted, notes = _fitted_images(what.manifest, per_prompt)
    for note in notes:
        ui.info(note)
    # One process, or one per rank joined by torch.distributed: gloo on CPU, torch_npu's hccl for acl
    # (vlmc/runtime/collective.py; docs/tensor_parallel.md).
    runnable = what.start(on_start=ui.info)
    try:
        result = runnable.generate(list(prompts), per_prompt, max_new_tokens)
    finally:
        runnable.close()
    report = None
    if against is not None:
        # The package runs on the pixels the build ran on (fitted to its resolution gears), so both see one image.
        # A tensor-parallel package runs its ranks on onnxruntime, as `vlmc run PACKAGE` does.
        reference = runtime.open(against)
        try:
            ref = reference.generate(list(prompts), fitted, max_new_tokens)
        finally:
            reference.close()
        report = runtime.executors.agreement(ref, result)
    if as_json:
        out = {"tokens": result.tokens, "texts": result.texts}
        if report is not None:
            out["agreement"] = report
        click.echo(json.dumps(out))
        return
    for p, text, toks in zip(prompts, result.texts, result.tokens):
        ui.stdout.print(f"[bold]{p}[/bold] -> {text!r}  ({len(toks)} tokens: {toks})")
    if report is not None:
        where = "none" if report["first_divergence"] is None else f"token {report['first_divergence']}"
        ui.stdout.print(
            f"against {against}: {report['tokens_agree']}/{report['tokens']} tokens agree (first divergence: "
            f"{where}); max |logit diff| {report['max_logit_diff']:.3g} (prefill {report['prefill_logit_diff']:.3g})"
        )


def _fitted_images(manifest: dict, per_prompt: list[list]) -> tuple[list[list], list[str]]:
    """Every prompt's images as a compile output's resolution gears take them (one request: one gear), and
    what was changed; a manifest without gears gives the images back as they are."""
    from vlmc.runtime import preprocess

    flat = [img for per in per_prompt for img in per]
    if not flat:
        return per_prompt, []
    fitted, notes = preprocess.fit_to_gears(flat, (manifest.get("vision") or {}).get("preprocess") or {})
    out, k = [], 0
    for per in per_prompt:
        out.append(fitted[k : k + len(per)])
        k += len(per)
    return out, notes


@main.command()
@click.argument("package", type=click.Path(path_type=Path))
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (anything but "
    "loopback exposes the model to the network; there is no authentication).",
)
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port (0: any free one)."
)
@click.option(
    "--max-batch",
    default=8,
    show_default=True,
    type=click.IntRange(1, limits.MAX_BATCH),
    help="Sequences decoded together at most (a build's largest batch gear at most).",
)
@click.option(
    "--num-blocks",
    default=None,
    type=click.IntRange(2, 1 << 24),
    help="KV pool blocks for a package whose pool size is symbolic (default 1024).",
)
@click.option(
    "--max-queue",
    default=64,
    show_default=True,
    type=click.IntRange(1, 1 << 16),
    help="Requests waiting at most; more get HTTP 429.",
)
@click.option(
    "--max-tokens",
    default=4096,
    show_default=True,
    type=click.IntRange(1, 1 << 20),
    help="Largest max_tokens a request may ask for.",
)
@click.option(
    "--image-root",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    default=None,
    help="Directory whose files requests may name as image_url (default: data: URLs only).",
)
@click.option(
    "--no-prefix-cache", is_flag=True, help="Do not share prompt-prefix KV blocks between requests."
)
@click.option(
    "--prefill-chunk",
    default=None,
    type=click.IntRange(0, 1 << 20),
    help="Prompt tokens a step prefills at most while other requests decode, in whole KV blocks "
    "(default 256; 0: each prompt whole in one step).",
)
@click.option(
    "--executor",
    type=click.Choice(["acl", "reference"]),
    default=None,
    help="For a compile output: acl or reference (as for `vlmc run`).",
)
@click.option(
    "--device-id", default=0, show_default=True, type=click.IntRange(0), help="NPU to run on (acl)."
)
def serve(
    package,
    host,
    port,
    max_batch,
    num_blocks,
    max_queue,
    max_tokens,
    image_root,
    no_prefix_cache,
    prefill_chunk,
    executor,
    device_id,
):
    """Serve a paged package or compile output over an OpenAI-compatible API (/v1/chat/completions).

    Requests are batched continuously over the paged KV pool; prompt prefixes and image features are
    reused across requests (docs/serving.md). Needs the `serve` extra (FastAPI, uvicorn).

    Example:

        vlmc serve out/tiny-llava-paged --port 8000
    """
    from vlmc import serve as serving

    pipe, name = _open_for_serving(Path(package), executor, device_id)
    if hasattr(pipe.executor, "largest"):  # a compile output: its batch gears bound the batch
        most = pipe.executor.largest(pipe.m["pipeline"]["decoder"][0], "batch")
        if most is not None and most < max_batch:
            ui.info(f"the build's largest batch gear is {most}: decoding at most {most} sequences together")
            max_batch = most
    try:
        serving.serve(
            pipe,
            host,
            port,
            name,
            serving.Limits(max_queue=max_queue, max_tokens=max_tokens),
            image_root,
            max_batch=max_batch,
            num_blocks=num_blocks,
            prefix_cache=not no_prefix_cache,
            **({} if prefill_chunk is None else {"prefill_chunk": prefill_chunk or None}),
        )
    finally:
        pipe.close()


def _open_for_serving(path: Path, executor: str | None, device_id: int):
    """A Pipeline over a package or a compile output, and the model name the API reports."""
    import importlib.util

    from vlmc import runtime

    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise VlmcError("vlmc serve needs FastAPI and uvicorn: pip install 'vlmc[serve]'")
    what = runtime.target(path, executor, device_id)
    if what.ranks is not None:
        raise VlmcError("vlmc serve runs one process: a tensor-parallel package runs with `vlmc run` for now")
    pipe = what.start()
    manifest = what.manifest
    return pipe, str(manifest["model"].get("source") or manifest["model"]["family"])


def _chat(pipe, prompts: list[str], images: list[str], max_new_tokens: int) -> None:
    """The `run --chat` loop: turns from standard input (or --prompt for the first), answers on stdout."""
    from vlmc.runtime.conversation import Conversation

    conv = Conversation(pipe, max_new_tokens)
    if conv.scheduler is None:
        ui.info(
            "a contiguous package: each turn recomputes the whole conversation (paged_kv lets turns reuse it)"
        )
    stdin = click.get_text_stream("stdin")
    pending = list(images)
    lines = iter(prompts) if prompts else iter(())
    while True:
        line = next(lines, None)
        if line is None:
            line = stdin.readline()
            if not line:
                break
        line = line.strip()
        if not line:
            continue
        if line == "/quit":
            break
        if line.startswith("/image "):
            pending.append(line[len("/image ") :].strip())
            continue
        turn = conv.ask(line, pending)
        pending = []
        ui.stdout.print(turn.text, markup=False, highlight=False)
        if turn.prompt_tokens:
            ui.info(
                f"{len(turn.tokens)} tokens; {turn.cached_tokens} of {turn.prompt_tokens} prompt tokens reused; "
                f"first token after {turn.time_to_first_token:.3f} s"
            )
    conv.close()


def _distribute(prompts: list[str], images: list[str], marker: str) -> list[list[str]]:
    """Give each prompt as many images as it has placeholders (one each if it has none; a single plain
    prompt takes them all, the chat template places them)."""
    from vlmc.runtime import markers

    out, k = [], 0
    for p in prompts:
        n = markers.count(p, marker) or (len(images) if len(prompts) == 1 else 1 if images else 0)
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
    type=_FiniteFloat(),
    help="Fail above this prefill logits max |diff| (default 1e-4 for exact packages).",
)
@click.option(
    "--min-token-agreement",
    type=_FiniteFloat(),
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
    from vlmc import verify
    from vlmc.package import Package

    pkg = Package.load(package)
    prompts = list(prompts) or None
    per = (
        _distribute(prompts, list(images), pkg.manifest["text"].get("image_marker", "<image>"))
        if images and prompts
        else ([[i] for i in images] if images else None)
    )
    if per is not None and prompts is None:
        prompts = verify.DEFAULT_PROMPTS * len(per)
    res = verify.verify(
        pkg,
        max_new_tokens,
        prompts,
        per,
        max_logit_diff,
        min_token_agreement,
        trust_remote_code,
        allow_pickle,
    )
    verify.write(pkg, res)
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
        from vlmc import outdir
        from vlmc.passes.prune_visual_tokens import measure

        out = output or Path("pruning.png")
        if (
            out.resolve().parent == Path(package).resolve()
            or Path(package).resolve() in out.resolve().parents
        ):
            raise VlmcError(f"output {out} is inside the input package {package}; choose a path outside it")
        if not out.parent.is_dir():
            raise VlmcError(f"output {out}: directory {out.parent} does not exist")
        outdir.write_file(
            out.parent, out.name, measure.picture(pkg, pruning_image)
        )  # atomic, never via a link
        p = measure.facts(pkg)
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
@click.option(
    "--recipe",
    "recipe_path",
    type=click.Path(path_type=Path),
    help="With --config: the precisions, pruned image tokens and paged block size this recipe gives the model.",
)
@click.option("--device-memory", required=True, help="Memory per card, e.g. 16GiB or 16GB.")
@click.option(
    "--images",
    default=1,
    show_default=True,
    type=click.IntRange(0, limits.MAX_BATCH),
    help="Images per sequence.",
)
@click.option(
    "--text-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(0, limits.MAX_POSITIONS),
    help="Text tokens per sequence (prompt plus generated).",
)
@click.option(
    "--batch",
    default=1,
    show_default=True,
    type=click.IntRange(1, limits.MAX_BATCH),
    help="Concurrent sequences.",
)
@click.option(
    "--cards",
    default=1,
    show_default=True,
    type=click.IntRange(1, 4096),
    help="Cards sharing the model (tensor parallel).",
)
@click.option(
    "--tp",
    type=click.Choice(["2", "4", "8"]),
    help="Also show one card's memory under the tensor_parallel pass's split over this many cards.",
)
@click.option(
    "--block-size", type=click.IntRange(1, 65536), help="Paged block size (default: the package's, else 128)."
)
@click.option(
    "--max-context",
    type=click.IntRange(1, limits.MAX_POSITIONS),
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
@click.option(
    "--image-size",
    help="HEIGHTxWIDTH of each image, for models whose image tokens depend on it (LLaVA-NeXT anyres, InternVL tiles).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(
    package,
    config_path,
    recipe_path,
    device_memory,
    images,
    text_tokens,
    batch,
    cards,
    tp,
    block_size,
    max_context,
    reserve,
    precisions,
    image_size,
    as_json,
):
    """Plan device memory: weights, KV per token/block, image tokens, headroom -> sequences and context that fit.

    Compares the paged KV reservation with a contiguous cache's worst case for the request mix.

    Example:

        vlmc plan out/demo/package --device-memory 16GiB --images 4 --text-tokens 2048 --batch 2

    With --tp N, also one card's memory when the tensor_parallel pass splits the decoder over N cards.
    """
    from vlmc import budget
    from vlmc import recipe as recipe_mod
    from vlmc.package import Package

    if (package is None) == (config_path is None):
        raise click.UsageError("plan needs a PACKAGE or --config (one of them)")
    prec = {}
    for item in precisions:
        role, _, value = item.partition("=")
        if not value or value not in budget.WEIGHT_BYTES:
            raise VlmcError(
                f"--precision {item!r}: write ROLE=PRECISION with PRECISION one of {', '.join(budget.WEIGHT_BYTES)}"
            )
        prec[role] = value
    size = budget.parse_image_size(image_size)
    if recipe_path is not None and config_path is None:
        raise click.UsageError("--recipe needs --config (a package already carries what its recipe did)")
    steps = budget.recipe_plan(recipe_mod.load(recipe_path)) if recipe_path is not None else None
    if config_path is not None:
        spec = budget.load_spec(config_path, {**(steps.precision if steps else {}), **prec} or None, size)
        spec = budget.with_recipe(spec, steps) if steps else spec
    else:
        if prec:
            raise click.UsageError(
                "--precision only applies with --config (a package states its own precisions)"
            )
        spec = budget.spec_from_package(Package.load(package), size)
    if tp and cards not in (1, int(tp)):
        raise click.UsageError(
            f"--tp {tp} splits the model over {tp} cards; leave out --cards or give --cards {tp}"
        )
    cards = int(tp) if tp else cards
    result = budget.fit(
        spec,
        device_memory,
        images=images,
        text_tokens=text_tokens,
        batch=batch,
        cards=cards,
        block_size=block_size,
        max_context=max_context,
        reserve=reserve,
        tp=int(tp) if tp else None,
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


@main.command()
@click.argument("which", type=click.Choice(["recipe", "manifest", "compile"]))
def schema(which):
    """Print a JSON Schema: of recipes, of the package manifest (vlmc.json), or of compile.json.

    Example:

        vlmc schema manifest > docs/manifest.schema.json

        vlmc schema compile > docs/compile.schema.json
    """
    if which == "recipe":
        from vlmc import recipe

        click.echo(json.dumps(recipe.json_schema(), indent=2, sort_keys=True))
    else:
        from vlmc import compile_schema, manifest_schema

        module = manifest_schema if which == "manifest" else compile_schema
        click.echo(json.dumps(module.json_schema(), indent=2, sort_keys=True, ensure_ascii=False))


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

    from vlmc import backends, recipe
    from vlmc.package import Package

    target = dict(recipe.load(recipe_path).target or {}) if recipe_path else {}
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
    from vlmc import outdir

    outdir.check(output, force, source=package)
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
