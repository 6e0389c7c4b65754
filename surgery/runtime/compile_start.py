"""What a cold start compiles, and when: light pieces, and inductor's compile workers started at
apply instead of at the first compile.

Why. On an H200 (torch 2.11) the GPT-2 decoder stack as one piecewise region
(surgery.runtime.piecewise_stack) took 11.3-15.1 s from ``apply_manifest`` to a warm
``generate()``, against 7.1-8.1 s for the names-only plan: one dynamo trace of the 12 blocks
(3-5 s), three inductor piece compiles (6-7.6 s), the rest warm-up calls and captures. Two of
those costs come from *when* and *what* inductor compiles, not from the pieces themselves:

- **Inductor's workers start late.** Inductor compiles a graph's Triton kernels in a pool of
  worker processes, and starts that pool only when its backend is first called (torch's
  ``inductor`` backend calls ``maybe_warm_pool()``). Each worker imports torch (3-4 s on the
  H200's host), and until a probe job has come back, ``AsyncCompile.use_process_pool()`` is
  False and every kernel compiles in the calling process, one after another. A plain region's
  first compile comes a fraction of a second after its trace; a piecewise stack's comes after
  dynamo traced all its blocks, so the pool's start-up and the trace ran one after the other.
  ``start_compile_pool`` starts it when the warm-up begins, so it warms while dynamo traces.
- **Pieces that run once a step.** The stack splits into a piece before the first attention,
  one between each pair of blocks (the same code with each block's weights: compiled once,
  surgery.runtime.piece_cache) and one after the last. The first and the last are distinct
  code that runs once a step: two of the three inductor compiles, for about 10% of the pieces'
  ops. Under region capture (``capture = "region"``) every piece replays as a CUDA graph, so
  its launches are saved whatever compiled it; inductor would add only the fusion of that
  piece's own kernels. A *light piece* (``light_pieces``: its ops times the pieces of the same
  code in its graph are under ``LIGHT_PIECE_SHARE`` of the graph's piece ops) compiles with
  ``LIGHT_PIECE_BACKEND`` (``aot_eager``: AOTAutograd's trace, no code generation), as the
  planner's light regions do (surgery.planning.compile_cost). Only an inductor plan with
  region capture has light pieces; a plain per-block graph (two pieces of about half each) and
  the SDPA example's blocks have none. On a host-bound decode (GPT-2 at batch 1 on an H200)
  the GPU waits on the host, so the unfused kernels of two graphs a token cost no step time.
- **Pieces too small for fusion to matter** (``LIGHT_PIECE_ELEMENTS``). A piece whose every
  activation (each op's output, and each input that is not a parameter or buffer) holds at most
  2**16 elements is launch-bound: on an H200 an elementwise kernel over 64K fp32 elements moves
  512 KB in about 0.15 us, against 1-2 us for each kernel node of a graph, so fusing its ops
  saves a few microseconds of GPU time a piece, which a host-bound step never sees; its matmuls
  are cuBLAS calls whoever compiles it. So under region capture it compiles light, whatever
  its share. GPT-2's decode at batch 1 (hidden 768, MLP 3072 wide) is that case for all 13 pieces
  of the stack: the stack then builds no inductor code at all, where the middle piece's inductor
  build (about 4 s on the H200, with inductor's one-time set-up) was the larger half of its
  cold start beside dynamo's trace. Larger steps (the SDPA example's 1000-token frames, a
  prefill, a decode at batch 32) keep inductor. The record's ``pieces_light`` counts both kinds,
  and a note says how many were light by size.
- **No early pool for a piecewise region.** Whether its pieces compile with inductor is known
  only after dynamo traced it (their sizes), so a piecewise region does not start the pool at
  apply: a plain inductor region of the same plan does, and otherwise inductor starts it at the
  first piece it builds, as without compile_start. Started for a stack that builds no inductor
  code, its workers (each importing torch) only take the host's cores from the trace.

What it does not do: it changes no guard, trace or split, so outputs, recompiles and the cache
growth are as before (aot_eager runs the same aten ops as eager, so a light piece's values are
eager's). A warm start from a bundle loads its kernels and starts no pool (surgery.runtime.
warm_loader keeps ``compile_threads`` at 1 for loads); torch's own switches
(``TORCH_WARM_POOL=0``, ``compile_threads = 1``) still keep the pool from starting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx

from surgery.formats.manifest import PIECEWISE_KIND

# A piece whose ops (times its copies in the graph) are under this share of the graph's piece
# ops compiles with LIGHT_PIECE_BACKEND under region capture.
LIGHT_PIECE_SHARE = 0.1
# A piece none of whose activations holds more elements than this is launch-bound: it compiles
# with LIGHT_PIECE_BACKEND under region capture, whatever its share (0 turns the rule off).
LIGHT_PIECE_ELEMENTS = 1 << 16
LIGHT_PIECE_BACKEND = "aot_eager"
# Backends whose compiles use inductor's worker pool (Triton kernels on CUDA).
POOL_BACKENDS = frozenset({"inductor"})
POOL_NOTE = ("inductor's compile workers started at apply, before the first trace (they warm "
             "while dynamo traces: surgery.runtime.compile_start)")


def light_pieces(pieces: Sequence[tuple[str | None, int]],
                 largest: Sequence[int | None] | None = None) -> list[bool]:
    """For each piece of one graph, given as (its canonical code or None, its ops that do work):
    whether it is light. Pieces of the same code count together (one compile serves them all);
    a piece without a code (it cannot be shared) counts alone. ``largest``, per piece: the
    elements of its largest activation (None: not known), for the size rule."""
    copies = Counter(code for code, _ in pieces if code is not None)
    weights = [ops * (copies[code] if code is not None else 1) for code, ops in pieces]
    total = sum(ops for _, ops in pieces)  # every piece's ops once: the work of one call
    small = launch_bound(largest) if largest is not None else [False] * len(pieces)
    return [total > 0 and (w < LIGHT_PIECE_SHARE * total or s)
            for w, s in zip(weights, small, strict=True)]


def launch_bound(largest: Sequence[int | None]) -> list[bool]:
    """Per piece: whether its largest activation is at most ``LIGHT_PIECE_ELEMENTS``."""
    return [n is not None and n <= LIGHT_PIECE_ELEMENTS for n in largest]


def size_note(light_by_size: int, pieces: int) -> str:
    return (f"{light_by_size} of {pieces} piece(s) compiled {LIGHT_PIECE_BACKEND} (light): every "
            f"activation at most {LIGHT_PIECE_ELEMENTS} elements, launch-bound, so inductor's "
            "fusion would save no step time under region capture (surgery.runtime.compile_start)")


def light_allowed(backend: str, capture_region: bool) -> bool:
    """Light pieces only replace inductor, and only where surgery replays the pieces as graphs
    (without one, aot_eager's per-op launches would cost the host what inductor saves)."""
    return backend == "inductor" and capture_region


def compile_light(gm: fx.GraphModule, example: list[Any]) -> Callable[..., Any]:
    """Compile a light piece (``LIGHT_PIECE_BACKEND``)."""
    backend: Callable[..., Any] = torch._dynamo.lookup_backend(LIGHT_PIECE_BACKEND)
    return backend(gm, example)


def pool_wanted(backends: Iterable[str | None], device: str, loaded: bool) -> bool:
    """Whether this apply will compile kernels in inductor's worker pool: a region still to
    compile with inductor on CUDA, and no bundle loaded (a warm start only loads kernels; a
    bundle that was refused leaves the pool to start at the first compile, as before)."""
    return device.startswith("cuda") and not loaded and any(b in POOL_BACKENDS for b in backends)


def _warm_pool() -> bool:
    """Start inductor's worker pool without waiting for it; False where torch has no such pool."""
    try:
        from torch._inductor import async_compile  # heavy: what the first compile imports
    except ImportError:
        return False
    warm = getattr(async_compile, "maybe_warm_pool", None)
    if warm is not None:
        warm()  # honours TORCH_WARM_POOL and compile_threads; starts the workers too
        return True
    pool = getattr(async_compile, "AsyncCompile", None)
    if pool is None or not hasattr(pool, "warm_pool"):
        return False
    pool.warm_pool()
    return True


def start_compile_pool(slots: Iterable[Any], device: str, cache: Any) -> list[str]:
    """Before the warm-up: start inductor's workers if a pending region other than a piecewise
    one will compile with inductor on CUDA and no bundle was given (``cache``: the report's
    CacheRecord, or None). Returns the report notes (one, or none)."""
    backends = [s.record.backend for s in slots
                if s.record.status == "pending" and s.record.kind != PIECEWISE_KIND]
    if not pool_wanted(backends, device, cache is not None):
        return []
    return [POOL_NOTE] if _warm_pool() else []
