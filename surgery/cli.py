"""The `surgery` command line. The only module that prints or exits.

Each command checks its flags, calls ONE library function and renders the result. Every library
failure is a SurgeryError; `_run` maps it to an exit code in one place:
0 clean, 1 findings, 2 usage error (Click's), 3 could not run.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from surgery import __version__
from surgery.errors import EXIT_CANNOT_RUN, OutputExistsError, SurgeryError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM

EPILOG = """\b
Exit codes:
  0  clean / done
  1  findings (verify found problems)
  2  usage error
  3  could not run (unreadable or unsafe checkpoint, invalid manifest, output exists,
     or an internal error: SURGERY_DEBUG=1 shows its traceback)
  130 interrupted (Ctrl-C), 143 terminated (SIGTERM): no partial output, temps removed
"""


def error_json(code: str, message: str, hint: str | None, exit_code: int) -> dict[str, Any]:
    """The --json shape of a failure (schemas/error-output.schema.json): a CI job that parses
    stdout gets the reason, not an empty string."""
    return {"error": {"code": code, "message": message, "hint": hint, "exit_code": exit_code}}


def _fail(err: SurgeryError, *, as_json: bool = False) -> None:
    click.secho(f"error: {err.message}", fg="red", err=True)
    if err.hint:
        click.echo(f"  fix: {err.hint}", err=True)
    if as_json:
        code = getattr(err, "code", None) or type(err).__name__
        emit_json(error_json(str(code), err.message, err.hint, err.exit_code))
    sys.exit(err.exit_code)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every ``finally`` runs and temp files are removed."""


def _on_sigterm(signum: int, frame: Any) -> None:
    # One-shot: a second SIGTERM must not interrupt the cleanup the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def _crash(err: BaseException, *, as_json: bool = False) -> None:
    """An exception no library code expected: exit 3 with one line, never exit 1 (findings).

    RecursionError and OverflowError from absurd inputs land here too until the reader that
    let them through is fixed. SURGERY_DEBUG=1 prints the full traceback for the report.
    """
    if os.environ.get("SURGERY_DEBUG", "") not in ("", "0"):
        import traceback

        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    text = " ".join(str(err).split())
    if len(text) > 200:
        text = text[:197] + "..."
    message = f"internal error, {type(err).__name__}" + (f": {text}" if text else "")
    hint = "a bug in surgery: please report it with the output of SURGERY_DEBUG=1 surgery ..."
    click.secho(f"error: {message} ({hint})", fg="red", err=True)
    if as_json:
        emit_json(error_json("internal", message, hint, EXIT_CANNOT_RUN))
    sys.exit(EXIT_CANNOT_RUN)


def handle_errors(fn: F) -> F:
    """Map every failure to its exit code with a one-line message (never a traceback).

    SurgeryError -> its exit code (3 unless it says otherwise); Ctrl-C -> 130; SIGTERM -> 143,
    after the same cleanup as Ctrl-C; anything unexpected -> 3. Click's own usage errors pass
    through to Click (exit 2). Under --json the error is also printed as JSON on stdout.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            previous = signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not the main thread: leave signals alone
            previous = None
        try:
            return fn(*args, **kwargs)
        except SurgeryError as e:
            _fail(e, as_json=as_json)
        except Terminated:
            click.echo("terminated (SIGTERM); temporary files removed", err=True)
            sys.exit(EXIT_TERMINATED)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except MemoryError:
            _fail(SurgeryError("out of memory"), as_json=as_json)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:  # the catch-all is the point: an accident must not read as 1
            _crash(e, as_json=as_json)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    return wrapper  # type: ignore[return-value]


class _Group(click.Group):
    """Click's group, except that with --json a usage error (exit 2) is JSON on stdout too."""

    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or "--json" not in argv:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            return super().main(argv, prog_name, complete_var, False, **extra)
        except click.ClickException as e:
            e.show()
            emit_json(error_json("UsageError" if isinstance(e, click.UsageError) else
                                 type(e).__name__, e.format_message(), None, e.exit_code))
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)


