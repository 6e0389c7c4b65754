"""GPT-2 decoding through generate() with its piecewise stack applied as on CUDA, on the CPU.

What cpu_stack_breakdown.py and cpu_stack_replay_host.py share: a random-weight GPT-2 of the
given depth and width, planned piecewise, applied with apply's CUDA path stood in (region capture
on, bench_replay_overhead's ``NullCapturer``, whose replay is free), so a replay costs only
surgery's host work. Returns the eager model, the applied copy, its handle, and ``generate``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

from bench_replay_overhead import NullCapturer


def gpt2_stack_on_stand_in(*, layers: int, width: int, tokens: int, backend: str, source: str
                           ) -> tuple[Any, Any, Any, Callable[..., Any]]:
    import torch
    import transformers

    from surgery import apply_manifest
    from surgery.planning.plan import plan_module
    from surgery.runtime import apply as apply_mod

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=100,
                                  n_positions=256, bos_token_id=None, eos_token_id=None)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))

    def generate(m: Any, n: int = tokens) -> Any:
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    model = copy.deepcopy(base)
    manifest = plan_module(model, source=source, piecewise=True).manifest
    capturer = NullCapturer()
    apply_mod._on_cuda = lambda module, model: True  # type: ignore[assignment]
    apply_mod._capturer_for = lambda module: capturer  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply_manifest(model, manifest, warmup=lambda m: generate(m, 4), passes=2,
                                overrides={"backend": backend})
    return base, model, handle, generate
