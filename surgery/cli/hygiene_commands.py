"""`surgery verify` and `surgery export`: the key-hygiene gate and the clean export, with a progress
bar on a terminal and the findings rendered one block per wrapper kind. Also `surgery bytecode`,
the opt-in deployment step that byte-compiles a warm start's imports (surgery.runtime.bytecode).
"""

from __future__ import annotations

import re
import sys
from typing import Any

import click

from surgery import hygiene
from surgery.cli.app import (
    FORMAT_OPTION,
    MAX_ERROR_CHARS,
    _each,
    _no_cycle_collection,
    _resolve,
    cli,
    emit_json,
    exit_epilog,
    handle_errors,
)
from surgery.formats.keys import canonical_key
from surgery.formats.limits import printable
from surgery.formats.writer import parse_size


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


def _echo(line: str, **kw: Any) -> None:
    """One line of text output: keys and paths come from the file, so control characters are
    escaped (a newline in a key must not forge an "OK" line) and the line is cut; --json keeps
    every key in full."""
    click.echo(printable(line, max_chars=MAX_ERROR_CHARS), **kw)


def _secho(line: str, **kw: Any) -> None:
    click.secho(printable(line, max_chars=MAX_ERROR_CHARS), **kw)


def _render_findings(report: Any, *, all_keys: bool) -> None:
    where = f", entry {report.entry!r}" if report.entry else ""
    pre = f", prefix {report.prefix!r}" if report.prefix else ""
    _echo(f"{report.path}: {report.tensors} tensors ({report.format}{where}{pre})")
    if report.fingerprint:
        _echo(f"  fingerprint {report.fingerprint}")
    for f in report.findings:
        color = "red" if f.severity == "error" else "yellow"
        n = f"{f.count} key{'s' if f.count != 1 else ''}" if f.keys else ""
        _secho(f"{f.code} {f.severity}: {f.title}" + (f" ({n})" if n else ""), fg=color)
        if f.wrapper:
            _echo(f"  wrapper: {f.wrapper}")
        shown = f.keys if all_keys and f.code.startswith(("SG0", "SG102", "SG2")) else []
        if shown and f.code in ("SG001", "SG002", "SG003", "SG004", "SG005"):

            shown = [f"{k} -> {canonical_key(k)}" for k in shown]
        for line in shown or f.examples:
            _echo(f"    {line}")
        if not shown and f.count > len(f.examples) and f.examples:
            _echo(f"    ... and {f.count - len(f.examples)} more (--all lists every key)")
        _echo(f"  fix: {f.fix}")
    errors = [f for f in report.findings if f.severity == "error"]
    if errors:
        _secho(f"FAIL: {len(errors)} finding(s), {report.problems} key(s)", fg="red",
                    bold=True)
    else:
        _secho("OK: prefix-free" + (", manifest matches" if report.manifest else "")
                    + (", data finite" if report.deep else ""), fg="green")