def _factory_spec(ctx: click.Context, param: click.Parameter, value: str | None
                  ) -> str | None:
    """PKG.MOD:FACTORY, checked before anything is imported: a malformed one is a usage error."""
    if value is None:
        return None
    mod, sep, attr = value.partition(":")
    if not sep or not mod or not attr:
        raise click.BadParameter(f"{value!r} is not PKG.MOD:FACTORY (e.g. "
                                 f"{mod or 'mypkg.models'}:{attr or 'build'})")
    return value


def _resolve(source: str, format: str | None, *, quiet: bool) -> Any:
    """The file a CHECKPOINT argument names (a folder resolves to the weights in it)."""
    from surgery.source import resolve_checkpoint

    resolved = resolve_checkpoint(source, format=format)
    if resolved.note and not quiet:
        click.secho(f"note: {resolved.note}", fg="yellow", err=True)
    return resolved


FORMAT_OPTION = click.option(
    "--format", "fmt", type=click.Choice(["safetensors", "torch", "index"]),
    help="Read the checkpoint as this format whatever its suffix: safetensors, torch "
    "(torch.save: .pt/.pth/.pth.tar/.ckpt/.bin) or index (a sharded *.index.json).")


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EPILOG)
@click.version_option(__version__, prog_name="surgery")
def cli() -> None:
    """Make PyTorch models compile-ready for deployment.

    \b
    Typical flow:
      surgery plan model.safetensors          # write model.surgery.toml (compile regions)
      surgery check model.surgery.toml        # validate a (hand-edited) manifest
      surgery verify model.ckpt               # prove the keys are prefix-free (CI gate)
      surgery export model.ckpt -o clean.safetensors --manifest model.surgery.toml
      surgery warm --model pkg.mod:build --manifest model.surgery.toml --input pkg.mod:example
    Then, in deployment: surgery.apply_manifest(model, "model.surgery.toml", warmup=...)
    """


# ---- plan / check (surgery plan) ---------------------------------------------------------------

def _fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _render_plan(summary: dict[str, Any], out: str) -> None:
    click.echo(f"planned {summary['source']} -> {out}")
    click.echo(f"regions ({summary['paths']} compiled callables): {summary['compile']}")
    for kind, n in summary["regions"].items():
        click.echo(f"  {kind:<20} {n:>5}")
    if not summary["regions"]:
        click.secho("  (none found: add regions with --include GLOB)", fg="yellow")
    total, covered = summary["parameters"], summary["covered_parameters"]
    click.echo(f"parameters in module regions: {summary['covered_share']:.1%} "
               f"({_fmt_count(covered)} of {_fmt_count(total)}; method regions not counted)")
    if summary["left_out"]:
        click.echo("left out:")
        for lo in summary["left_out"]:
            click.echo(f"  {lo['count']:>4} {lo['kind']}: {lo['reason']}")
    _render_notes(summary["notes"])


def _render_notes(notes: list[str]) -> None:
    for note in notes:
        click.secho(f"note: {note}", fg="yellow", err=True)


def _render_coverage(cov: dict[str, Any]) -> None:
    """Where the eager step's time goes: inside regions, and the largest parts left eager."""
    if "step_ms" not in cov:
        return
    click.echo(f"coverage: {cov['covered_share']:.1%} of the eager step inside regions "
               f"({cov['covered_ms']:.2f} of {cov['step_ms']:.2f} ms, {cov['clock']})")
    for r in cov.get("remainder", []):
        click.echo(f"  eager {r['share']:>6.1%} {r['ms']:>9.3f} ms  {r['path']}")


