"""Building the AOTInductor part of a bundle: export each region signature, package, prove it.

What is built, and why each rule (the loading side and the trust rules are in
surgery.runtime.aoti_bundle). For each compiled group (surgery.runtime.groups) and each static
signature it ran with, from the example recorded at its first call (surgery.runtime.call_example):

1. The call must be one a runner can stand for: grad off (the runner records no autograd graph,
   so a call that would is left to dynamo), and every non-tensor value one the signature holds by
   value (int, bool, str, None: export specialises them, and a float is not in the signature),
   with no dict below the top-level kwargs (their order would decide which tensor goes where).
2. ``torch.export.export`` of a small module around the region's own module (``Region``), whose
   forward calls the group's function, so the weights are the module's own, named
   ``inner.<fqn>``. A call made under autocast is exported with the same autocast entered inside
   that forward (export records it as casts), none around it; the runner is chosen only for
   calls under that autocast (it is in the signature). A graph that mutates an input or a
   buffer is not packaged: the runner's writes would have to land where eager's land, and
   nothing here proves they do.
3. ``aoti_compile_and_package`` with the group's inductor options and
   ``aot_inductor.package_constants_in_so=False``: the weights stay out of the package. Every
   constant the package needs must be a parameter or buffer of the module (no lifted tensor).
4. The build (step 3) runs in a child process, and its proof in a second, fresh one
   (surgery.runtime.aoti_child), never in this one: the package is loaded back from its bytes
   as a deployment loads it, and run on the example twice, on the module's weights and on
   random weights of the same layout, against the region run eagerly here (``functional_call``)
   on the same weights. Only a package that the children built, loaded and ran, and whose output
   follows the weights it is handed, is written.
5. Its code is checked like an artifact's (surgery.runtime.portable): the entry carries the
   source spans dynamo inlined into the torch AOT artifact of the same group and signature
   (non-strict export runs the same Python on the same example), checked against this process's
   modules before the package is loaded. A signature without such an artifact is not packaged.

Each package is a C++ build: seconds to a minute (45 s for a two-Linear block on the 2-core CPU),
so it is asked for (``save_cache(aoti=True)``), never implied.

Why a child. On the H200 (torch 2.11) a CUDA build ended the building process with SIGSEGV,
where no exception can be caught (issue 23). Now such a crash ends the child: the note names the
signal, the stage it died in (export_load, package, load, run) and the torch version, the bundle
is written without that package (dynamo's artifacts and Mega-Cache serve the group), and the
remaining packages of the same save are not tried (each would cost a build to crash the same
way; the notes say so). A Python error in the child is a note for that package only.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from surgery.runtime.aoti_child import ChildFailed, build_in_child
from surgery.runtime.bundle_parts import AOTI_KIND, AOTI_LOADER_FIELD, KIND_FIELD, SOURCES_FIELD
from surgery.runtime.call_example import Example, modes_of

# Inductor options that concern a JIT compile only (CUDA graphs, the compile pool): not passed
# to AOTInductor, which rejects some of them.
_JIT_ONLY = ("triton.cudagraphs", "triton.cudagraph_trees", "compile_threads")


class Region(nn.Module):
    """The region as torch.export sees it: its module (``inner``) and its function, called
    under the autocast the call ran under (``autocast``: (device type, dtype) pairs), entered
    inside the forward so that export records it (``wrap_with_autocast``, then explicit casts
    once decomposed): the package then computes what the region computed under it."""

    def __init__(self, inner: nn.Module | None, fn: Callable[..., Any],
                 autocast: tuple[tuple[str, torch.dtype], ...] = ()) -> None:
        super().__init__()
        if inner is not None:
            self.inner = inner
        self._fn = fn
        self._bound = inner is not None
        self._autocast = autocast

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for dev, dtype in self._autocast:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
            if self._bound:
                return self._fn(self.inner, *args, **kwargs)
            return self._fn(*args, **kwargs)


def _why_not(example: Example) -> str | None:
    """Why a runner cannot stand for this example's calls (None: it can)."""
    if example.grad and not example.inference:
        return "grad is on (the runner keeps no autograd graph)"

    def leaf_problem(v: Any, depth: int) -> str | None:
        if isinstance(v, (tuple, list)):
            return next((p for x in v if (p := leaf_problem(x, depth + 1))), None)
        if isinstance(v, dict):
            if depth > 0:
                return "a dict inside an argument"
            return next((p for x in v.values() if (p := leaf_problem(x, depth + 1))), None)
        if isinstance(v, float):
            return "a float argument (not in the signature by value)"
        return None

    return leaf_problem(example.args, 1) or leaf_problem(example.kwargs, 0)


