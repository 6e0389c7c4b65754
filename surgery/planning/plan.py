"""`surgery plan`: a checkpoint or a live model -> a validated manifest of compile regions.

Data flow: source -> model view -> regions.find_regions -> Manifest -> validate -> TOML.
A checkpoint is read through checkpoint.py (safetensors: header only, no torch import); a live
model is built from a ``package.module:factory`` on the meta device when possible.
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from surgery.errors import CheckpointError, ModelSourceError, RegionError
from surgery.formats import keys as keymod
from surgery.formats.binding import binding_fields
from surgery.formats.checkpoint import read_checkpoint
from surgery.formats.fingerprint import compute_fingerprint, model_keys
from surgery.formats.manifest import (
    DEFAULT_COMPILE,
    DEFAULT_WARMUP,
    MANIFEST_SUFFIX,
    PIECEWISE_KIND,
    LeftOut,
    Manifest,
    Region,
)
from surgery.formats.source import load_factory
from surgery.formats.tensors import CheckpointInfo, TensorInfo, normalize_dtype
from surgery.formats.ties import TIED_FIELD, live_ties
from surgery.planning.blocks import decoder_note
from surgery.planning.regions import (
    METHOD_KINDS,
    OUTPUTS_OUTLIVE_STEP,
    Candidate,
    find_regions,
    natural_key,
)
from surgery.planning.streaming import NAMES_ONLY_NOTE, plan_piecewise
from surgery.planning.view import ForwardArg, ModelView, ModuleNode, view_from_tensors


@dataclass
class PlanResult:
    """A planned manifest and what the planner noticed on the way."""

    manifest: Manifest
    source: str
    notes: list[str] = field(default_factory=list)  # things the user should know or do
    needs_export: int = 0  # keys carrying wrapper segments

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        total = m.model.get("parameters", 0) or 0
        covered = m.model.get("covered_parameters", 0) or 0
        left = Counter((lo.kind, reason_class(lo.reason)) for lo in m.left_out)
        return {
            "source": self.source,
            "fingerprint": m.fingerprint,
            "regions": dict(_count_kinds(m.regions)),
            "paths": sum(len(r.paths) for r in m.regions),
            "parameters": total,
            "covered_parameters": covered,
            "covered_share": round(covered / total, 4) if total else 0.0,
            "left_out": [{"kind": k, "reason": r, "count": n} for (k, r), n in left.items()],
            "compile": _describe_compile(m.compile),
            "notes": list(self.notes),
            "needs_export": self.needs_export,
        }


def _describe_compile(comp: dict[str, Any]) -> str:
    """One line on how the regions compile and who captures their CUDA graphs."""
    backend = comp.get("backend", "inductor")
    mode = f" mode={comp['mode']}" if comp.get("mode") else ""
    if comp.get("capture") == "region":
        graphs = "CUDA graphs captured by surgery, one per region path (capture = \"region\")"
    elif backend == "cudagraphs" or comp.get("mode") in ("reduce-overhead", "max-autotune"):
        graphs = "CUDA graphs by the compiler (capture = \"compiler\")"
    else:
        graphs = "no CUDA graphs"
    return f"{backend}{mode}; {graphs}"


def _count_kinds(regions: Sequence[Region]) -> Counter[str]:
    """Region paths per kind, in first-seen order."""
    counts: Counter[str] = Counter()
    for r in regions:
        counts[r.kind] += len(r.paths)
    return counts


def reason_class(reason: str) -> str:
    """Group left-out reasons that differ only by the path or the figures they name."""
    if reason.startswith("not worth a graph: under "):
        return reason.partition(" (")[0]
    if reason.startswith("inside ") and ", " in reason:  # inside X, excluded / which runs ...
        return "inside a module " + reason.partition(", ")[2].partition(" region ")[0] \
            .partition(" --exclude")[0]
    for sep in (" region ", " by --exclude "):
        if sep in reason:
            return reason.partition(sep)[0] + sep.rstrip()
    return reason


def default_output(source: str) -> str:
    """`model.safetensors` -> `model.surgery.toml` beside it; a factory -> `<name>.surgery.toml`."""
    if ":" in source and not os.path.exists(source):
        return source.rsplit(":", 1)[1] + MANIFEST_SUFFIX
    source = source.rstrip("/") or source  # a folder (DCP) given as `ckpt/step-10/`: beside it
    base = os.path.basename(source)
    for suffix in (".safetensors.index.json", ".bin.index.json", ".index.json", ".safetensors",
                   ".pth.tar", ".tar", ".pt", ".pth", ".ckpt", ".bin"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return os.path.join(os.path.dirname(source), base + MANIFEST_SUFFIX)


def _canonical_tensors(tensors: Mapping[str, TensorInfo], *, prefix: str | None,
                       notes: list[str]) -> tuple[dict[str, TensorInfo], int]:
    """The unwrapped model's tensors, named as `export` names them (one fingerprint for both).

    Wrapper segments are stripped (collisions refused), EMA bookkeeping is left out, and with
    `prefix` only the keys under it are kept, with it removed.
    """

    mk = model_keys(list(tensors), prefix=prefix)
    if prefix:
        wrapped = sum(1 for k in tensors if keymod.canonical_key(k) != k)
    else:  # model_keys has just canonicalised every kept key: count from its answer
        wrapped = sum(1 for k, c in mk.names.items() if c != k) + sum(
            1 for k in mk.dropped if keymod.canonical_key(k) != k)
    if mk.collisions:
        raise keymod.collision_error(mk.collisions)
    if not mk.names:
        raise CheckpointError(
            f"no key is under the prefix {prefix!r}", path="",
            hint=f"keys start with e.g. {', '.join(repr(k) for k in list(tensors)[:3])}")
    out = {c: tensors[k] for k, c in mk.names.items()}
    if wrapped:
        kinds = Counter(s.name for k in tensors for s in keymod.segments_in(k)
                        if s.where != "leftover")
        listed = ", ".join(f"{n}x {name}." for name, n in kinds.most_common())
        notes.append(f"{wrapped} key(s) carry wrapper segments ({listed}); planned the "
                     "canonical model. Deployment needs a clean file: run `surgery export`.")
    if mk.dropped:
        reasons = Counter(mk.dropped.values())
        notes.append("left out of the plan: " + "; ".join(
            f"{n} key(s): {r}" for r, n in reasons.most_common()))
    if not prefix:
        common = keymod.common_attribute_prefix(out)
        if common is not None:
            notes.append(f"every key starts with {common!r} (e.g. a LightningModule's inner "
                         f"model); if deployment loads the inner model, plan it with "
                         f"--prefix {common}")
    return out, wrapped


def compile_defaults(*, backend: str | None = None, mode: str | None = None,
                     capture: str | None = None) -> dict[str, Any]:
    """The manifest's [compile] table: DEFAULT_COMPILE with a backend / mode / capture on top.

    The default is ``capture = "region"``: surgery captures one CUDA graph per region path. Asking
    for the compiler's own graphs (``--backend cudagraphs``, ``--mode reduce-overhead`` or
    ``--capture compiler``) switches to ``capture = "compiler"``; with inductor that means
    ``mode = "reduce-overhead"`` (cudagraph trees) unless another mode is given.
    """
    out = dict(DEFAULT_COMPILE)
    if backend is not None:
        out["backend"] = backend
        if backend != "inductor":
            out.pop("emulate_precision_casts", None)
    if mode is not None and out["backend"] != "inductor":
        raise RegionError(f"--mode {mode!r} applies to the inductor backend only, not "
                          f"{out['backend']!r}", hint="drop --mode, or use --backend inductor")
    compiler_graphs = out["backend"] == "cudagraphs" or mode == "reduce-overhead"
    if capture == "region" and compiler_graphs:
        what = "--backend cudagraphs" if out["backend"] == "cudagraphs" else \
            "--mode reduce-overhead"
        raise RegionError(f"--capture region with {what} would capture every graph twice",
                          hint=f"drop {what} (surgery captures the region graphs), or use "
                               "--capture compiler")
    if capture == "compiler" or compiler_graphs:
        out["capture"] = "compiler"
        if out["backend"] == "inductor" and mode is None:
            out["mode"] = "reduce-overhead"
    if mode is not None:
        out["mode"] = mode
    return out


def _manifest(view: ModelView, tensors: Mapping[str, TensorInfo], *, source: str,
              include: Sequence[str], exclude: Sequence[str], extra: dict[str, Any],
              compile: dict[str, Any] | None = None, fold: bool = False) -> Manifest:
    found = find_regions(view, include=include, exclude=exclude, fold=fold)
    groups: dict[tuple[str, str, str, str | None], list[Candidate]] = {}
    for c in found.regions:
        groups.setdefault((c.kind, c.callable, c.group, c.cls), []).append(c)
    regions: list[Region] = []
    covered = 0
    compile = dict(compile or DEFAULT_COMPILE)
    # Region capture keeps a ring of output buffers for outputs kept across calls, so nothing
    # needs a clone; the compiler's graphs need one where outputs outlive the step.
    ring = compile.get("capture") == "region"
    if ring:
        compile["clone_outputs"] = False
    for (kind, callable_, _group, cls), members in groups.items():
        params = sum(view.numel(c.module_path) for c in members) if callable_ == "forward" else 0
        covered += params
        keep = None if ring else OUTPUTS_OUTLIVE_STEP.get(kind)
        regions.append(Region(kind=kind, callable=callable_, module_class=cls,
                              parameters=params if callable_ == "forward" else None,
                              compile={} if keep is None else {"clone_outputs": keep},
                              paths=sorted((c.path for c in members), key=natural_key)))
    regions.sort(key=lambda r: natural_key(r.paths[0]))
    model = {"source": source, **extra, "tensors": len(tensors),
             "parameters": sum(t.numel for t in tensors.values()),
             "covered_parameters": covered, **binding_fields(tensors, canonical=True)}
    return Manifest(
        fingerprint=compute_fingerprint(tensors, canonical=True), regions=regions,
        compile=compile, warmup=dict(DEFAULT_WARMUP),
        left_out=[LeftOut(p, k, r) for p, k, r in found.left_out], model=model)


def plan_checkpoint(path: str, *, key: str | None = None, prefix: str | None = None,
                    include: Sequence[str] = (), exclude: Sequence[str] = (),
                    compile: dict[str, Any] | None = None, fold: bool = False,
                    kind: str | None = None) -> PlanResult:
    """Plan the canonical (prefix-free) model stored in a checkpoint.

    `kind` names the file's format when its suffix does not (checkpoint.KINDS).
    """
    info: CheckpointInfo = read_checkpoint(path, key=key, kind=kind)
    notes: list[str] = []
    if info.entry is not None:
        others = [c for c in info.candidates if c != info.entry]
        also = f"; other state dicts: {', '.join(others)} (choose with --key)" if others else ""
        notes.append(f"used the state dict in entry {info.entry!r}{also}")
    for entry, n in info.optimizer.items():
        notes.append(f"optimizer state ({n} entries) in {entry!r}, ignored")
    if info.ignored:
        notes.append(f"ignored non-tensor entries: {', '.join(info.ignored[:8])}")
    if not info.tensors:
        raise CheckpointError(f"{path}: holds no tensors", path=path,
                              hint="save model.state_dict() into it")
    tensors, wrapped = _canonical_tensors(info.tensors, prefix=prefix, notes=notes)
    extra: dict[str, Any] = {"prefix": prefix} if prefix else {}
    manifest = _manifest(view_from_tensors(tensors), tensors, source=os.path.basename(path),
                         include=include, exclude=exclude, extra=extra, compile=compile,
                         fold=fold)
    if fold:
        notes.extend(_fold_note(manifest))
    notes.extend(decoder_note(manifest, tensors))
    streaming = [lo.path for lo in manifest.left_out if "streaming" in lo.reason]
    if streaming and not any(r.callable == "method" for r in manifest.regions):
        # Only where the checkpoint shows streaming blocks (issue 12: this line used to end
        # every plan, timm's and diffusers' included).
        notes.append(f"{len(streaming)} streaming block(s) (e.g. {streaming[0]}): a checkpoint "
                     "cannot show their fixed-shape methods or forward arguments; plan the live "
                     "model with --model package.module:factory to find them")
    return PlanResult(manifest, path, notes, wrapped)


# --- live models -------------------------------------------------------------------------------


def build_model(spec: str, *, notes: list[str] | None = None) -> Any:
    """Build the model on the meta device (no memory, no init); on the CPU if that fails.

    Some real constructors call `.item()` while building, which the meta device cannot answer.
    """
    import torch

    factory = load_factory(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as meta_err:  # any constructor failure on meta: retry for real
        try:
            model = factory()
        except Exception as e:
            raise ModelSourceError(f"--model {spec!r}: the factory failed: "
                                   f"{e.__class__.__name__}: {e}",
                                   hint="make the factory build the model without arguments"
                                   ) from None
        if notes is not None:
            notes.append(f"built on the CPU: on the meta device the factory failed "
                         f"({meta_err.__class__.__name__}: {str(meta_err)[:80]})")
    if not isinstance(model, torch.nn.Module):
        raise ModelSourceError(f"--model {spec!r} returned a {type(model).__name__}, "
                               "not an nn.Module", hint="return the model from the factory")
    return model


def view_from_module(model: Any) -> tuple[ModelView, dict[str, TensorInfo]]:
    """A view of a live model: its state dict, plus classes, region-worthy methods, and the
    arguments each class's ``forward`` takes (a cache or per-instance index marks a block as
    streaming, surgery.planning.blocks)."""

    tensors = {k: TensorInfo(tuple(v.shape), normalize_dtype(v.dtype))
               for k, v in model.state_dict().items()}
    view = view_from_tensors(tensors)
    view.live = True
    view.optional_cache_streams = _may_pass_a_cache(model)
    signatures: dict[type, tuple[ForwardArg, ...] | None] = {}
    for path, mod in model.named_modules():
        node = view.modules.setdefault(path, ModuleNode(path))
        cls = type(mod)
        node.cls = cls.__name__
        node.methods = frozenset(m for m in METHOD_KINDS if callable(getattr(cls, m, None)))
        if cls not in signatures:
            signatures[cls] = _forward_args(cls)
        node.forward_args = signatures[cls]
        node.library_layer = cls.__module__.startswith("torch.nn.")
    return view, tensors


def _forward_args(cls: type) -> tuple[ForwardArg, ...] | None:
    """The parameters of ``cls.forward`` after ``self`` (None where Python cannot tell)."""
    try:
        sig = inspect.signature(cls.forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError, AttributeError):  # builtins, C extensions
        return None
    out = []
    for i, p in enumerate(sig.parameters.values()):
        if i == 0 or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = "" if p.annotation is p.empty else (
            p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(
                p.annotation))
        out.append(ForwardArg(p.name, p.default is p.empty, ann))
    return tuple(out)


def _may_pass_a_cache(model: Any) -> bool:
    """False when the model says it never generates (transformers' ``can_generate()``), so an
    optional ``cache=None`` argument of its blocks is never given one."""
    can = getattr(type(model), "can_generate", None)
    if not callable(can):
        return True
    try:
        return bool(can())
    except Exception:  # a third-party classmethod may fail in any way: assume it may stream
        return True


def plan_model(spec: str, *, include: Sequence[str] = (), exclude: Sequence[str] = (),
               compile: dict[str, Any] | None = None, fold: bool = False,
               piecewise: bool = False) -> PlanResult:
    """Plan a live model built by a factory; it shows classes and method regions."""
    notes: list[str] = []
    model = build_model(spec, notes=notes)
    return plan_module(model, source=spec, include=include, exclude=exclude, compile=compile,
                       fold=fold, piecewise=piecewise, notes=notes)


def plan_module(model: Any, *, source: str, include: Sequence[str] = (),
                exclude: Sequence[str] = (), compile: dict[str, Any] | None = None,
                fold: bool = False, piecewise: bool = False,
                notes: list[str] | None = None) -> PlanResult:
    """Plan a model already built (``--model``'s factory, or ``compile_regions``), by names."""
    notes = [] if notes is None else notes
    spec = source
    view, tensors = view_from_module(model)
    wrapped = sum(1 for k in tensors if keymod.canonical_key(k) != k)
    if wrapped:
        notes.append(f"the live model's state dict has {wrapped} wrapper-prefixed key(s); "
                     "build it unwrapped (no torch.compile / DDP swapped in) before planning")
    cls = f"{type(model).__module__}.{type(model).__qualname__}"
    ties = live_ties(model)  # recorded, so an export of a file that left them out restores them
    extra: dict[str, Any] = {"class": cls, **({TIED_FIELD: ties} if ties else {})}
    manifest = _manifest(view, tensors, source=spec, include=include, exclude=exclude,
                         extra=extra, compile=compile, fold=fold)
    if fold:
        notes.extend(_fold_note(manifest))
    if piecewise:  # streaming blocks as piecewise regions (surgery.planning.streaming)
        notes.extend(plan_piecewise(manifest, model, view, exclude=exclude))
        if any(r.kind == PIECEWISE_KIND for r in manifest.regions):
            notes.append(NAMES_ONLY_NOTE)
    return PlanResult(manifest, spec, notes, wrapped)


def _fold_note(manifest: Manifest) -> list[str]:
    """--fold that folded nothing says so: a flag that silently does nothing reads as done."""
    if any(lo.reason.startswith("folded into ") for lo in manifest.left_out):
        return []
    return ["--fold folded nothing: no container below the top level has numbered blocks that "
            "are all regions with nothing streaming inside (the model's own block list, as in "
            "timm's blocks.N or Flux's transformer_blocks.N, is the whole model and stays as its "
            "blocks)"]
