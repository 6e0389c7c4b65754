"""Kernel identities: what compiled code a cold run ran, recorded in the bundle, checked warm.

Why. A warm start promises the cold start's outputs, which holds only if it runs the cold
start's kernels. On the H200 (torch 2.11) Flux's warm output once differed from its cold output
by one bf16 step while SDPA's and BERT's were identical, and nothing said which kernel, or
whether two cold processes even agree with each other. Three things can differ between two
processes that run "the same" compiled region:

- the generated code: a precompiled artifact (surgery.runtime.precompiled) is compiled at save
  time by ``aot_compile``, apart from the code dynamo compiled for the cold frames. Measured on
  the CPU (torch 2.14): the two output-code modules differ only in their ``# AOT ID:`` header
  line; inductor compiled the same graph to the same kernels;
- a Triton kernel's launch config: inductor's ``CachingAutotuner`` benchmarks its candidate
  configs on its first launch and keeps the fastest, a timing race between near-equal configs
  that two processes can decide differently. For a reduction the config sets the order of the
  sums, so the bits differ. torch records each pick in its autotune cache (``.best_config``
  files, which the bundle's Mega-Cache part carries), and a later process whose kernel finds
  its pick there launches it without benchmarking (torch's ``autotune_cache_state`` "hit");
- a kernel whose one heuristic config uses too many registers: inductor then compiles a
  copy with its reduction block halved (``_dynamic_scale_rblock``) and benchmarks the two on
  the first launch, and that pick is not written to any cache. Measured on the H200 (torch
  2.11, Flux, the ninth session): one kernel source held by the three graphs' objects launched
  R0_BLOCK 64 in one graph and 128 in the others, *in one cold process*; warm processes race
  the same way (one launched 128 everywhere, another 64 where its cold ran 128). One pick per kernel
  hash cannot describe that cold run, so the census keeps every distinct config a hash
  launched (``split``), and a check against a split record is never "the same";
- nothing else inductor chooses by timing in the default mode.

What an identity is. A graph's output-code module loaded by inductor (``PyCodeCache``, one
with the graph's ``call``; a Triton kernel's own source module is not one): the sha256 of its
source without the ``# AOT ID:`` line (on the CPU its C++ kernels are inline in that source).
A Triton kernel: torch's ``kernel_hash`` (the sha256 of its source, which names its file), its
name, the config it launches (``config_text``: after autotuning, its one launcher),
and torch's autotune-cache state when it was made; of two objects of one kernel (its own module
and the graph's may each hold one), the one that launched.

The record (KERNELS_FIELD in the bundle's precompiled record, KERNELS_FORMAT): made by
``kernel_record()`` when a bundle is saved, *before* the precompiled part compiles anything, so
it lists what the cold frames ran: ``code``, the sorted identities; ``triton``, kernel hash ->
[name, config text] for every kernel that launched one config. At most MAX_KERNELS of each.

What the warm start does with it. ``KernelRecord.pin()`` runs as each group takes its
artifacts: a Triton kernel of this process whose hash the record lists, and which still has
several candidates (its pick was not found in the autotune cache), keeps only the candidate
whose config text equals the recorded one, so it launches the cold pick and never benchmarks.
A kernel with one config already is left alone (a different one is reported, not replaced).
``check_kernels(handle)`` compares this process's census with the record, at any time after
frames ran: code or kernels the cold run did not have, configs that differ, kernels not yet
tuned. ``same`` is True only when a record exists and nothing differs.

Trust. The record is inside the signed metadata, read only once the bundle verified with the
deployer's key and fits (surgery.runtime.cache), and checked for shape and bounds first; a
malformed one ignores the bundle with its one warning. Its values are only compared as text:
a pin selects among the kernel's own candidates and never builds a config from the file, so a
record can at most keep a kernel from tuning. Cost of a hostile record: linear in its size,
which the metadata's own bound limits.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from surgery.runtime.bundle_parts import PRECOMPILED_KEY

KERNELS_FIELD = "kernels"  # in the bundle's precompiled record
KERNELS_FORMAT = 1
MAX_KERNELS = 4096  # of each of ``code`` and ``triton``
_MAX_TEXT = 512  # a name or a config text
_MAX_SPLIT = 16  # configs kept for one kernel hash that launched several
_AOT_ID = "# AOT ID:"  # the only line two compiles of one graph differ in (see above)
_CONFIG_LISTS = ("configs", "compile_results", "launchers")  # a CachingAutotuner's candidates


class KernelRecordError(ValueError):
    """A kernel record that is not the shape surgery writes."""


def code_identity(source: str) -> str:
    """An output-code module's identity: sha256 of its source, the ``# AOT ID:`` line left out."""
    kept = [ln for ln in source.splitlines() if not ln.startswith(_AOT_ID)]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