@contextlib.contextmanager
def _no_cycle_collection() -> Any:
    """Pause the cyclic garbage collector while a header's keys become objects.

    Reading a header of N tensors allocates a few objects per key and frees almost none, so
    the collector's generation-2 passes re-walk everything built so far, again and again: at
    100k tensors that was about 0.6 s of `plan`'s 4 s (benchmarks/RESULTS.md). The objects
    form no cycles worth collecting in a short command; reference counting still frees them.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@cli.command(epilog=EPILOG)
@click.argument("source", required=False, type=click.Path())
@click.option("--model", "model_spec", metavar="PKG.MOD:FACTORY", callback=_factory_spec,
              help="Plan a live model built by this factory instead of a checkpoint. A live "
              "model shows classes and method regions (attn_pre, ffn_residual).")
@click.option("-o", "--output", metavar="PATH",
              help="Where to write the manifest ('-' for stdout). Default: beside the input, "
              "as NAME.surgery.toml.")
@click.option("--force", is_flag=True, help="Replace an existing manifest at the output path. "
              "Without it an existing file is never overwritten, even one that appears while "
              "planning (exit 3).")
@click.option("--key", metavar="ENTRY", help="Container entry that holds the state dict "
              "(e.g. state_dict, ema; nested: outer/inner). Default: found automatically.")
@click.option("--prefix", metavar="PREFIX", help="Plan only keys under this attribute prefix, "
              "with it stripped (e.g. 'model.' for a LightningModule's inner model).")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Make matching module paths regions; they win over found ones. Repeatable. "
              "With --input, GLOB:method makes a method of the matching modules a region.")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Drop regions whose path matches. Repeatable.")
@click.option("--backend", metavar="NAME", help="Compile backend for every region "
              "(default: inductor; cudagraphs and aot_eager also work).")
@click.option("--mode", type=click.Choice(["default", "reduce-overhead", "max-autotune",
                                           "max-autotune-no-cudagraphs"]),
              help="Inductor mode (default: none; reduce-overhead means inductor's own "
              "cudagraph trees, i.e. --capture compiler).")
@click.option("--fold", is_flag=True, help="Compile a fixed-shape container whose blocks are "
              "all regions (e.g. aggregator.patch_embed) as ONE region: fewer CUDA-graph "
              "replays per step, faster on launch-bound models (benchmarks/RESULTS.md).")
@click.option("--capture", type=click.Choice(["compiler", "region"]),
              help="Who captures CUDA graphs. 'region' (default): surgery captures one graph per "
              "region path and replays it without entering dynamo, which cuts the host time of "
              "each call several-fold (benchmarks/RESULTS.md; the contract is in "
              "surgery/graphs.py). 'compiler': inductor's cudagraph trees (mode reduce-overhead).")
@click.option("--input", "input_spec", metavar="PKG.MOD:STEP", callback=_factory_spec,
              help="With --model: plan from evidence. STEP(model) runs one step (e.g. "
              "surgery.examples:stream_step streams one frame); plan runs it --steps times "
              "eagerly, records every module call's signature and time, and makes regions of "
              "the subtrees that keep one shape. The manifest gets [coverage].")
@click.option("--steps", type=click.IntRange(1, 1000), default=4, show_default=True,
              help="With --input: how many steps to watch (enough for a cache to show growth).")
@click.option("--device", default="cpu", show_default=True, metavar="DEVICE",
              help="With --input: where the model runs (cuda times calls with CUDA events).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32",
              show_default=True, help="With --input: run the steps under this autocast dtype "
              "(weights stay as built), as streaming models deploy.")
@FORMAT_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary "
              "(schemas/plan-output.schema.json).")
@handle_errors
def plan(source: str | None, model_spec: str | None, output: str | None, force: bool,
         key: str | None, prefix: str | None, include: tuple[str, ...],
         exclude: tuple[str, ...], backend: str | None, mode: str | None, fold: bool,
         capture: str | None, fmt: str | None, input_spec: str | None, steps: int,
         device: str, dtype: str, as_json: bool) -> None:
    """Write a manifest of compile regions for a checkpoint or a live model.

    \b
    SOURCE is a .safetensors, .pt/.pth/.pth.tar/.ckpt/.bin or sharded *.index.json checkpoint,
    or a save_pretrained folder holding one (model.safetensors, pytorch_model.bin, ...).
    Safetensors files are planned from their header alone (no tensor data is read).
    Wrapper-prefixed keys (_orig_mod., module., ...) are planned as the clean model.

    \b
    Examples:
      surgery plan model.safetensors
      surgery plan last.ckpt --prefix model. -o model.surgery.toml
      surgery plan --model surgery.examples:tiny -o tiny.surgery.toml
      surgery plan model.safetensors --exclude 'aggregator.frame_blocks.*' --json
      surgery plan --model surgery.examples:lingbot --fold   # fewer, larger regions
    """
    from surgery import plan as planner
    from surgery.manifest import dumps_manifest, write_text_atomic

    if (source is None) == (model_spec is None):
        raise click.UsageError("give either a checkpoint SOURCE or --model PKG.MOD:FACTORY")
    if model_spec is not None and (key or prefix or fmt):
        raise click.UsageError("--key, --prefix and --format apply to checkpoints, not to --model")
    if output == "-" and as_json:
        raise click.BadParameter("-o - writes the manifest to stdout, where --json would go too; "
                                 "write the manifest to a file", param_hint="-o")
    if input_spec is not None and model_spec is None:
        raise click.UsageError("--input drives a live model: give --model PKG.MOD:FACTORY too")
    if input_spec is not None and fold:
        raise click.UsageError("--fold does nothing with --input: evidence regions are already "
                               "the largest subtrees that keep one shape; drop --fold")
    kind = None
    if source is not None:
        resolved = _resolve(source, fmt, quiet=as_json)
        source, kind = resolved.path, resolved.kind
    out = output or planner.default_output(source or model_spec or "")
    if out != "-":
        if source is not None and os.path.abspath(out) == os.path.abspath(source):
            raise click.BadParameter("the manifest would overwrite its own checkpoint",
                                     param_hint="-o")
        if os.path.exists(out) and not force:
            raise OutputExistsError(out)
    comp = planner.compile_defaults(backend=backend, mode=mode, capture=capture)
    if source is not None:
        with _no_cycle_collection():
            result = planner.plan_checkpoint(source, key=key, prefix=prefix, include=include,
                                             exclude=exclude, compile=comp, fold=fold,
                                             kind=kind)
    else:
        assert model_spec is not None
        if input_spec is not None:
            from surgery.plan_observed import plan_observed

            result = plan_observed(model_spec, input_spec=input_spec, steps=steps,
                                   device=device, dtype=dtype, include=include,
                                   exclude=exclude, compile=comp)
        else:
            result = planner.plan_model(model_spec, include=include, exclude=exclude,
                                        compile=comp, fold=fold)
    text = dumps_manifest(result.manifest)
    if out == "-":
        click.echo(text, nl=False)
    else:
        write_text_atomic(out, text, force=force)
    summary = result.summary()
    coverage = result.manifest.coverage
    if as_json:
        emit_json({"output": out, **summary, **({"coverage": coverage} if coverage else {})})
    elif out != "-":
        _render_plan(summary, out)
        if coverage:
            _render_coverage(coverage)
    else:  # the manifest went to stdout; what the planner noticed still reaches the user
        _render_notes(summary["notes"])


def _each(files: tuple[str, ...], one: Callable[[str], int], *, as_json: bool) -> None:
    """Run `one` on each file (a pre-commit hook passes several) and exit with the worst code.

    One file fails as a single command does; with several, a file that cannot be read is
    reported and the rest are still checked, so one commit shows every problem.
    """
    if len(files) > 1 and as_json:
        raise click.UsageError("--json takes one file; run once per file")
    if len(files) == 1:
        sys.exit(one(files[0]))
    worst = 0
    for path in files:
        try:
            code = one(path)
        except SurgeryError as e:
            click.secho(f"error: {e.message}", fg="red", err=True)
            if e.hint:
                click.echo(f"  fix: {e.hint}", err=True)
            code = e.exit_code
        worst = max(worst, code)
    sys.exit(worst)


@cli.command(epilog=EPILOG)
@click.argument("manifests", nargs=-1, required=True, type=click.Path(dir_okay=False),
                metavar="MANIFEST...")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable result.")
@handle_errors
def check(manifests: tuple[str, ...], as_json: bool) -> None:
    """Validate manifest files against the schema.

    MANIFEST is a .surgery.toml, or an export (.safetensors, *.index.json) that embeds one.
    Errors name the TOML location of the problem (e.g. region[2].paths[0]) and its line.
    Exit 0 when all are valid, 3 when one is not.
    """
    from surgery.source import load_manifest_file

    def one(manifest: str) -> int:
        m = load_manifest_file(manifest)
        paths = sum(len(r.paths) for r in m.regions)
        if as_json:
            emit_json({"manifest": manifest, "valid": True, "regions": len(m.regions),
                       "paths": paths, "fingerprint": m.fingerprint})
        else:
            click.echo(f"{manifest}: valid ({len(m.regions)} regions, {paths} compiled "
                       f"callables, fingerprint {m.fingerprint[:19]}...)")
        return 0

    _each(manifests, one, as_json=as_json)


# ---- verify / export ---------------------------------------------------------------------------


class _Progress:
    """Turns the library's ``progress(done, total)`` callback into a click progress bar on
    stderr (stdout stays clean for --json). Shown only on a terminal."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bar: Any = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = click.progressbar(length=max(total, 1), label=self.label, file=sys.stderr,
                                         show_pos=False, show_percent=True, show_eta=True)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _render_findings(report: Any, *, all_keys: bool) -> None:
    where = f", entry {report.entry!r}" if report.entry else ""
    pre = f", prefix {report.prefix!r}" if report.prefix else ""
    click.echo(f"{report.path}: {report.tensors} tensors ({report.format}{where}{pre})")
    if report.fingerprint:
        click.echo(f"  fingerprint {report.fingerprint}")
    for f in report.findings:
        color = "red" if f.severity == "error" else "yellow"
        n = f"{f.count} key{'s' if f.count != 1 else ''}" if f.keys else ""
        click.secho(f"{f.code} {f.severity}: {f.title}" + (f" ({n})" if n else ""), fg=color)
        if f.wrapper:
            click.echo(f"  wrapper: {f.wrapper}")
        shown = f.keys if all_keys and f.code.startswith(("SG0", "SG102", "SG2")) else []
        if shown and f.code in ("SG001", "SG002", "SG003", "SG004", "SG005"):
            from surgery.keys import canonical_key

            shown = [f"{k} -> {canonical_key(k)}" for k in shown]
        for line in shown or f.examples:
            click.echo(f"    {line}")
        if not shown and f.count > len(f.examples) and f.examples:
            click.echo(f"    ... and {f.count - len(f.examples)} more (--all lists every key)")
        click.echo(f"  fix: {f.fix}")
    errors = [f for f in report.findings if f.severity == "error"]
    if errors:
        click.secho(f"FAIL: {len(errors)} finding(s), {report.problems} key(s)", fg="red",
                    bold=True)
    else:
        click.secho("OK: prefix-free" + (", manifest matches" if report.manifest else "")
                    + (", data finite" if report.deep else ""), fg="green")


