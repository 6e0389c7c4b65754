"""What a light region saves in cold start and costs in speed (surgery.planning.compile_cost).

The evidence plan of diffusers' Flux has three regions the names-only plan does not:
``time_text_embed``, ``pos_embed`` and ``norm_out``. Each is a new compile group. The light rule
compiles such a group with aot_eager (a trace, no kernel build) instead of inductor. This script
measures both backends on each module, each in a fresh process with an empty inductor/Triton
cache: the first call (dynamo + backend compile, seconds), then the steady call (ms a call,
median of 50). The steady figure is torch.compile's own: here nothing is captured, while under
region capture both backends replay one CUDA graph of the module, which removes the launches
that dominate these small modules.

    python benchmarks/bench_light_compile.py                 # Flux 4 + 8 layers, bf16, GPU
    python benchmarks/bench_light_compile.py --tiny          # the CPU smoke size (fp32)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _arms import child_result, fresh_cache_env, print_arm_result, time_call  # noqa: E402

MODULES = ("time_text_embed", "pos_embed", "norm_out")
BACKENDS = ("inductor", "aot_eager")


def run_one(path: str, backend: str, tiny: bool) -> dict[str, Any]:
    import torch

    if tiny:
        os.environ["ZOO_SIZE"] = "tiny"
        os.environ.setdefault("ZOO_DTYPE", "float32")
    from gpu_zoo import driver, flux

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    torch.manual_seed(0)
    model = flux().to(device=dev, dtype=getattr(torch, os.environ.get("ZOO_DTYPE",
                                                                       "bfloat16"))).eval()
    step, _ = driver("flux", model, dev)
    mod = model.get_submodule(path)
    seen: dict[str, Any] = {}

    def grab(m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.setdefault("call", (args, kwargs))

    h = mod.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.inference_mode():
        step(model)
    h.remove()
    args, kwargs = seen["call"]
    compiled = torch.compile(mod.forward, backend=backend, fullgraph=True)
    with torch.inference_mode():
        _, first_ms, _ = time_call(lambda: compiled(*args, **kwargs), cuda=cuda)
        steady = [time_call(lambda: compiled(*args, **kwargs), cuda=cuda)[1] for _ in range(50)]
        eager = [time_call(lambda: mod(*args, **kwargs), cuda=cuda)[1] for _ in range(50)]
    return {"module": path, "backend": backend, "first_call_s": round(first_ms / 1e3, 2),
            "steady_ms": round(statistics.median(steady), 4),
            "eager_ms": round(statistics.median(eager), 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else 0.0,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke size")
    ap.add_argument("--one", nargs=2, metavar=("MODULE", "BACKEND"), help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=120, help="per process, seconds")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.one:
        print_arm_result(lambda: run_one(args.one[0], args.one[1], args.tiny),
                         {"module": args.one[0], "backend": args.one[1]})
        return
    rows = []
    for path in MODULES:
        for backend in BACKENDS:
            env = fresh_cache_env(f"light_{path}_{backend}_{time.time_ns()}")
            rows.append(child_result([__file__, "--one", path, backend,
                                      *(["--tiny"] if args.tiny else [])], env=env,
                                     timeout=args.timeout, ident={"module": path,
                                                                  "backend": backend}))
    print("| module | backend | first call s (compile) | steady ms | eager ms | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['module']} | {r['backend']} | failed: {r['error'][:120]} |||")
            continue
        print(f"| {r['module']} | {r['backend']} | {r['first_call_s']:.2f} | "
              f"{r['steady_ms']:.3f} | {r['eager_ms']:.3f} | {r['peak_gib']:.3f} |")
    for backend in BACKENDS:
        total = sum(r.get("first_call_s", 0.0) for r in rows if r["backend"] == backend)
        print(f"- {backend}: {total:.1f} s of first calls for the three modules")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
