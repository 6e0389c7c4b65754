"""What the plan-time piecewise probe costs (surgery.planning.piecewise_probe), and what it finds.

For each model: plan it from evidence with ``piecewise=True`` (the probe runs inside), then run
the probe again on the written manifest, alone, and time it: seconds, the paths it traced as one
graph / refused / did not enter, and the peak memory beside it (the process's peak RSS on the
CPU; on CUDA the peak allocated during the probe against the peak of one eager step). Models:

- ``sdpa``: the SDPA streaming example (surgery.examples), ``stream_step`` (a list KV cache);
- ``gpt2``: transformers' GPT-2, random weights, ``generate()`` of 8 new tokens (a decoder stack
  over its blocks, surgery.planning.stacks).

    python benchmarks/bench_piecewise_probe.py            # GPU: GPT-2 small, the tiny SDPA build
    python benchmarks/bench_piecewise_probe.py --tiny     # the CPU smoke size
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def build(name: str, tiny: bool, dev: str) -> tuple[Any, Callable[[Any], Any]]:
    import torch

    torch.manual_seed(0)
    if name == "sdpa":
        from surgery.examples import stream_step, tiny_sdpa

        return tiny_sdpa().to(dev).eval(), stream_step
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                  n_positions=64, bos_token_id=0, eos_token_id=1) if tiny else \
        transformers.GPT2Config(bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(cfg).to(dev).eval()
    prompt = torch.randint(2, cfg.vocab_size, (1, 12), device=dev,
                           generator=torch.Generator(dev).manual_seed(0))

    def generate(m: Any) -> Any:
        with torch.no_grad():
            return m.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)

    return model, generate


def measure(name: str, tiny: bool) -> dict[str, Any]:
    import torch

    from surgery.formats.manifest import PIECEWISE_KIND
    from surgery.planning.observed import plan_from_step
    from surgery.planning.piecewise_probe import probe_piecewise

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model, step = build(name, tiny, dev)
    cuda = dev == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        step(model)
        torch.cuda.synchronize()
        eager_peak = torch.cuda.max_memory_allocated()
    t0 = time.perf_counter()
    manifest = plan_from_step(model, step, steps=3, timed_steps=2, piecewise=True)
    plan_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    found = probe_piecewise(manifest, model, step)
    if cuda:
        torch.cuda.synchronize()
    probe_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "model": name, "device": dev, "torch": torch.__version__,
        "piecewise_paths": sum(len(r.paths) for r in manifest.regions
                               if r.kind == PIECEWISE_KIND),
        "plan_s": round(plan_s, 2), "probe_s": round(probe_s, 2),
        "traced": len(found.compiled), "refused": len(found.refused),
        "not_entered": len(found.unreached), "error": found.error,
        "refused_at_plan": [lo.path for lo in manifest.left_out if "at plan time" in lo.reason],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if cuda:
        out["probe_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        out["eager_step_peak_mib"] = round(eager_peak / 2**20, 1)
    if not out["piecewise_paths"]:
        out["warning"] = "NOTHING PLANNED PIECEWISE: the probe had nothing to trace"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke size")
    ap.add_argument("--models", default="sdpa,gpt2")
    args = ap.parse_args()
    for name in args.models.split(","):
        print(json.dumps(measure(name, args.tiny)), flush=True)


if __name__ == "__main__":
    main()
