"""`surgery plan`, `surgery check` and `surgery warm`: write a manifest, validate one, warm a
deployment up and save its signed compile-cache bundle.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from surgery.cli.app import (
    FORMAT_OPTION,
    _each,
    _factory_spec,
    _no_cycle_collection,
    _resolve,
    cli,
    emit_json,
    exit_epilog,
    handle_errors,
)
from surgery.errors import OutputExistsError
from surgery.formats import source as sources
from surgery.formats.manifest import dumps_manifest
from surgery.formats.safe_write import write_text_atomic
from surgery.planning import plan as planner
from surgery.planning.regions import check_kinds


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
               f"({cov['covered_ms']:.2f} of {cov['step_ms']:.2f} ms, {cov['clock']}, timed "
               "around the step without hooks)")
    if "names_covered_share" in cov:
        kept = "names-only" if cov.get("chosen") == "names" else "evidence"
        click.echo(f"  evidence {cov['covered_share']:.1%} of the step, names-only "
                   f"{cov['names_covered_share']:.1%}: kept the {kept} plan")
    for r in cov.get("remainder", []):
        click.echo(f"  eager {r['share']:>6.1%} {r['ms']:>9.3f} ms  {r['path']}")
    if "graph_bytes" in cov:  # surgery.planning.graph_estimate
        mib = 2**20
        peak = (f"; peak about {cov['peak_estimate_bytes'] / mib:.1f} MiB (eager "
                f"{cov['eager_peak_bytes'] / mib:.1f})" if "peak_estimate_bytes" in cov else "")
        click.echo(f"  region graphs about {cov['graph_bytes'] / mib:>9.2f} MiB  (output sets "
                   f"{cov['graph_outputs_bytes'] / mib:.2f}, static inputs "
                   f"{cov['graph_static_inputs_bytes'] / mib:.2f}; "
                   f"{cov['graph_bytes_unshared'] / mib:.2f} unshared; capture pool not "
                   f"estimated){peak}")


@cli.command(epilog=exit_epilog(0, 2, 3, 130))
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
@click.option("--piecewise/--no-piecewise", default=None, help="With --model: plan each "
              "streaming block (attention over a growing cache) as ONE piecewise region: one "
              "graph split at attention and the cache, its fixed-shape pieces captured as CUDA "
              "graphs (surgery/runtime/piecewise.py), instead of leaving it out. Default: off "
              "by names; with --input, on where the plain plan covers under half of the step "
              "and the piecewise blocks at least twice as much (surgery/planning/"
              "compile_cost.py).")
@click.option("--capture", type=click.Choice(["compiler", "region"]),
              help="Who captures CUDA graphs. 'region' (default): surgery captures one graph per "
              "region path and replays it without entering dynamo, which cuts the host time of "
              "each call several-fold (benchmarks/RESULTS.md; the contract is in "
              "surgery/runtime/graphs/replay.py). 'compiler': inductor's cudagraph trees (mode "
              "reduce-overhead).")
@click.option("--input", "input_spec", metavar="PKG.MOD:STEP", callback=_factory_spec,
              help="With --model: plan from evidence. STEP(model) runs one step: it may call "
              "model(x), model.forward(x), a method such as model.generate(...), or a loop "
              "(e.g. surgery.examples:stream_step streams one frame); plan runs it --steps times "
              "eagerly, records every module call's signature and time, and makes regions of "
              "the subtrees that keep one shape. The manifest gets [coverage]. No region found: "
              "exit 1, with the reasons.")
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
         piecewise: bool | None, capture: str | None, fmt: str | None, input_spec: str | None,
         steps: int,
         device: str, dtype: str, as_json: bool) -> None:
    """Write a manifest of compile regions for a checkpoint or a live model.

    \b
    SOURCE is a .safetensors, .pt/.pth/.pth.tar/.ckpt/.bin or sharded *.index.json checkpoint,
    or a save_pretrained folder holding one (model.safetensors, pytorch_model.bin, ...), or a
    DCP folder (torch.distributed.checkpoint.save: planned from its .metadata alone).
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

    if (source is None) == (model_spec is None):
        raise click.UsageError("give either a checkpoint SOURCE or --model PKG.MOD:FACTORY")
    if model_spec is not None and (key or prefix or fmt):
        raise click.UsageError("--key, --prefix and --format apply to checkpoints, not to --model")
    if output == "-" and as_json:
        raise click.BadParameter("-o - writes the manifest to stdout, where --json would go too; "
                                 "write the manifest to a file", param_hint="-o")
    if input_spec is not None and model_spec is None:
        raise click.UsageError("--input drives a live model: give --model PKG.MOD:FACTORY too")
    if piecewise and model_spec is None:
        raise click.UsageError("--piecewise needs a live model (--model PKG.MOD:FACTORY): a "
                               "checkpoint cannot show where a block keeps its cache")
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
            # imported here: it imports torch, which plan of a checkpoint must not pay for
            from surgery.planning.observed import plan_observed

            result = plan_observed(model_spec, input_spec=input_spec, steps=steps,
                                   device=device, dtype=dtype, include=include,
                                   exclude=exclude, compile=comp, piecewise=piecewise)
        else:
            result = planner.plan_model(model_spec, include=include, exclude=exclude,
                                        compile=comp, fold=fold, piecewise=bool(piecewise))
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


