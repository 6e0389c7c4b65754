"""Building the AOTInductor part of a bundle: export each region signature, package, prove it.

What is built, and why each rule (the loading side and the trust rules are in
surgery.runtime.aoti_bundle). For each compiled group (surgery.runtime.groups) and each static
signature it ran with, from the example recorded at its first call (surgery.runtime.call_example):

1. The call must be one a runner can stand for: grad off (the runner records no autograd graph,
   so a call that would is left to dynamo), no autocast (export would have to trace it), and every
   non-tensor value one the signature holds by value (int, bool, str, None: export specialises
   them, and a float is not in the signature), with no dict below the top-level kwargs (their
   order would decide which tensor goes where).
2. ``torch.export.export`` of a small module around the region's own module (``Region``), whose
   forward calls the group's function, so the weights are the module's own, named
   ``inner.<fqn>``. A graph that mutates an input or a buffer is not packaged: the runner's writes
   would have to land where eager's land, and nothing here proves they do.
3. ``aoti_compile_and_package`` with the group's inductor options and
   ``aot_inductor.package_constants_in_so=False``: the weights stay out of the package. Every
   constant the package needs must be a parameter or buffer of the module (no lifted tensor).
4. The package is loaded back from its bytes (surgery.runtime.aoti_bundle.open_package, the same
   path a deployment takes) and run on the example twice, on the module's weights and on random
   weights of the same layout, against the region run eagerly (``functional_call``) on the same
   weights. Only a package that follows the weights it is handed is written.

5. Its code is checked like an artifact's (surgery.runtime.portable): the entry carries the
   source spans dynamo inlined into the torch AOT artifact of the same group and signature
   (non-strict export runs the same Python on the same example), checked against this process's
   modules before the package is loaded. A signature without such an artifact is not packaged.

Each package is a C++ build: seconds to a minute (45 s for a two-Linear block on the 2-core CPU),
so it is asked for (``save_cache(aoti=True)``), never implied.

CUDA is off unless asked for (``CUDA_OPT_IN``). The one run on a GPU (an H200, torch 2.11, the
cuda test of tests/test_aoti_bundle.py and ``gpu_warm_start.py --aoti``) ended the building
process with SIGSEGV inside the build, where no exception can be caught. Until a build on CUDA
is shown to work, a CUDA bundle is built without packages (dynamo's artifacts and Mega-Cache, as
before), with a note; ``SURGERY_AOTI_CUDA=1`` builds them anyway, to try a newer torch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from surgery.runtime.aoti_bundle import PREFIX, AotiRunner, layout_of, open_package
from surgery.runtime.bundle_parts import AOTI_KIND, KIND_FIELD, SOURCES_FIELD
from surgery.runtime.call_example import Example

# Inductor options that concern a JIT compile only (CUDA graphs, the compile pool): not passed
# to AOTInductor, which rejects some of them.
# The switch that lets a CUDA bundle carry packages (see the docstring), and what is said without.
CUDA_OPT_IN = "SURGERY_AOTI_CUDA"
CUDA_OFF_NOTE = ("no AOTInductor packages on CUDA: building one crashed the process (SIGSEGV) on "
                 f"the one GPU run (H200, torch 2.11); set {CUDA_OPT_IN}=1 to build them anyway")
_JIT_ONLY = ("triton.cudagraphs", "triton.cudagraph_trees", "compile_threads")


class Region(nn.Module):
    """The region as torch.export sees it: its module (``inner``) and its function."""

    def __init__(self, inner: nn.Module | None, fn: Callable[..., Any]) -> None:
        super().__init__()
        if inner is not None:
            self.inner = inner
        self._fn = fn
        self._bound = inner is not None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(self.inner, *args, **kwargs) if self._bound else self._fn(*args, **kwargs)


def _why_not(example: Example) -> str | None:
    """Why a runner cannot stand for this example's calls (None: it can)."""
    if example.grad and not example.inference:
        return "grad is on (the runner keeps no autograd graph)"
    if example.autocast:
        return "autocast is on"

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