@cli.command(epilog=EPILOG)
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(),
                metavar="CHECKPOINT...")
@click.option("--manifest", metavar="PATH", type=click.Path(dir_okay=False),
              help="Check the manifest's fingerprint and region paths against the checkpoint "
              "(a .surgery.toml, or an export that embeds one).")
@click.option("--deep", is_flag=True, help="Read the data too: NaN/Inf, float64, shared storage.")
@click.option("--key", metavar="ENTRY", help="Container entry that holds the state dict "
              "(nested: outer/inner).")
@click.option("--prefix", metavar="PREFIX", help="Verify only the model under this attribute "
              "prefix (e.g. a LightningModule's model.).")
@click.option("--all", "all_keys", is_flag=True, help="List every affected key, not examples.")
@FORMAT_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report "
              "(schemas/verify-output.schema.json).")
@handle_errors
def verify(checkpoints: tuple[str, ...], manifest: str | None, deep: bool, key: str | None,
           prefix: str | None, all_keys: bool, fmt: str | None, as_json: bool) -> None:
    """Prove CHECKPOINT is prefix-free (a CI gate): exit 0 clean, 1 findings, 3 unreadable.

    CHECKPOINT is a file or a save_pretrained folder; several are checked one by one (as a
    pre-commit hook passes them) and the worst exit code wins. For a .safetensors file it reads
    the header only, without importing torch.
    """
    from surgery.hygiene import verify_checkpoint

    def one(checkpoint: str) -> int:
        resolved = _resolve(checkpoint, fmt, quiet=as_json)
        progress = _Progress("scanning")
        try:
            with _no_cycle_collection():
                report = verify_checkpoint(resolved.path, key=key, prefix=prefix,
                                           manifest=manifest, deep=deep, progress=progress,
                                           kind=resolved.kind)
        finally:
            progress.close()
        if as_json:
            emit_json(report.to_dict(all_keys=all_keys))
        else:
            _render_findings(report, all_keys=all_keys)
        return 0 if report.clean else 1

    _each(checkpoints, one, as_json=as_json)


