"""A steady replay plan: one captured signature of a region path, replayed with its checks folded
into a few C-level calls (surgery.runtime.graphs.replay has the contract; this keeps it).

Why. On a host-bound decode (GPT-2 small at batch 1 on an H200) each of a token's ~14 static
pieces replays through ``RegionGraphs.__call__``: the signature built as a tuple (per tensor its
shape, strides and dtype, ~3.5 us for two tensors on a 2-core CPU), hashed and looked up, then
``_replay``'s checks, three more Python frames. In a steady decode every piece replays the same
signature from the same captured graph, call after call. A plan remembers that graph and checks
the same facts directly:

- **Still the graph.** ``RegionGraphs.epoch`` moves whenever a signature's graphs are captured
  or forgotten (a drop, a moved input, a ring reset, a demotion); a plan of another epoch is
  stale and never used. ``disabled`` and grad mode are read on each call, as there.
- **The signature.** The module's ``training`` flag, inference mode and the device's autocast
  state, compared with the captured signature's; then every tensor's metadata in ONE call of
  dynamo's own TENSOR_MATCH check (``TensorGuards``: exact type, dispatch keys, dtype, device,
  sizes, strides, requires_grad), built from the call the plan was made on. It is stricter
  than the tuple (it also refuses a Parameter or a tensor that requires grad), never looser.
- **Everything else as ``_replay`` does it**: the module's watched tensors when there are any,
  the addresses of inputs read in place, a free output set by the held check (none free: the
  call takes the full path, which grows the ring or clones), inputs copied in when their
  address differs, the graph replayed, written inputs copied back, outputs handed out (clones
  when the path clones).

Any check that fails returns None, and the caller takes the full path (``RegionGraphs.__call__``)
for that call, which decides as before.

**Inputs read in place, decided again.** Whether an input is another region's output (read in
place, no copy a replay) is decided at capture. A static piece that captures on its first call
(its code ran already in another piece) can capture while the piece before it has not captured
yet, and then copies that input every replay although it now comes from an owned output set.
When a plan is made, a copied input that now lives in another region's owned set (and that the
region does not write) makes the path forget that signature once (``readopt``): its next call
captures again and reads the input in place. Once per signature, so a path never loops.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from surgery.runtime.graphs import outputs
from surgery.runtime.graphs.outputs import plain_signature
from surgery.runtime.graphs.replay import RegionGraphs

# dynamo's TENSOR_MATCH check for many tensors in one call (every torch we support has it)
TensorGuards: Any = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None),
                            "TensorGuards", None)
# Plans made per region path and signature before it stops making them (signatures that take
# turns would otherwise make one every call)
MAX_PLANS = 4
_DATA_PTR = torch.Tensor.data_ptr
_DETACH = torch.Tensor.detach
_GT = operator.gt


class SteadyReplay:
    """One captured signature of a RegionGraphs, replayed with its checks in a few C calls."""

    __slots__ = ("adopted", "cap", "check", "copied", "epoch", "graphs", "kind", "n", "ptrs",
                 "state")

    def __init__(self, graphs: RegionGraphs, sig: tuple[Any, ...], cap: Any,
                 tensors: list[torch.Tensor]) -> None:
        assert TensorGuards is not None
        self.graphs = graphs
        self.cap = cap
        self.epoch = graphs.epoch
        self.kind = "cuda" if graphs.capturer.device >= 0 else "cpu"
        self.n = len(tensors)
        self.state = sig[:3]  # training, inference mode, autocast (outputs.call_signature)
        self.check = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                  dynamic_dims_strides=[list(t.stride()) for t in tensors])
        self.adopted = operator.itemgetter(*[i for i, _ in cap.adopted]) if cap.adopted else None
        self.ptrs = [p for _, p in cap.adopted]
        self.copied = [(cap.inputs[i], i) for i in cap.copied]

    def __call__(self, args: tuple[Any, ...]) -> Any:
        """The replayed outputs, as the full path would return them; None: take the full path."""
        graphs, cap = self.graphs, self.cap
        kind = self.kind
        if graphs.epoch != self.epoch or graphs.disabled or len(args) != self.n or \
                torch.is_grad_enabled() or \
                (graphs.module.training, torch.is_inference_mode_enabled(),
                 torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind)) != \
                self.state or not self.check.check(*args):
            return None
        watch = graphs.watch
        if watch is not None and watch.tracked and not watch.unchanged():
            return None  # the full path drops the graphs and counts the move
        if self.adopted is not None:
            got = self.adopted(args)
            if list(map(_DATA_PTR, got if len(self.ptrs) > 1 else (got,))) != self.ptrs:
                return None
        count = outputs._use_count
        assert count is not None  # nothing is captured without it
        outs = None
        for o in cap.sets:
            s = o.set
            if not any(map(_GT, map(count, s._cdata), s.baseline)):
                outs = o
                break
        if outs is None:
            return None  # every set is held: the full path grows the ring or clones
        for buf, i in self.copied:
            t = args[i]
            if buf.data_ptr() != t.data_ptr():
                buf.copy_(t)
        outs.graph.replay()
        graphs.replays += 1
        for i in cap.written:
            args[i].copy_(cap.inputs[i])
        s = outs.set
        return cap.rebuild([o.clone() for o in s.tensors] if graphs.clone
                           else list(map(_DETACH, s.tensors)))


def steady_plan(graphs: RegionGraphs, args: tuple[Any, ...]) -> SteadyReplay | None:
    """A plan for the signature ``args`` (plain tensors, no kwargs) replayed just now, or None:
    no captured graph of it, a tracked module, no TensorGuards, or MAX_PLANS made already. Also
    forgets the signature once if a copied input could now be read in place (``readopt``)."""
    if TensorGuards is None or graphs.disabled or graphs.plans >= MAX_PLANS:
        return None
    found = plain_signature(graphs.module.training, graphs.capturer.device, args)
    if found is None:
        return None
    sig, tensors = found
    cap = graphs.graphs.get(sig)
    if cap is None or not cap.sets:
        return None
    if readopt(graphs, sig, cap, tensors):
        return None
    graphs.plans += 1
    return SteadyReplay(graphs, sig, cap, tensors)


def readopt(graphs: RegionGraphs, sig: tuple[Any, ...], cap: Any,
            tensors: list[torch.Tensor]) -> bool:
    """Forget ``sig`` (once) when an input it copies now lives in another region's owned output
    set and it does not write that input: its next call captures reading it in place."""
    if not graphs.adopt or sig in graphs.readopted:
        return False
    owned = graphs.capturer.owned
    if not any(i not in cap.written and owned.get(tensors[i].untyped_storage().data_ptr())
               is not None for i in cap.copied):
        return False
    graphs.readopted.add(sig)
    graphs.forget(sig)
    return True
