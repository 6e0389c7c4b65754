"""Real architectures from their own packages, on one GPU: eager vs whole-model compile vs surgery.

Models are built from their packages' configs with random weights (nothing is downloaded):

  timm_vit    timm ``vit_base_patch16_224``, batch 8, 224x224
  hf_bert     transformers ``BertModel`` (base config), batch 8, 128 tokens
  gpt2_decode transformers ``GPT2LMHeadModel`` (base config): a 128-token prefill, then one
              token a step with the KV cache growing (the timed unit is one decode step)
  dit         diffusers ``DiTTransformer2DModel`` (DiT-XL/2 widths, 12 layers), 256 px latents
  flux        diffusers ``FluxTransformer2DModel`` (Flux widths, 4 + 8 layers), 512 px, 512
              text tokens
  sd3         diffusers ``SD3Transformer2DModel`` (SD3-medium widths, 8 layers), 512 px

Arms, each in a fresh process with an empty compile cache (all in one call with ``--all``):

  eager    the model as it is
  whole    ``torch.compile(model)``, inductor defaults
  surgery  ``surgery plan`` of the live model with its defaults, then ``apply_manifest`` under
           ``torch.inference_mode()`` with a warm-up of 3 calls (region capture: surgery
           replays one CUDA graph per region path and signature)
  evidence the plan from evidence (``surgery plan --model --input``): the model runs the
           driver's step 6 times watched (3 of them timed), regions are the subtrees that kept
           one signature; then ``apply_manifest`` as for ``surgery``. Also reports the plan's
           coverage of the eager step and the names-only plan's coverage of the same step.

Every arm runs under ``torch.inference_mode()`` in bf16 (``ZOO_DTYPE=float32`` for fp32). For
each arm: cold start (compile + warm-up, s), median and p90 latency per call (CUDA events,
synchronised per call), peak GPU memory, state-dict keys changed, the largest relative output
difference from eager, and for surgery what was compiled, demoted (and why) and replayed.

    python benchmarks/gpu_zoo.py --all --out zoo.json            # every model and arm
    python benchmarks/gpu_zoo.py --model flux --arm surgery       # one arm, this process
    ZOO_SIZE=tiny python benchmarks/gpu_zoo.py --all              # a quick check (CPU too)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _arms import (  # noqa: E402
    against_reference,
    latency,
    paths_per_kind,
    plan_from_evidence,
    print_arm_result,
    run_grid,
    time_call,
)

MODELS = ("timm_vit", "hf_bert", "gpt2_decode", "dit", "flux", "sd3")
ARMS = ("eager", "whole", "surgery", "evidence")
TINY = os.environ.get("ZOO_SIZE") == "tiny"


def _dtype() -> Any:
    import torch

    return getattr(torch, os.environ.get("ZOO_DTYPE", "bfloat16"))


# --- model factories: `surgery plan --model gpu_zoo:<name>` plans these ---------------------

def timm_vit() -> Any:
    import timm

    if TINY:
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                                 patch_size=8, depth=2)
    return timm.create_model("vit_base_patch16_224", pretrained=False)


def hf_bert() -> Any:
    from transformers import BertConfig, BertModel

    cfg = (BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128) if TINY else BertConfig())
    return BertModel(cfg)


def gpt2_decode() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4) if TINY else GPT2Config()
    return GPT2LMHeadModel(cfg)


def dit() -> Any:
    from diffusers import DiTTransformer2DModel

    if TINY:
        return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                     num_layers=2, sample_size=8, patch_size=2)
    return DiTTransformer2DModel(num_attention_heads=16, attention_head_dim=72, in_channels=4,
                                 num_layers=12, sample_size=32, patch_size=2)


def flux() -> Any:
    from diffusers import FluxTransformer2DModel

    if TINY:
        return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1,
                                      num_single_layers=2, attention_head_dim=16,
                                      num_attention_heads=2, joint_attention_dim=32,
                                      pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    return FluxTransformer2DModel(num_layers=4, num_single_layers=8)


def sd3() -> Any:
    from diffusers import SD3Transformer2DModel

    if TINY:
        return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                     attention_head_dim=16, num_attention_heads=2,
                                     joint_attention_dim=32, caption_projection_dim=32,
                                     pooled_projection_dim=32, out_channels=4,
                                     pos_embed_max_size=16)
    return SD3Transformer2DModel(sample_size=64, patch_size=2, in_channels=16, num_layers=8,
                                 attention_head_dim=64, num_attention_heads=24,
                                 joint_attention_dim=4096, caption_projection_dim=1536,
                                 pooled_projection_dim=2048, out_channels=16,
                                 pos_embed_max_size=96)


# --- inputs: a driver per model that returns `step(call) -> tensor`, same for every arm -------

def _first_tensor(y: Any) -> Any:
    while isinstance(y, (tuple, list)):
        y = y[0]
    return y


def driver(name: str, model: Any, device: str) -> tuple[Callable[[Any], Any], Callable[[], None]]:
    """``(step, reset)``: ``step(call)`` runs one timed unit through ``call``; ``reset()`` puts
    any state (a decode's KV cache) back where every arm starts."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    dt = _dtype()

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    b = 1 if TINY else 8
    if name == "timm_vit":
        x = randn(b, 3, 32, 32) if TINY else randn(b, 3, 224, 224)
        return (lambda call: call(x)), (lambda: None)
    if name == "hf_bert":
        ids = torch.randint(0, 1000, (b, 16 if TINY else 128), generator=g).to(device)
        return (lambda call: call(input_ids=ids).last_hidden_state), (lambda: None)
    if name == "gpt2_decode":
        from transformers import DynamicCache

        prompt = torch.randint(0, 1000, (1, 16 if TINY else 128), generator=g).to(device)
        state: dict[str, Any] = {}

        def reset() -> None:
            cache = DynamicCache()
            with torch.inference_mode():
                out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
            state.update(cache=out.past_key_values, tok=out.logits[:, -1:].argmax(-1))

        def step(call: Any) -> Any:
            out = call(input_ids=state["tok"], past_key_values=state["cache"], use_cache=True)
            state.update(cache=out.past_key_values, tok=out.logits[:, -1:].argmax(-1))
            return out.logits

        return step, reset
    if name == "dit":
        n = 8 if TINY else 32
        lat, t = randn(b, 4, n, n), torch.full((b,), 500, device=device)
        cls = torch.randint(0, 1000, (b,), generator=g).to(device)
        return (lambda call: call(lat, timestep=t, class_labels=cls, return_dict=False)[0],
                lambda: None)
    if name == "flux":
        img, txt = (64, 8) if TINY else (1024, 512)
        cin, jd, pd = (16, 32, 32) if TINY else (64, 4096, 768)
        kw = dict(hidden_states=randn(1, img, cin), encoder_hidden_states=randn(1, txt, jd),
                  pooled_projections=randn(1, pd), timestep=torch.full((1,), 0.5, device=device,
                                                                     dtype=dt),
                  img_ids=torch.zeros(img, 3, device=device), txt_ids=torch.zeros(txt, 3,
                                                                                 device=device),
                  return_dict=False)
        return (lambda call: call(**kw)[0]), (lambda: None)
    if name == "sd3":
        n, cin, jd, pd, txt = (8, 4, 32, 32, 8) if TINY else (64, 16, 4096, 2048, 154)
        kw = dict(hidden_states=randn(1, cin, n, n), encoder_hidden_states=randn(1, txt, jd),
                  pooled_projections=randn(1, pd), timestep=torch.full((1,), 500, device=device),
                  return_dict=False)
        return (lambda call: call(**kw)[0]), (lambda: None)
    raise SystemExit(f"unknown model {name!r}; use one of {MODELS}")


def run_arm(name: str, arm: str, n_calls: int) -> dict[str, Any]:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, Any] = {"model": name, "arm": arm}
    manifest = None
    if arm == "surgery":
        from surgery.planning.plan import plan_model

        t = time.perf_counter()
        res = plan_model(f"gpu_zoo:{name}")
        manifest = res.manifest
        out["plan_s"] = round(time.perf_counter() - t, 2)
        out["planned"] = paths_per_kind(manifest)
    torch.manual_seed(0)
    model = globals()[name]().to(device=dev, dtype=_dtype()).eval()
    step, reset = driver(name, model, dev)
    keys_before = set(model.state_dict())
    if arm == "evidence":
        t = time.perf_counter()
        reset()
        with torch.inference_mode():
            manifest = plan_from_evidence(model, step, source=f"gpu_zoo:{name}", out=out)
        out["plan_s"] = round(time.perf_counter() - t, 2)
    reset()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    call: Any = model
    handle = None
    overrides = None if cuda else {"on_cpu": "compile", "backend": "aot_eager"}
    t0 = time.perf_counter()
    with torch.inference_mode():
        if arm == "whole":
            call = torch.compile(model)
            for _ in range(2):
                step(call)
        elif arm in ("surgery", "evidence"):
            from surgery import apply_manifest

            handle = apply_manifest(model, manifest, warmup=lambda m: step(m), passes=3,
                                    overrides=overrides)
        sync()
        cold = time.perf_counter() - t0
        reset()
        times: list[float] = []
        outputs: list[Any] = []
        for _ in range(n_calls):
            y, ms, _ = time_call(functools.partial(step, call), cuda=cuda)
            times.append(ms)
            outputs.append(_first_tensor(y).float().cpu())
    keys_after = set(model.state_dict())
    out.update(cold_s=round(cold, 2), **latency(times[len(times) // 5:]),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else 0.0,
               changed_keys=len(keys_before ^ keys_after),
               gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    if handle is not None:
        recs = list(handle.report)
        out["report"] = handle.report.counts()
        out["graph_replays"] = sum(getattr(r, "graph_replays", 0) for r in recs)
        out["eager_reasons"] = sorted({f"{r.kind}: {r.reason}" for r in recs
                                       if r.status != "compiled" and r.reason})[:6]
    diff = against_reference(outputs, ref_path=os.environ.get("ZOO_REF"),
                             is_reference=arm == "eager")
    if diff is not None:
        out["max_rel_diff"] = diff
    if handle is not None:
        handle.restore()
    return out


def run_all(models: list[str], arms: list[str], n_calls: int, timeout: int) -> list[dict]:
    return run_grid(__file__, "gpu_zoo", "ZOO_REF", models, arms, n_calls, timeout)


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| model | arm | cold start (s) | median (ms) | p90 (ms) | peak (GiB) | changed keys "
            "| max rel diff | regions |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['model']} | {r['arm']} | failed: {r['error'][:160]} |||||||")
            continue
        diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else "(reference)"
        regions = json.dumps(r.get("report", "")) if "report" in r else ""
        rows.append(f"| {r['model']} | {r['arm']} | {r['cold_s']:.1f} | {r['median_ms']:.2f} | "
                    f"{r['p90_ms']:.2f} | {r['peak_gib']:.2f} | {r['changed_keys']} | {diff} | "
                    f"{regions} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS)
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--all", action="store_true", help="every model and arm, fresh processes")
    ap.add_argument("--models", help="comma-separated subset for --all")
    ap.add_argument("--arms", help="comma-separated subset for --all")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=240, help="per arm, seconds")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.all:
        models = args.models.split(",") if args.models else list(MODELS)
        arms = args.arms.split(",") if args.arms else list(ARMS)
        results = run_all(models, arms, args.calls, args.timeout)
        print(table(results))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return
    if not (args.model and args.arm):
        ap.error("give --all, or --model and --arm")
    print_arm_result(lambda: run_arm(args.model, args.arm, args.calls),
                     {"model": args.model, "arm": args.arm})


if __name__ == "__main__":
    main()