def _parse_shard_size(ctx: click.Context, param: click.Parameter, value: str | None
                      ) -> int | None:
    if value is None:
        return None
    from surgery.stream import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@cli.command(epilog=EPILOG)
@click.argument("checkpoint", type=click.Path())
@click.option("-o", "--output", required=True, metavar="OUT.safetensors",
              help="Where to write (shards are named after it).")
@click.option("--manifest", metavar="PATH", type=click.Path(dir_okay=False),
              help="Embed this manifest (its fingerprint must match) in the output (a "
              ".surgery.toml, or an export that embeds one).")
@click.option("--key", metavar="ENTRY", help="Container entry that holds the state dict "
              "(nested: outer/inner).")
@click.option("--prefix", metavar="PREFIX", help="Export only the model under this attribute "
              "prefix, without it (e.g. a LightningModule's model.).")
@click.option("--max-shard-size", callback=_parse_shard_size, metavar="SIZE",
              help="Split into shards of at most SIZE (e.g. 5GB, 500MiB) plus an index.json.")
@click.option("--force", is_flag=True, help="Replace existing output files (the file, or "
              "the shards and index). Without it an existing file is never overwritten, even "
              "one that appears during the export, e.g. from a concurrent run (exit 3).")
@FORMAT_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable result "
              "(schemas/export-output.schema.json).")
