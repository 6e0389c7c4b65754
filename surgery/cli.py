"""The `surgery` command line. The only module that prints or exits.

Each command checks its flags, calls ONE library function and renders the result. Every library
failure is a SurgeryError; `_run` maps it to an exit code in one place:
0 clean, 1 findings, 2 usage error (Click's), 3 could not run.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from surgery import __version__
from surgery.errors import EXIT_CANNOT_RUN, SurgeryError

F = TypeVar("F", bound=Callable[..., Any])

EPILOG = """\b
Exit codes:
  0  clean / done
  1  findings (verify found problems)
  2  usage error
  3  could not run (unreadable or unsafe checkpoint, invalid manifest)
"""


def _fail(err: SurgeryError) -> None:
    click.secho(f"error: {err.message}", fg="red", err=True)
    if err.hint:
        click.echo(f"  fix: {err.hint}", err=True)
    sys.exit(err.exit_code)


def handle_errors(fn: F) -> F:
    """Map every SurgeryError to its exit code with a one-line message (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SurgeryError as e:
            _fail(e)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except MemoryError:
            click.secho("error: out of memory", fg="red", err=True)
            sys.exit(EXIT_CANNOT_RUN)

    return wrapper  # type: ignore[return-value]


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.version_option(__version__, prog_name="surgery")
def cli() -> None:
    """Make PyTorch models compile-ready for deployment.

    \b
    Typical flow:
      surgery plan model.safetensors          # write model.surgery.toml (compile regions)
      surgery check model.surgery.toml        # validate a (hand-edited) manifest
      surgery verify model.ckpt               # prove the keys are prefix-free (CI gate)
      surgery export model.ckpt -o clean.safetensors --manifest model.surgery.toml
    Then, in deployment: surgery.apply_manifest(model, "model.surgery.toml", warmup=...)
    """


# ---- plan / check (surgery plan) ---------------------------------------------------------------
# (filled in below)


# ---- verify / export ---------------------------------------------------------------------------


# ---- warm --------------------------------------------------------------------------------------


def main() -> None:
    cli(prog_name="surgery")


if __name__ == "__main__":  # pragma: no cover
    main()