@cli.command(epilog=exit_epilog(0, 2, 3, 130))
@click.argument("manifests", nargs=-1, required=True, type=click.Path(dir_okay=False),
                metavar="MANIFEST...")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable result.")
@handle_errors
def check(manifests: tuple[str, ...], as_json: bool) -> None:
    """Validate manifest files against the schema.

    MANIFEST is a .surgery.toml, or an export (.safetensors, *.index.json) that embeds one.
    Errors name the TOML location of the problem (e.g. region[2].paths[0]) and its line.
    Exit 0 when all are valid, 3 when one is not.

    \b
    Examples:
      surgery check model.surgery.toml                 # after editing it by hand
      surgery check manifests/*.surgery.toml           # several: the worst exit code wins
      surgery check model.safetensors                  # the manifest an export embeds
      surgery check model.surgery.toml --json
    """

    def one(manifest: str) -> int:
        m = sources.load_manifest_file(manifest)
        check_kinds(m)
        paths = sum(len(r.paths) for r in m.regions)
        if as_json:
            emit_json({"manifest": manifest, "valid": True, "regions": len(m.regions),
                       "paths": paths, "fingerprint": m.fingerprint})
        else:
            click.echo(f"{manifest}: valid ({len(m.regions)} regions, {paths} compiled "
                       f"callables, fingerprint {m.fingerprint[:19]}...)")
        return 0

    _each(manifests, one, as_json=as_json)


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


@cli.command(epilog=exit_epilog(0, 2, 3, 130))
@click.option("--model", "model_spec", required=True, metavar="PKG.MOD:FACTORY",
              callback=_factory_spec,
              help="Factory that builds the model (with its weights or not: shapes matter).")
@click.option("--manifest", required=True, type=click.Path(dir_okay=False),
              help="The manifest to apply (.surgery.toml, or an export that embeds one).")
@click.option("--step", "step_spec", metavar="PKG.MOD:STEP", callback=_factory_spec,
              help="The STEP `plan --input` takes: a callable that receives the model and runs "
              "one step (e.g. surgery.examples:stream_step), run --steps times.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Warm-up passes (default: the manifest's warmup.passes). A streaming model "
              "needs as many as it takes to show each signature twice.")
@click.option("--input", "input_spec", metavar="PKG.MOD:FACTORY", callback=_factory_spec,
              help="The older form: a factory that receives the model and returns its example "
              "input (e.g. surgery.examples:example_input). Use --step for a STEP.")
@click.option("--no-precompile", "no_precompile", is_flag=True,
              help="Leave out the precompiled part (code that loads without dynamo): the "
              "bundle then holds torch's Mega-Cache only.")
@click.option("--aoti", is_flag=True,
              help="Also build an AOTInductor package per region group and signature (a C++ "
              "build each): deployment then runs C++ runners, without inductor's Python.")
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
def warm(model_spec: str, manifest: str, step_spec: str | None, steps: int | None,
         input_spec: str | None, no_precompile: bool, aoti: bool, device: str | None,
         dtype: str | None, output: str | None, force: bool, overrides: dict[str, Any],
         key_file: str | None, as_json: bool) -> None:
    """Compile the manifest's regions once and save the compile caches as a bundle.

    \b
    Deployment then loads it before compiling, and skips the compiles it holds:
      apply_manifest(model, "model.surgery.toml", cache=True, warmup=...)
    It is loaded only on the same torch / triton / CUDA / GPU and for the same manifest,
    and only when signed with the deployer's key: make one with
    (umask 077; python -c "import secrets;print(secrets.token_hex(32))" > cache.key), then
    set SURGERY_CACHE_KEY_FILE=cache.key here and where the bundle is loaded (a key file
    that others can read is refused: whoever reads it can sign code that runs here).

    \b
    Streaming models: --step takes the same STEP as `surgery plan --input` (a callable that
    receives the model and runs one step) and runs it --steps times; the older
    --input FACTORY form still works, with a note.

    \b
    The bundle also holds each region group's code compiled ahead of time (torch 2.10+), which
    deployment runs without dynamo tracing; without that path it holds the Mega-Cache only.

    \b
    Example:
      surgery warm --model surgery.examples:tiny_sdpa --manifest tiny.surgery.toml
          --step surgery.examples:stream_step --steps 4 --device cpu --overrides on_cpu=compile
    """
    if (step_spec is None) == (input_spec is None):
        raise click.UsageError("give --step PKG.MOD:STEP (what `plan --input` takes) or the "
                               "older --input PKG.MOD:FACTORY, exactly one of them")
    from surgery.runtime.warm import warm_start  # imports torch: only `warm` pays for it

    result = warm_start(model_spec, manifest=manifest, input_spec=input_spec,
                        step_spec=step_spec, steps=steps, device=device, dtype=dtype,
                        out=output, force=force, overrides=overrides, key_file=key_file,
                        precompile=not no_precompile, aoti=aoti)
    if as_json:
        emit_json({"bundle": result.bundle.path, "bytes": result.bundle.bytes,
                   "seconds": round(result.seconds, 3), "metadata": result.bundle.metadata,
                   "regions": result.report.counts(),
                   "cache": vars(result.report.cache) if result.report.cache else None,
                   "notes": result.notes})
        return
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    for line in result.bundle.describe():
        click.echo(line)
    click.echo(f"warm-up: {result.seconds:.1f} s")
    click.echo(result.report.summary())