@handle_errors
def export(checkpoint: str, output: str, manifest: str | None, key: str | None,
           prefix: str | None, max_shard_size: int | None, force: bool, fmt: str | None,
           as_json: bool) -> None:
    """Write CHECKPOINT's unwrapped model as prefix-free safetensors.

    CHECKPOINT is a file or a save_pretrained folder. The write is atomic and streams tensor
    by tensor; the input is never modified.
    """
    from surgery.hygiene import export_checkpoint

    if not output.endswith(".safetensors"):
        raise click.BadParameter(f"{output!r} does not end in .safetensors",
                                 param_hint="'-o' / '--output'")
    resolved = _resolve(checkpoint, fmt, quiet=as_json)
    progress = _Progress("writing")
    try:
        result = export_checkpoint(resolved.path, out=output, key=key, prefix=prefix,
                                   manifest=manifest, max_shard_size=max_shard_size,
                                   force=force, progress=progress, kind=resolved.kind)
    finally:
        progress.close()
    if as_json:
        emit_json(result.to_dict())
        return
    where = result.index or result.files[0]
    shards = f" in {len(result.files)} shards" if result.index else ""
    click.echo(f"wrote {where}{shards}: {result.tensors} tensors "
               f"({result.stored} stored, {len(result.aliases)} tied), "
               f"{result.renamed} renamed, {result.bytes_written / 1e6:.1f} MB "
               f"in {result.seconds:.2f} s")
    click.echo(f"  fingerprint {result.fingerprint}")
    if result.manifest_sha256:
        click.echo(f"  manifest embedded (sha256 {result.manifest_sha256[:16]}...)")
    for k, why in sorted(result.dropped.items())[:5]:
        click.echo(f"  left out {k}: {why}")
    if len(result.dropped) > 5:
        click.echo(f"  ... and {len(result.dropped) - 5} more left out")
    for note in result.recovered:
        click.secho(f"note: {note}", fg="yellow", err=True)