@cli.command(epilog=exit_epilog(0, 1, 2, 3, 130))
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

    CHECKPOINT is a file, a save_pretrained folder or a DCP folder (torch.distributed.checkpoint:
    .metadata + *.distcp, read from .metadata alone); several are checked one by one (as a
    pre-commit hook passes them) and the worst exit code wins. For a .safetensors file it reads
    the header only, without importing torch.

    \b
    Examples:
      surgery verify model.ckpt                        # exit 1 if a wrapper segment is left
      surgery verify last.ckpt --prefix model.         # a LightningModule's inner model
      surgery verify model.safetensors --manifest model.surgery.toml   # bound to its plan?
      surgery verify model.safetensors --deep          # NaN/Inf, float64, shared storage
      surgery verify ckpts/*.pt --json                 # one report per file, worst exit wins
      surgery verify ckpt/step-1000 --deep             # a DCP folder, each tensor read once
    """
    def one(checkpoint: str) -> int:
        resolved = _resolve(checkpoint, fmt, quiet=as_json)
        progress = _Progress("scanning")
        try:
            with _no_cycle_collection():
                report = hygiene.verify_checkpoint(resolved.path, key=key, prefix=prefix,
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

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@cli.command(epilog=exit_epilog(0, 2, 3, 130))
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

    CHECKPOINT is a file, a save_pretrained folder or a DCP folder (torch.distributed.checkpoint).
    The write is atomic and streams tensor by tensor; the input is never modified.

    \b
    Examples:
      surgery export model.ckpt -o model.safetensors --manifest model.surgery.toml
      surgery export last.ckpt --prefix model. -o model.safetensors   # Lightning's inner model
      surgery export ema.pt --key ema -o ema.safetensors               # one entry of a container
      surgery export ./bert/ -o bert.safetensors --max-shard-size 2GB  # shards + index.json
      surgery export ckpt/step-1000 -o model.safetensors  # a DCP folder (FSDP2, torchtitan)
    """
    if not output.endswith(".safetensors"):
        raise click.BadParameter(f"{output!r} does not end in .safetensors",
                                 param_hint="'-o' / '--output'")
    resolved = _resolve(checkpoint, fmt, quiet=as_json)
    progress = _Progress("writing")
    try:
        result = hygiene.export_checkpoint(resolved.path, out=output, key=key, prefix=prefix,
                                   manifest=manifest, max_shard_size=max_shard_size,
                                   force=force, progress=progress, kind=resolved.kind)
    finally:
        progress.close()
    if as_json:
        emit_json(result.to_dict())
        return
    where = result.index or result.files[0]
    shards = f" in {len(result.files)} shards" if result.index else ""
    _echo(f"wrote {where}{shards}: {result.tensors} tensors "
               f"({result.stored} stored, {len(result.aliases)} tied), "
               f"{result.renamed} renamed, {result.bytes_written / 1e6:.1f} MB "
               f"in {result.seconds:.2f} s")
    _echo(f"  fingerprint {result.fingerprint}")
    if result.manifest_sha256:
        _echo(f"  manifest embedded (sha256 {result.manifest_sha256[:16]}...)")
    for k, why in sorted(result.dropped.items())[:5]:
        _echo(f"  left out {k}: {why}")
    if len(result.dropped) > 5:
        _echo(f"  ... and {len(result.dropped) - 5} more left out")
    for note in result.recovered:
        _secho(f"note: {note}", fg="yellow", err=True)


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def _module_names(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
                  ) -> tuple[str, ...]:
    for name in values:
        if not _MODULE_NAME.match(name):
            raise click.BadParameter(f"{name!r} is not a dotted module name (e.g. "
                                     "transformers.models.bert.modeling_bert)")
    return values


@cli.command(epilog=exit_epilog(0, 2, 3, 130))
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--import", "extra", multiple=True, metavar="MODULE", callback=_module_names,
              help="Also compile what MODULE imports (your model's package, e.g. "
              "transformers.models.bert.modeling_bert). Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable result.")
@handle_errors
def bytecode(folder: str, extra: tuple[str, ...], as_json: bool) -> None:
    """Byte-compile what a warm start imports into FOLDER, once, as pip does at install.

    \b
    For an image that ships no .pyc and sets PYTHONDONTWRITEBYTECODE=1, where every fresh
    process compiles torch's loader from source (on an H200: 1.2 s more per warm start).
    Run this once on the image (same Python, same packages), then deploy with
      PYTHONPYCACHEPREFIX=FOLDER
    Only FOLDER is written (never a package's own __pycache__). It must be private: created
    0700 when missing, refused (exit 3) when others may write it or a folder above it,
    because a .pyc there is code every deployment runs. A package upgraded since is compiled
    from source again (Python checks each .pyc against its source): run this again then.

    \b
    Examples:
      surgery bytecode /srv/model/pyc
      surgery bytecode /srv/model/pyc --import transformers.models.bert.modeling_bert
      PYTHONPYCACHEPREFIX=/srv/model/pyc python serve.py
    """
    from surgery.runtime.bytecode import compile_bytecode  # imports torch: only this pays

    result = compile_bytecode(folder, extra_modules=extra)
    if as_json:
        emit_json({"folder": result.folder, "files": result.files, "failed": result.failed,
                   "discover_s": result.discover_s, "compile_s": result.compile_s})
        return
    for line in result.describe():
        _echo(line)