def _inductor_configs(patches: dict[str, Any] | None) -> dict[str, Any]:
    out = {k: v for k, v in (patches or {}).items() if k not in _JIT_ONLY}
    out["aot_inductor.package_constants_in_so"] = False
    return out


def build_one(group: Any, module: nn.Module, example: Example, *, device: str
              ) -> tuple[bytes, dict[str, Any]]:
    """One package's bytes and its index fields (constants, inputs), proven in a child process
    (surgery.runtime.aoti_child); raises ValueError (or torch's error) naming why it cannot be
    built here, ChildFailed for what the child could not do."""
    if why := _why_not(example):
        raise ValueError(why)
    configs = _inductor_configs(group.backend.config_patches)
    try:
        json.dumps(configs)
    except (TypeError, ValueError):
        raise ValueError("its inductor options are not plain values") from None
    wrapper = Region(module if group.bound else None, group.target, example.autocast)
    weights: dict[str, torch.Tensor] = dict(wrapper.named_parameters())
    weights.update(wrapper.named_buffers())
    with example.modes():
        args, kwargs = example.build()
    # Exported with no autocast around it: the wrapper enters the call's own, which export
    # records; autocast around export would be applied below what export traces, or not at all.
    with modes_of({**example.mode_record(), "autocast": []}):
        ep = torch.export.export(wrapper, args, kwargs, strict=False)
    with example.modes():
        sig = ep.graph_signature
        if sig.buffers_to_mutate or getattr(sig, "user_inputs_to_mutate", None):
            raise ValueError("it mutates a buffer or an input in place")
        trials = {"own": {k: v.detach() for k, v in weights.items()},
                  "random": {k: torch.randn_like(v) if v.is_floating_point() else v.detach()
                             for k, v in weights.items()}}
        wants = {f"want_{t}": torch.func.functional_call(wrapper, w, args, kwargs)
                 for t, w in trials.items()}
    n_inputs = sum(isinstance(x, torch.Tensor)
                   for x in torch.utils._pytree.tree_leaves((args, kwargs)))
    data, constants, loader = build_in_child(
        ep, {"args": args, "kwargs": kwargs, **trials, **wants},
        {"configs": configs, "device": str(device), "bound": bool(group.bound),
         "modes": example.mode_record(), "inputs": n_inputs})
    return data, {"constants": constants, "inputs": n_inputs, AOTI_LOADER_FIELD: loader}


def build_entries(groups: Iterable[Any], *, device: str, signature_text: Callable[[Any], str],
                  offset: int, sources: Mapping[tuple[str, str], list[list[Any]]]
                  ) -> tuple[bytes, list[dict[str, Any]], list[str]]:
    """(bytes, index entries, notes) for every group and signature that can be packaged, the
    bytes to follow ``offset`` bytes of the precompiled part; the notes say which could not and
    why. ``sources``: the inlined source spans of the torch AOT artifact of each (group,
    signature text); a signature without one is not packaged (its code could change unseen)."""
    data = bytearray()
    entries: list[dict[str, Any]] = []
    notes: list[str] = []
    crashed = ""  # the first build that crashed its process: the rest are not tried
    for g in groups:
        if g.identity is None or g.dynamic is True or g.failed is not None:
            continue
        for sig, (module, example) in g.examples.items():
            name = getattr(g.target, "__qualname__", str(g.target))
            if example is None:
                continue  # the dynamo part already notes it
            spans = sources.get((g.identity, signature_text(sig)))
            if spans is None:
                notes.append(f"{name}: no AOTInductor package (no torch AOT artifact to say "
                             "which code it inlines)")
                continue
            if crashed:
                notes.append(f"{name}: no AOTInductor package (not tried: {crashed})")
                continue
            try:
                blob, fields = build_one(g, module, example, device=device)
            except ChildFailed as e:  # the child's build, load or run: dynamo's part remains
                notes.append(f"{name}: no AOTInductor package ({e})")
                if e.crashed:
                    crashed = f"the build of {name} crashed"
                continue
            except Exception as e:  # export or the eager reference: dynamo's part remains
                first = (str(e).strip().splitlines() or [""])[0][:200]
                notes.append(f"{name}: no AOTInductor package ({type(e).__name__}: {first})")
                continue
            entries.append({"group": g.identity, "signature": signature_text(sig),
                            "modes": example.mode_record(), "offset": offset + len(data),
                            "bytes": len(blob), KIND_FIELD: AOTI_KIND, SOURCES_FIELD: spans,
                            **fields})
            data += blob
    return bytes(data), entries, notes