# ---- warm --------------------------------------------------------------------------------------


def _parse_overrides(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
                     ) -> dict[str, Any]:
    """KEY=VALUE pairs; VALUE is JSON when it parses (true, 3, null, {...}), else a string."""
    out: dict[str, Any] = {}
    for item in values:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE (e.g. backend=aot_eager)")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


@cli.command(epilog=EPILOG)
@click.option("--model", "model_spec", required=True, metavar="PKG.MOD:FACTORY",
              callback=_factory_spec,
              help="Factory that builds the model (with its weights or not: shapes matter).")
@click.option("--manifest", required=True, type=click.Path(dir_okay=False),
              help="The manifest to apply (.surgery.toml, or an export that embeds one).")
@click.option("--input", "input_spec", required=True, metavar="PKG.MOD:FACTORY",
              callback=_factory_spec, help="Factory that receives the model and returns its "
              "example input (e.g. surgery.examples:example_input).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]),
              help="Where to warm up (default: cuda when available). A bundle is valid only "
              "for this device kind and GPU.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Cast the model first (compile for the dtype you deploy in).")
@click.option("-o", "--output", metavar="BUNDLE", help="Where to write the bundle. Default: "
              "beside the manifest, as STEM.surgery.cache.")
@click.option("--force", is_flag=True, help="Replace an existing bundle at the output path. "
              "Without it an existing file is never overwritten (exit 3).")
@click.option("--overrides", "overrides", multiple=True, metavar="KEY=VALUE",
              callback=_parse_overrides, help="Compile overrides over every region (e.g. "
              "on_cpu=compile, mode=null). Deployment must pass the same. Repeatable.")
@click.option("--key-file", metavar="PATH", type=click.Path(dir_okay=False),
              help="The key that signs the bundle (default: $SURGERY_CACHE_KEY, else "
              "$SURGERY_CACHE_KEY_FILE). Deployment loads only bundles signed with its key.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable result.")
@handle_errors
def warm(model_spec: str, manifest: str, input_spec: str, device: str | None,
         dtype: str | None, output: str | None, force: bool, overrides: dict[str, Any],
         key_file: str | None, as_json: bool) -> None:
    """Compile the manifest's regions once and save the compile caches as a bundle.

    \b
    Deployment then loads it before compiling, and skips the compiles it holds:
      apply_manifest(model, "model.surgery.toml", cache=True, warmup=...)
    It is loaded only on the same torch / triton / CUDA / GPU and for the same manifest,
    and only when signed with the deployer's key: make one with
    python -c "import secrets;print(secrets.token_hex(32))" > cache.key, then set
    SURGERY_CACHE_KEY_FILE=cache.key here and where the bundle is loaded.

    \b
    Example:
      surgery warm --model surgery.examples:tiny --manifest tiny.surgery.toml
          --input surgery.examples:example_input --device cpu --overrides on_cpu=compile
    """
    from surgery.warm import warm_start

    result = warm_start(model_spec, manifest=manifest, input_spec=input_spec, device=device,
                        dtype=dtype, out=output, force=force, overrides=overrides,
                        key_file=key_file)
    if as_json:
        emit_json({"bundle": result.bundle.path, "bytes": result.bundle.bytes,
                   "seconds": round(result.seconds, 3), "metadata": result.bundle.metadata,
                   "regions": result.report.counts(),
                   "cache": vars(result.report.cache) if result.report.cache else None})
        return
    for line in result.bundle.describe():
        click.echo(line)
    click.echo(f"warm-up: {result.seconds:.1f} s")
    click.echo(result.report.summary())


def main() -> None:
    cli(prog_name="surgery")


if __name__ == "__main__":  # pragma: no cover
    main()
