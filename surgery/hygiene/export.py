"""`surgery export`: write the canonical model a checkpoint holds as prefix-free safetensors.

Keys are stripped of wrapper segments (collisions refused, both keys named), EMA bookkeeping is
left out, tied tensors are stored once with aliases, and the manifest it is bound to is embedded.
Every file is written through surgery.formats.atomic: nothing is published until all of it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from surgery import __version__
from surgery.errors import (
    CheckpointError,
    FingerprintMismatchError,
    SurgeryError,
)
from surgery.formats.binding import bind
from surgery.formats.dcp_source import open_checkpoint_source
from surgery.formats.fingerprint import compute_fingerprint, model_keys
from surgery.formats.keys import (
    FLAT_PARAM,
    collision_error,
)
from surgery.formats.manifest import Manifest, parse_manifest
from surgery.formats.source import read_manifest_text
from surgery.formats.stream import ProgressFn
from surgery.formats.tensors import (
    META_DROPPED,
    META_FINGERPRINT,
    META_FORMAT,
    META_MANIFEST,
    META_MANIFEST_SHA256,
    META_SOURCE,
    META_VERSION,
)
from surgery.formats.ties import TIED_FIELD, restore_ties
from surgery.formats.writer import Planned, write_safetensors
from surgery.hygiene.verify import manifest_prefix


@dataclass
class ExportResult:
    source: str
    files: list[str]
    index: str | None
    entry: str | None
    prefix: str | None
    tensors: int  # keys of the unwrapped model (aliases included)
    stored: int  # tensors stored (tied tensors once)
    renamed: int  # keys whose name changed
    aliases: dict[str, str]
    dropped: dict[str, str]
    fingerprint: str
    bytes_written: int
    seconds: float
    manifest_sha256: str | None = None
    recovered: list[str] = field(default_factory=list)  # cleanup after a killed earlier run

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def export_checkpoint(path: str, *, out: str, key: str | None = None,
                      prefix: str | None = None, manifest: str | None = None,
                      max_shard_size: int | None = None, force: bool = False,
                      progress: ProgressFn | None = None, kind: str | None = None
                      ) -> ExportResult:
    """Write the checkpoint's unwrapped model as prefix-free safetensors, atomically.

    Refuses keys that would merge (listing both originals) and FSDP flat parameters. Tied
    tensors are stored once with their aliases in the metadata. With `manifest`, its
    fingerprint must match, and its text and sha256 are embedded so the file is one deployable
    artifact (see `checkpoint.read_embedded_manifest`).
    """

    started = time.perf_counter()
    if not out.endswith(".safetensors"):
        raise SurgeryError(f"output {out!r} does not end in .safetensors",
                           hint="name it e.g. model.safetensors (shards are named from it)")
    manifest_text: str | None = None
    m: Manifest | None = None
    if manifest is not None:
        manifest_text = read_manifest_text(manifest)
        m = parse_manifest(manifest_text, path=manifest)
    src = open_checkpoint_source(path, key=key, kind=kind)
    try:
        if prefix is None and m is not None:
            prefix = manifest_prefix(m, src.info)
        _refuse_same_file(out, [*src.info.files, path])
        keys = list(src.infos)
        flat = [k for k in keys if FLAT_PARAM.name in k.split(".")]
        if flat:
            raise CheckpointError(
                f"{path}: holds FSDP1 flat parameters ({flat[0]!r}); the per-parameter tensors "
                "are not in the file", path=path,
                hint="re-save with FSDP use_orig_params=True or a full state dict, then export")
        mk = model_keys(keys, prefix=prefix)
        if mk.collisions:
            raise collision_error(mk.collisions, source=path)
        if not mk.names:
            raise CheckpointError(f"{path}: nothing to export (no key is under --prefix "
                                  f"{prefix})", path=path, hint="check the prefix")
        model = {c: src.infos[k] for k, c in mk.names.items()}
        # Tied names the checkpoint left out (save_pretrained) that the plan recorded are put
        # back, as aliases of the tensor they share (surgery.formats.ties).
        model, restored = restore_ties(model, m.model.get(TIED_FIELD) if m else None)
        fingerprint = compute_fingerprint(model)
        binding = None if m is None or m.fingerprint == fingerprint else bind(
            m.fingerprint, m.model, model, where=str(manifest), live="this checkpoint")
        if m is not None and binding is not None and not binding.matches:
            raise FingerprintMismatchError(
                f"{manifest}: planned for a different checkpoint (manifest {m.fingerprint}, "
                f"this checkpoint {fingerprint}): {binding.problem}", expected=m.fingerprint,
                actual=fingerprint,
                hint=f"plan the manifest for this checkpoint: surgery plan {path}")
        # Tied tensors: the first canonical name of each group stores the bytes.
        stored_as: dict[Any, str] = {}
        aliases: dict[str, str] = {}
        planned: list[Planned] = []
        for k, c in sorted(mk.names.items(), key=lambda kc: kc[1]):
            ident = src.identity(k)
            if ident in stored_as:
                aliases[c] = stored_as[ident]
                continue
            stored_as[ident] = c
            planned.append(Planned(c, src.infos[k], src, k))
        stored = {p.name for p in planned}
        for alias, source in restored.items():
            aliases[alias] = source if source in stored else aliases[source]
        metadata = {META_FORMAT: "pt", META_FINGERPRINT: fingerprint,
                    META_SOURCE: os.path.basename(path), META_VERSION: __version__}
        sha = None
        if manifest_text is not None:
            sha = hashlib.sha256(manifest_text.encode("utf-8")).hexdigest()
            metadata[META_MANIFEST] = manifest_text
            metadata[META_MANIFEST_SHA256] = sha
        if mk.dropped:

            metadata[META_DROPPED] = json.dumps(sorted(mk.dropped))
        # Every derived output (each shard, the index) against every file read.
        inputs = [*src.info.files, path, *([manifest] if manifest else [])]
        written = write_safetensors(out, planned, metadata=metadata, aliases=aliases,
                                    max_shard_size=max_shard_size, force=force,
                                    progress=progress, inputs=inputs)
    finally:
        src.close()
    return ExportResult(
        source=path, files=written.files, index=written.index, entry=src.info.entry,
        prefix=prefix, tensors=len(mk.names) + len(restored), stored=len(planned),
        renamed=sum(1 for k, c in mk.names.items() if k != c), aliases=aliases,
        dropped=mk.dropped, fingerprint=fingerprint, bytes_written=written.bytes_written,
        seconds=time.perf_counter() - started, manifest_sha256=sha, recovered=written.recovered)


def _refuse_same_file(out: str, inputs: list[str]) -> None:
    """The input is never modified: refuse an output path that is one of the input files."""
    target = os.path.realpath(out)
    for p in inputs:
        if os.path.realpath(p) == target:
            raise SurgeryError(f"output {out!r} is the input file",
                               hint="export to a new file; the input is never modified")
