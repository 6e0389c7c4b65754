"""`verify` and `export`: prove a checkpoint is prefix-free, and write one that is.

Library code: it returns reports and raises SurgeryErrors; it never prints. Progress goes
through an optional ``progress(done_bytes, total_bytes)`` callback, which the CLI turns into a
progress bar. Verifying a safetensors file reads its header only and never imports torch
(`--deep` on safetensors scans the raw bytes with numpy, still without torch).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from surgery.errors import (
    CheckpointError,
)
from surgery.formats.binding import bind
from surgery.formats.checkpoint import read_checkpoint
from surgery.formats.dcp_source import open_checkpoint_source
from surgery.formats.fingerprint import (
    ModelKeys,
    compute_fingerprint,
    model_fingerprint,
    model_keys,
)
from surgery.formats.keys import (
    ERROR,
    EXAMPLES,
    NOTE,
    Finding,
    check_keys,
    common_attribute_prefix,
    module_paths,
)
from surgery.formats.manifest import Manifest
from surgery.formats.source import load_manifest_file
from surgery.formats.stream import ProgressFn, nbytes
from surgery.formats.tensors import (
    META_FINGERPRINT,
    CheckpointInfo,
    TensorInfo,
)
from surgery.formats.ties import TIED_FIELD, restore_ties
from surgery.planning.plan import default_output
from surgery.runtime.bundle import check_beside
from surgery.runtime.signing import ENV_KEY, ENV_KEY_FILE, MAKE_KEY

# --- the model a checkpoint holds -----------------------------------------------------------


# --- verify ---------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    path: str
    format: str
    entry: str | None
    prefix: str | None
    tensors: int
    fingerprint: str | None
    findings: list[Finding]
    manifest: str | None = None
    deep: bool = False
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings)

    @property
    def problems(self) -> int:
        return sum(f.count for f in self.findings if f.severity == ERROR)

    def to_dict(self, *, all_keys: bool = False) -> dict[str, Any]:
        return {
            "path": self.path, "format": self.format, "entry": self.entry,
            "prefix": self.prefix, "tensors": self.tensors, "fingerprint": self.fingerprint,
            "manifest": self.manifest, "deep": self.deep, "clean": self.clean,
            "findings": [f.to_dict(all_keys=all_keys) for f in self.findings],
        }


def verify_checkpoint(path: str, *, key: str | None = None, prefix: str | None = None,
                      manifest: str | Manifest | None = None, deep: bool = False,
                      progress: ProgressFn | None = None, kind: str | None = None
                      ) -> VerifyReport:
    """Check a checkpoint's key hygiene (and, optionally, its manifest and its data).

    For a safetensors file this reads the header only and does not import torch. `kind`
    names the file's format when its suffix does not (checkpoint.KINDS).
    """
    m = _load_manifest(manifest) if manifest is not None else None
    info = read_checkpoint(path, key=key, kind=kind)
    if prefix is None and m is not None:
        prefix = manifest_prefix(m, info)
    findings = check_keys(info.tensors, source=path, key=key, prefix=prefix)
    mk = model_keys(list(info.tensors), prefix=prefix)
    fingerprint = None if mk.collisions else compute_fingerprint(
        {c: info.tensors[k] for k, c in mk.names.items()}, canonical=True)
    if prefix is None:
        common = common_attribute_prefix(mk.names.values())
        if common is not None and len(mk.names) > 1:
            findings.append(Finding(
                "SG009", NOTE, f"every key starts with `{common}`", None, sorted(mk.names),
                f"if `{common}` is a training wrapper's attribute (e.g. a LightningModule's), "
                f"verify and export the inner model with --prefix {common}",
                sorted(mk.names)[:EXAMPLES]))
    elif not mk.names:
        raise CheckpointError(f"{path}: no key is under --prefix {prefix}", path=path,
                              hint="check the prefix against the keys (surgery verify --all)")
    findings.extend(_other_entries(path, info.others))
    if m is not None:
        findings.extend(_check_manifest(m, mk, fingerprint, info.tensors, checkpoint=path))
        findings.extend(_check_cache_bundle(m))
    if deep:
        findings.extend(_deep_findings(path, key=key, kind=kind, info=info, progress=progress))
    return VerifyReport(path, info.format, info.entry, prefix, len(info.tensors), fingerprint,
                        findings, manifest=_manifest_name(manifest), deep=deep,
                        dropped=mk.dropped)


def manifest_prefix(m: Manifest, info: CheckpointInfo) -> str | None:
    """The prefix to apply to `info`'s keys for the model `m` was planned for, or None.

    A manifest planned with ``--prefix model.`` records that prefix for the checkpoint it was
    planned from, and its fingerprint is that of the model under the prefix. A file whose keys
    were already stripped (a `surgery export`, or a user's own re-save) must not be stripped
    again: an export says so in its metadata, and otherwise a file whose unprefixed keys give
    the manifest's fingerprint already is that model.
    """
    prefix = m.model.get("prefix")
    if not prefix:
        return None
    if META_FINGERPRINT in info.metadata:
        return None  # written by `surgery export`: its keys are the model's own
    if model_fingerprint(info.tensors) == m.fingerprint:
        return None
    return str(prefix)


def _manifest_name(manifest: str | Manifest | None) -> str | None:
    if manifest is None or isinstance(manifest, str):
        return manifest
    return manifest.source_path


def _other_entries(path: str, others: Mapping[str, list[str]]) -> list[Finding]:
    """SG010: another state dict in the container (an `ema` entry) whose keys need an export."""
    out = []
    for entry, keys in others.items():
        found = [f for f in check_keys(keys, source=path, key=entry) if f.severity == ERROR]
        if found:
            what = ", ".join(f"{f.code} {f.title} (x{f.count})" for f in found)
            out.append(Finding(
                "SG010", NOTE, f"entry `{entry}` (another state dict in this file) was not "
                f"checked, and its keys carry: {what}", None, [f"{entry}/{k}" for k in keys],
                f"surgery verify {path} --key {entry}  (and export it with --key {entry})",
                [f"{entry}/{k}" for f in found for k in f.keys[:1]][:EXAMPLES]))
    return out


def _replan_fix(checkpoint: str, manifest: str) -> str:
    """SG101's fix. The manifest may be another model's: never suggest overwriting it, unless
    it is the one `plan` writes for this checkpoint (planned before the checkpoint changed)."""
    own = default_output(checkpoint)
    if os.path.abspath(own) == os.path.abspath(manifest):
        return (f"this checkpoint changed since {manifest} was planned: plan it again with "
                f"surgery plan {checkpoint} -o {manifest} --force")
    return (f"pass the manifest planned for this checkpoint, or plan one (a new file; "
            f"{manifest} stays as it is): surgery plan {checkpoint} -o {own}")


def _load_manifest(manifest: str | Manifest) -> Manifest:
    if isinstance(manifest, Manifest):
        return manifest
    return load_manifest_file(manifest)


def _check_manifest(m: Manifest, mk: ModelKeys, fingerprint: str | None,
                    tensors: Mapping[str, TensorInfo], *, checkpoint: str) -> list[Finding]:
    out: list[Finding] = []
    src = m.source_path or "MANIFEST"
    # A tied name the checkpoint left out (save_pretrained) that the plan recorded counts.
    table, restored = restore_ties({c: tensors[k] for k, c in mk.names.items()},
                                   m.model.get(TIED_FIELD))
    if restored and fingerprint is not None:
        fingerprint = compute_fingerprint(table, canonical=True)
    binding = None if fingerprint is None or m.fingerprint == fingerprint else bind(
        m.fingerprint, m.model, table, where=src, live="the checkpoint")
    if binding is not None and not binding.matches:
        out.append(Finding(
            "SG101", ERROR, f"the manifest was planned for a different checkpoint: "
            f"{binding.problem}", None,
            [], _replan_fix(checkpoint, src),
            [f"manifest {m.fingerprint}", f"checkpoint {fingerprint}"],
            {"expected": m.fingerprint, "actual": fingerprint}))
        out[-1].keys = ["model.fingerprint"]
    tree = module_paths(mk.names.values())
    missing_required: list[str] = []
    missing_optional: list[str] = []
    for region in m.regions:
        for p in region.paths:
            module = p if region.callable == "forward" else p.rpartition(".")[0]
            if module not in tree:
                (missing_required if region.required else missing_optional).append(p)
    for severity, missing, what in ((ERROR, missing_required, "required"),
                                    (NOTE, missing_optional, "optional")):
        if missing:
            out.append(Finding(
                "SG102", severity, f"{what} region paths not in the checkpoint's module tree",
                None, missing,
                f"fix the paths in {src} or plan it again (surgery plan CHECKPOINT); modules "
                "without parameters cannot be seen in a checkpoint",
                missing[:EXAMPLES]))
    return out


def _check_cache_bundle(m: Manifest) -> list[Finding]:
    """A note on the compile-cache bundle beside the manifest, if there is one (no torch).

    "Fits" only when its signature verifies with the deployer's key and everything it was
    built for matches; otherwise why apply_manifest will ignore it, and the fix for that.
    """

    found = check_beside(m)
    if found is None:
        return []
    path, valid, why = found.path, found.valid, found.reason
    if valid is False:
        rebuild = ("rebuild it on the deployment machine: surgery warm --model PKG.MOD:FACTORY "
                   f"--manifest {m.source_path} --input PKG.MOD:INPUT_FACTORY --force")
        fix = {"no-key": f"set {ENV_KEY_FILE} (or {ENV_KEY}) to the key the bundle was signed "
                         "with, then verify again",
               "bad-key": f"fix {ENV_KEY_FILE} / {ENV_KEY}; make a key with `{MAKE_KEY}`",
               "bad-signature": "do not use it: it was not signed with your key. " + rebuild,
               }.get(found.state, rebuild)
        title = {"unsigned": "the compile-cache bundle beside the manifest is unsigned",
                 "no-key": "the compile-cache bundle beside the manifest cannot be checked: "
                           "no key to check it",
                 "bad-key": "the compile-cache bundle beside the manifest cannot be checked: "
                            "the key is unusable",
                 "bad-signature": "the compile-cache bundle beside the manifest: signature "
                                  "does not verify",
                 }.get(found.state, "the compile-cache bundle beside the manifest will be "
                                    "ignored here")
        return [Finding("SG302", NOTE, title, None, [], fix, [path, why],
                        {"bundle": path, "valid": False, "state": found.state, "reason": why})]
    title = ("the compile-cache bundle beside the manifest fits this machine" if valid else
             "the compile-cache bundle beside the manifest fits, except the GPU, not checked")
    return [Finding("SG301", NOTE, title, None, [],
                    f"deploy with apply_manifest(model, {m.source_path!r}, cache=True)",
                    [path, why], {"bundle": path, "valid": valid, "state": found.state,
                                  "reason": why})]


# --- verify --deep --------------------------------------------------------------------------


def _deep_findings(path: str, *, key: str | None, kind: str | None, info: CheckpointInfo,
                   progress: ProgressFn | None) -> list[Finding]:
    """Read every tensor's bytes once: non-finite values, float64 tensors, shared storage."""

    findings: list[Finding] = []
    f64 = sorted(k for k, t in info.tensors.items() if t.dtype == "F64")
    if f64:
        findings.append(Finding(
            "SG202", ERROR, "float64 tensors (usually a stray .double() in training)", None, f64,
            "cast them in the training code, or before export: "
            "{k: v.float() if v.dtype == torch.float64 else v for k, v in sd.items()}",
            [f"{k} {list(info.tensors[k].shape)}" for k in f64[:EXAMPLES]]))
    src = open_checkpoint_source(path, key=key, kind=kind)
    try:
        seen: set[Any] = set()
        todo = []
        for k in sorted(src.infos):
            ident = src.identity(k)
            if ident not in seen:
                seen.add(ident)
                todo.append(k)
        total = sum(nbytes(src.infos[k]) for k in todo)
        done = 0
        if progress is not None:
            progress(0, total)
        bad: dict[str, tuple[int, int]] = {}
        for k in todo:
            dtype = src.infos[k].dtype
            nan = inf = 0
            for piece in src.chunks(k):
                a, b = count_nonfinite(piece, dtype)
                nan, inf = nan + a, inf + b
                done += len(piece)
                if progress is not None:
                    progress(done, total)
            if nan or inf:
                bad[k] = (nan, inf)
        storages: dict[Any, list[str]] = {}
        for k in sorted(src.infos):
            storages.setdefault(src.storage(k), []).append(k)
    finally:
        src.close()
    if bad:
        findings.append(Finding(
            "SG201", ERROR, "tensors holding NaN or Inf", None, sorted(bad),
            "find the step that diverged and export an earlier checkpoint",
            [f"{k}: {n} NaN, {i} Inf" for k, (n, i) in sorted(bad.items())[:EXAMPLES]],
            {"counts": {k: {"nan": n, "inf": i} for k, (n, i) in sorted(bad.items())}}))
    shared = [ks for ks in storages.values() if len(ks) > 1]
    if shared:
        findings.append(Finding(
            "SG203", NOTE, "tensors sharing one storage (tied weights or views)", None,
            [k for ks in shared for k in ks],
            "nothing to do: export stores tied tensors once and records the aliases",
            [" = ".join(ks) for ks in shared[:EXAMPLES]], {"groups": shared}))
    return findings


# Exponent and mantissa bit masks of the float formats: a value is Inf or NaN when its exponent
# bits are all set (NaN when its mantissa is not zero). Works on raw bytes, so it needs numpy
# only, not torch, and handles bfloat16, which numpy has no type for.
_FLOAT_BITS: dict[str, tuple[str, int, int]] = {
    "F64": ("<u8", 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F32": ("<u4", 0x7F800000, 0x007FFFFF),
    "F16": ("<u2", 0x7C00, 0x03FF),
    "BF16": ("<u2", 0x7F80, 0x007F),
    "F8_E5M2": ("u1", 0x7C, 0x03),
    "C64": ("<u4", 0x7F800000, 0x007FFFFF),
    "C128": ("<u8", 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
}


def count_nonfinite(data: memoryview | bytes, dtype: str) -> tuple[int, int]:
    """(NaN count, Inf count) in raw little-endian bytes of `dtype`; (0, 0) for integers."""
    import numpy as np

    if dtype == "F8_E4M3":  # no Inf; NaN is S.1111.111
        x = np.frombuffer(data, dtype="u1")
        return int(np.count_nonzero((x & 0x7F) == 0x7F)), 0
    if dtype not in _FLOAT_BITS:
        return 0, 0
    np_dtype, exp, mant = _FLOAT_BITS[dtype]
    x = np.frombuffer(data, dtype=np_dtype)
    top = (x & x.dtype.type(exp)) == x.dtype.type(exp)
    if not top.any():
        return 0, 0
    has_mant = (x & x.dtype.type(mant)) != 0
    nan = int(np.count_nonzero(top & has_mant))
    return nan, int(np.count_nonzero(top)) - nan


# --- export ---------------------------------------------------------------------------------