def _close(got: Any, want: Any) -> bool:
    ga, wa = torch.utils._pytree.tree_flatten(got), torch.utils._pytree.tree_flatten(want)
    if ga[1] != wa[1] or len(ga[0]) != len(wa[0]):
        return False
    for g, w in zip(ga[0], wa[0], strict=True):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                return False
            tol = 1e-3 if w.dtype in (torch.float32, torch.float64) else 3e-2
            scale = float(w.abs().max()) if w.numel() and w.is_floating_point() else 0.0
            if w.numel() and float((g.double() - w.double()).abs().max()) > tol * (1 + scale):
                return False
        elif g != w:
            return False
    return True


def build_one(group: Any, module: nn.Module, example: Example, *, device: str
              ) -> tuple[bytes, dict[str, Any]]:
    """One package's bytes and its index fields (constants, inputs); raises ValueError (or
    torch's error) naming why it cannot be built."""
    from torch._inductor import aoti_compile_and_package  # heavy: inductor's AOT compiler

    if why := _why_not(example):
        raise ValueError(why)
    wrapper = Region(module if group.bound else None, group.target)
    with example.modes():
        args, kwargs = example.build()
        ep = torch.export.export(wrapper, args, kwargs, strict=False)
    sig = ep.graph_signature
    if sig.buffers_to_mutate or getattr(sig, "user_inputs_to_mutate", None):
        raise ValueError("it mutates a buffer or an input in place")
    folder = tempfile.mkdtemp(prefix="surgery-aoti-build-")
    path = os.path.join(folder, "package.pt2")
    try:
        aoti_compile_and_package(ep, package_path=path,
                                 inductor_configs=_inductor_configs(group.backend.config_patches))
        with open(path, "rb") as f:
            data = f.read()
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    weights: dict[str, torch.Tensor] = dict(wrapper.named_parameters())
    weights.update(wrapper.named_buffers())
    loader = open_package(data, device=device)
    fqns = loader.get_constant_fqns()
    if not all(f.startswith(PREFIX) and f in weights for f in fqns):
        raise ValueError("it needs a constant that is not a weight of the module")
    constants = [[f[len(PREFIX):], layout_of(weights[f])] for f in sorted(fqns)]
    n_inputs = sum(isinstance(x, torch.Tensor)
                   for x in torch.utils._pytree.tree_leaves((args, kwargs)))
    runner = AotiRunner(loader, constants, bound=group.bound, inputs=n_inputs)
    with example.modes():
        for trial in ("own", "random"):
            use = dict(weights) if trial == "own" else {
                k: torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()}
            probe = nn.Module() if group.bound else None
            if probe is not None:  # a module of the same tree, holding ``use``
                _plant(probe, {k[len(PREFIX):]: v for k, v in use.items()})
            ok, got = runner.try_call((probe, *args) if group.bound else args, kwargs)
            want = torch.func.functional_call(wrapper, use, args, kwargs)
            if not ok or not _close(got, want):
                raise ValueError(f"its output does not follow the weights it is given ({trial} "
                                 "weights)")
    return data, {"constants": constants, "inputs": n_inputs}


def _plant(root: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put ``tensors`` at their fqns under ``root`` (as buffers of empty modules)."""
    for fqn, t in tensors.items():
        *path, name = fqn.split(".")
        m = root
        for p in path:
            if p not in m._modules:
                m._modules[p] = nn.Module()
            m = m._modules[p]  # type: ignore[assignment]
        m._buffers[name] = t


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
    if str(device).startswith("cuda") and os.environ.get(CUDA_OPT_IN) != "1":
        return b"", [], [CUDA_OFF_NOTE]
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
            try:
                blob, fields = build_one(g, module, example, device=device)
            except Exception as e:  # export, AOTInductor or the proof: dynamo's part remains
                first = (str(e).strip().splitlines() or [""])[0][:200]
                notes.append(f"{name}: no AOTInductor package ({type(e).__name__}: {first})")
                continue
            entries.append({"group": g.identity, "signature": signature_text(sig),
                            "modes": example.mode_record(), "offset": offset + len(data),
                            "bytes": len(blob), KIND_FIELD: AOTI_KIND, SOURCES_FIELD: spans,
                            **fields})
            data += blob
    return bytes(data), entries, notes
