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
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import click

from surgery import __version__
from surgery.errors import EXIT_CANNOT_RUN, SurgeryError
from surgery.formats.limits import printable
from surgery.formats.source import resolve_checkpoint

F = TypeVar("F", bound=Callable[..., Any])

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM
MAX_ERROR_CHARS = 1000  # an error or fix line is cut here; --json keeps the full text

_EXIT_LINES: dict[int, str] = {
    0: "  0  clean / done",
    1: "  1  findings (verify found problems)",
    2: "  2  usage error",
    3: "  3  could not run (unreadable or unsafe checkpoint, invalid manifest, output exists,\n"
       "     or an internal error: SURGERY_DEBUG=1 shows its traceback)",
    130: "  130 interrupted (Ctrl-C), 143 terminated (SIGTERM): no partial output, temps removed",
}


def exit_epilog(*codes: int) -> str:
    """A command's --help epilog: the exit codes that command can return, and no others.

    Every command can be interrupted (130 / 143) and can fail to run (3); only `verify` has
    findings (1).
    """
    return "\b\nExit codes:\n" + "\n".join(_EXIT_LINES[c] for c in sorted(codes)) + "\n"


EPILOG = exit_epilog(0, 1, 2, 3, 130)  # the group's: every code some command returns


def error_json(code: str, message: str, hint: str | None, exit_code: int) -> dict[str, Any]:
    """The --json shape of a failure (schemas/error-output.schema.json): a CI job that parses
    stdout gets the reason, not an empty string."""
    return {"error": {"code": code, "message": message, "hint": hint, "exit_code": exit_code}}


def _fail(err: SurgeryError, *, as_json: bool = False) -> None:
    # One line each, escaped and cut (a key in a message can be 600 KB or hold a newline);
    # the full text stays in the --json output.
    click.secho(f"error: {printable(err.message, max_chars=MAX_ERROR_CHARS)}", fg="red",
                err=True)
    if err.hint:
        click.echo(f"  fix: {printable(err.hint, max_chars=MAX_ERROR_CHARS)}", err=True)
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
        except BrokenPipeError:
            quiet_broken_pipe()  # the reader's choice, not a failure: 141, as under SIGPIPE
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

    resolved = resolve_checkpoint(source, format=format)
    if resolved.note and not quiet:
        click.secho(f"note: {resolved.note}", fg="yellow", err=True)
    return resolved


FORMAT_OPTION = click.option(
    "--format", "fmt", type=click.Choice(["safetensors", "torch", "index", "dcp"]),
    help="Read the checkpoint as this format whatever its suffix: safetensors, torch "
    "(torch.save: .pt/.pth/.pth.tar/.ckpt/.bin), index (a sharded *.index.json) or dcp (a "
    "torch.distributed.checkpoint folder; found by its .metadata without this flag).")


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
      surgery export ckpt/step-1000 -o clean.safetensors  # a DCP folder (FSDP2, torchtitan)
      surgery warm --model pkg.mod:build --manifest model.surgery.toml --step pkg.mod:step
    Then, in deployment: surgery.apply_manifest(model, "model.surgery.toml", warmup=...)
    """




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
            click.secho(f"error: {printable(e.message, max_chars=MAX_ERROR_CHARS)}", fg="red",
                        err=True)
            if e.hint:
                click.echo(f"  fix: {printable(e.hint, max_chars=MAX_ERROR_CHARS)}", err=True)
            code = e.exit_code
        worst = max(worst, code)
    sys.exit(worst)






EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as shells report a reader that went away


def main() -> None:
    """The console script. A reader that closes the pipe early (``surgery verify ... | head``)
    ends the run quietly with 141, as a shell tool killed by SIGPIPE would."""
    try:
        cli(prog_name="surgery")
    except BrokenPipeError:
        quiet_broken_pipe()
    try:
        sys.stdout.flush()  # what was buffered meets the closed pipe here, not at exit
    except BrokenPipeError:
        quiet_broken_pipe()


def quiet_broken_pipe() -> None:
    # Python flushes stdout again at exit and would print "Exception ignored ... BrokenPipe":
    # point it at /dev/null first.
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    os._exit(EXIT_BROKEN_PIPE)



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