def config_text(config: Any) -> str:
    """A Triton config as canonical text: its kwargs and launch fields, sorted."""
    fields = {k: getattr(config, k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
              if getattr(config, k, None) is not None}
    kwargs = dict(sorted((str(k), v) for k, v in (getattr(config, "kwargs", {}) or {}).items()))
    return json.dumps({"kwargs": kwargs, **fields}, sort_keys=True, default=str)


def _is_autotuner(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("configs", "launchers", "fn")) and \
        hasattr(obj, "kernel_hash")


def _picked(kernel: Any) -> str | None:
    """The config a kernel launches (its one launcher, or its one candidate), else None."""
    launchers = getattr(kernel, "launchers", None) or []
    if len(launchers) == 1:
        return config_text(launchers[0].config)
    configs = getattr(kernel, "configs", None) or []
    return config_text(configs[0]) if len(configs) == 1 and not launchers else None


def _modules() -> list[Any]:
    """inductor's loaded output-code modules, each once. Where inductor's code cache was never
    imported no output code is loaded, and importing it would cost a runner-only start the
    imports it exists to avoid (inductor's loader and Triton)."""
    codecache = sys.modules.get("torch._inductor.codecache")
    PyCodeCache = getattr(codecache, "PyCodeCache", None)
    if PyCodeCache is None:
        return []
    seen: dict[int, Any] = {}
    for mod in [*getattr(PyCodeCache, "modules", []),
                *getattr(PyCodeCache, "modules_no_attr", {}).values()]:
        seen.setdefault(id(mod), mod)
    return list(seen.values())


def _autotuners(mods: list[Any]) -> Iterator[tuple[str, Any]]:
    for mod in mods:
        for name, obj in list(vars(mod).items()):
            if _is_autotuner(obj):
                yield name, obj


_IDENTITIES: dict[str, str] = {}  # output-code path -> identity (a path's source never changes)


def _identity_of(mod: Any) -> str | None:
    path = getattr(mod, "__file__", None)
    if not path:
        return None
    if path not in _IDENTITIES:
        try:
            with open(path, encoding="utf-8") as f:
                _IDENTITIES[path] = code_identity(f.read())
        except OSError:  # removed since it loaded: not identifiable
            return None
    return _IDENTITIES[path]


@dataclass
class Census:
    """This process's compiled code: output-code identities -> module key; Triton kernel hash
    -> (name, config text or None while untuned, torch's autotune-cache state)."""

    code: dict[str, str] = field(default_factory=dict)
    triton: dict[str, tuple[str, str | None, str]] = field(default_factory=dict)
    # kernel hash -> the distinct configs its objects launched, where more than one did (one
    # kernel source launched with two configs in two graphs of this process: module doc)
    split: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        triton = sorted(self.triton.items())
        return {"code": sorted(self.code),
                "triton": {h: {"name": n, "config": c, "cache": s} for h, (n, c, s) in triton},
                "split": dict(sorted(self.split.items()))}


def census() -> Census:
    """What inductor has loaded in this process (see the module doc)."""
    out = Census()
    mods = _modules()
    for mod in mods:  # a graph's wrapper (its ``call``); a Triton kernel's own module is not
        if callable(getattr(mod, "call", None)) and (ident := _identity_of(mod)) is not None:
            out.code[ident] = str(getattr(mod, "key", ""))
    launched: dict[str, set[str]] = {}
    for name, k in _autotuners(mods):
        info = getattr(k, "autotune_cache_info", None) or {}
        h, picked = str(k.kernel_hash or name), _picked(k)
        if picked is not None or h not in out.triton:  # one object of a kernel that launched
            out.triton[h] = (name, picked, str(info.get("autotune_cache_state", "")))
        if picked is not None:
            launched.setdefault(h, set()).add(picked)
    out.split = {h: sorted(c)[:_MAX_SPLIT] for h, c in launched.items() if len(c) > 1}
    return out


def kernel_record() -> dict[str, Any]:
    """The record a bundle keeps of what ran in this process (KERNELS_FIELD)."""
    now = census()
    tuned = {h: [n[:_MAX_TEXT], c] for h, (n, c, _) in now.triton.items() if c is not None}
    out = {"format": KERNELS_FORMAT, "code": sorted(now.code)[:MAX_KERNELS],
           "triton": dict(sorted(tuned.items())[:MAX_KERNELS])}
    if now.split:  # optional: a record without it (the eighth session's) reads as before
        out["split"] = dict(sorted(now.split.items())[:MAX_KERNELS])
    return out


@dataclass
class KernelRecord:
    """A bundle's record, parsed; what the pins did in this process."""

    code: frozenset[str]
    triton: dict[str, tuple[str, str]]
    split: dict[str, list[str]] = field(default_factory=dict)  # hash -> configs the cold launched
    pinned: dict[str, str] = field(default_factory=dict)  # kernel hash -> name
    not_pinned: dict[str, str] = field(default_factory=dict)  # kernel hash -> why

    def pin(self) -> int:
        """Make this process's listed kernels launch the recorded configs (module doc); the
        number pinned by this call."""
        n = 0
        for name, k in _autotuners(_modules()):
            h = str(k.kernel_hash or name)
            if h not in self.triton or h in self.pinned or max(
                    len(getattr(k, a, None) or []) for a in _CONFIG_LISTS) <= 1:
                continue  # not listed, done, or one candidate: nothing to choose
            if h in self.split:  # which graph ran which config is not recorded
                self.not_pinned[h] = (f"{name}: the cold run launched {len(self.split[h])} "
                                      "configs of it")
                continue
            want = self.triton[h][1]
            kept: dict[str, list[Any]] = {}
            for attr in _CONFIG_LISTS:
                items = list(getattr(k, attr, None) or [])
                keep = [x for x in items if config_text(getattr(x, "config", x)) == want]
                if items and len(keep) != 1:
                    self.not_pinned[h] = f"{name}: the recorded config is not one of its {attr}"
                    break
                kept[attr] = keep
            else:
                for attr, keep in kept.items():
                    if keep:
                        setattr(k, attr, keep)
                self.pinned[h] = name
                self.not_pinned.pop(h, None)
                n += 1
        return n


def pin_kernels(record: KernelRecord | None) -> int:
    """``record.pin()``; nothing without a record (a bundle written before records). Never
    raises: a torch whose kernels have another shape leaves them unpinned, and says so."""
    if record is None:
        return 0
    try:
        return record.pin()
    except Exception as e:  # torch's internals: a pin must never stop a deployment
        record.not_pinned["*"] = f"pinning failed ({type(e).__name__}: {str(e)[:120]})"
        return 0


def _text(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= _MAX_TEXT:
        raise KernelRecordError(f"the kernel record's {what} is not a short text")
    return v


def parse_record(meta: Mapping[str, Any]) -> KernelRecord | None:
    """The bundle's kernel record, checked (KernelRecordError); None in a bundle without one."""
    pre = meta.get(PRECOMPILED_KEY)
    raw = pre.get(KERNELS_FIELD) if isinstance(pre, dict) else None
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("format") != KERNELS_FORMAT or \
            type(raw.get("format")) is not int:
        raise KernelRecordError(f"the kernel record is not format {KERNELS_FORMAT}")
    code, triton = raw.get("code"), raw.get("triton")
    if not isinstance(code, list) or not isinstance(triton, dict) or \
            len(code) > MAX_KERNELS or len(triton) > MAX_KERNELS:
        raise KernelRecordError(f"the kernel record's lists are not lists of at most "
                                f"{MAX_KERNELS}")
    kernels = {}
    for h, v in triton.items():
        if not isinstance(v, list) or len(v) != 2:
            raise KernelRecordError("a kernel record's Triton entry is not [name, config]")
        kernels[_text(h, "kernel hash")] = (_text(v[0], "kernel name"), _text(v[1], "config"))
    split_raw = raw.get("split", {})
    if not isinstance(split_raw, dict) or len(split_raw) > MAX_KERNELS:
        raise KernelRecordError(f"the kernel record's split is not a map of at most "
                                f"{MAX_KERNELS}")
    split: dict[str, list[str]] = {}
    for h, v in split_raw.items():
        if not isinstance(v, list) or not 1 < len(v) <= _MAX_SPLIT:
            raise KernelRecordError(f"a kernel record's split entry is not 2 to {_MAX_SPLIT} "
                                    "configs")
        split[_text(h, "kernel hash")] = [_text(c, "config") for c in v]
    return KernelRecord(frozenset(_text(c, "code identity") for c in code), kernels, split)


@dataclass
class KernelCheck:
    """This process's compiled code against the cold run's record (``check_kernels``)."""

    recorded: bool  # whether the bundle had a record to check against
    new_code: list[str] = field(default_factory=list)  # identities the cold run did not run
    cold_code: int = 0  # identities in the record
    new_kernels: list[str] = field(default_factory=list)  # Triton kernel names not in it
    configs_differ: list[tuple[str, str, str]] = field(default_factory=list)  # name, cold, now
    untuned: list[str] = field(default_factory=list)  # kernels that have not launched yet
    # kernels that launched more than one config in one process (module doc): in the cold
    # run's record, or in this process
    cold_split: list[str] = field(default_factory=list)
    split_now: list[str] = field(default_factory=list)
    pinned: int = 0
    not_pinned: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        # a kernel not launched yet changed no output: listed, not counted against
        return self.recorded and not (self.new_code or self.new_kernels or self.configs_differ
                                      or self.cold_split or self.split_now)

    def line(self) -> str:
        if not self.recorded:
            return "kernels: NOT CHECKED (the bundle has no kernel record, or none was loaded)"
        head = "kernels: the cold run's" if self.same else "kernels: DIFFER from the cold run's"
        return (f"{head} ({self.cold_code} output-code module(s) recorded; new code "
                f"{len(self.new_code)}, new Triton kernels {len(self.new_kernels)}, configs "
                f"differing {len(self.configs_differ)}"
                + (f" e.g. {self.configs_differ[0]}" if self.configs_differ else "")
                + (f", launched with several configs in the cold run {len(self.cold_split)} "
                   f"(e.g. {self.cold_split[0]})" if self.cold_split else "")
                + (f", launched with several configs here {len(self.split_now)}"
                   if self.split_now else "")
                + f", untuned {len(self.untuned)}; pinned {self.pinned}"
                + (f", not pinned: {self.not_pinned[0]}" if self.not_pinned else "") + ")")

    def as_dict(self) -> dict[str, Any]:
        return {"same": self.same, "recorded": self.recorded, "new_code": self.new_code,
                "cold_code": self.cold_code, "new_kernels": self.new_kernels,
                "configs_differ": self.configs_differ, "untuned": self.untuned,
                "cold_split": self.cold_split, "split_now": self.split_now,
                "pinned": self.pinned, "not_pinned": self.not_pinned}


def check_against(record: KernelRecord | None, now: Census) -> KernelCheck:
    if record is None:
        return KernelCheck(False)
    out = KernelCheck(True, new_code=sorted(set(now.code) - record.code),
                      cold_code=len(record.code), pinned=len(record.pinned),
                      not_pinned=sorted(record.not_pinned.values()))
    out.cold_split = sorted(record.triton.get(h, (h,))[0] for h in record.split)
    out.split_now = sorted(now.triton[h][0] for h in now.split if h in now.triton)
    for h, (name, picked, _) in sorted(now.triton.items()):
        cold = record.triton.get(h)
        if cold is None:
            out.new_kernels.append(name)
        elif picked is None:
            out.untuned.append(name)
        elif picked != cold[1]:
            out.configs_differ.append((name, cold[1], picked))
    return out


def check_kernels(handle: Any) -> KernelCheck:
    """This process's kernels against the record of the bundle ``handle`` (an ApplyHandle of
    ``apply_manifest(..., cache=...)``) loaded; call it after frames ran."""
    loaded = getattr(handle, "precompiled", None)
    return check_against(getattr(loaded, "kernels", None), census())
