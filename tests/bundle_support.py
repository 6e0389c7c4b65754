"""Build torch's Mega-Cache framing by hand (torch.utils._appending_byte_serializer's layout), so
tests can forge the blobs an attacker would, without torch writing them."""

from __future__ import annotations

import base64
import importlib
import pickle
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

from surgery.formats.fingerprint import compute_fingerprint
from surgery.formats.manifest import DEFAULT_COMPILE, Manifest, Region, save_manifest
from surgery.runtime.signing import ENV_KEY, ENV_KEY_FILE

KEY_HEX = "5e" * 32  # what `secrets.token_hex(32)` prints: 64 hex digits
KEY = bytes.fromhex(KEY_HEX)

# A module file for tests that warm and deploy in fresh processes (`--model MOD:build`): two
# identical blocks, so one compiled group, small enough for inductor to compile quickly. Each
# test appends its own STEP or example factory.
TWO_BLOCKS_SRC = textwrap.dedent('''
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 32)
            self.b = nn.Linear(32, 16)

        def forward(self, x):
            return x + self.b(torch.nn.functional.gelu(self.a(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    def build():
        torch.manual_seed(0)
        return Net()
''')



def signed_site(tmp_path: Path, monkeypatch: Any, name: str, source: str) -> Path:
    """``tmp_path`` holding the module ``name`` (``source``: TWO_BLOCKS_SRC and its STEP) and
    net.surgery.toml of its two blocks (inductor on the CPU); the deployer's key in the
    environment, a cache folder of the test's own, the module importable, cwd there."""
    monkeypatch.setenv(ENV_KEY, KEY_HEX)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    mod = importlib.reload(sys.modules[name]) if name in sys.modules else \
        importlib.import_module(name)  # this test's file, not an earlier test's module
    m = Manifest(compute_fingerprint(mod.build().state_dict()),
                 [Region("block", ["blocks.0", "blocks.1"])],
                 compile={**DEFAULT_COMPILE, "on_cpu": "compile"})
    save_manifest(m, str(tmp_path / "net.surgery.toml"))
    return tmp_path


def torch_cache_blob(groups: list[tuple[str, list[tuple[str, bytes]]]]) -> bytes:
    """crc32 | u64 version 1 | per type: name, count, per artifact: key, content."""
    body = bytearray((1).to_bytes(8, "big"))

    def chunk(b: bytes) -> None:
        body.extend(len(b).to_bytes(8, "big"))
        body.extend(b)

    for kind, artifacts in groups:
        chunk(base64.b64encode(kind.encode()))
        body.extend(len(artifacts).to_bytes(8, "big"))
        for key, content in artifacts:
            chunk(base64.b64encode(key.encode()))
            chunk(content)
    return zlib.crc32(bytes(body)).to_bytes(4, "big") + bytes(body)


class _Touch:
    """A pickle that creates ``path`` when it is loaded: the payload of a forged artifact."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def payload_blob(marker: Path, *, traversal: Path | None = None) -> bytes:
    """An inductor artifact whose pickle creates ``marker`` when torch loads it, and, with
    ``traversal``, an autotune artifact whose key is that absolute path (torch writes there)."""
    groups: list[tuple[str, list[tuple[str, bytes]]]] = [
        ("inductor", [("fevilgraph", pickle.dumps(_Touch(marker)))])]
    if traversal is not None:
        groups.append(("autotune", [(str(traversal), b'{"pwned": 1}')]))
    return torch_cache_blob(groups)


EMPTY_BLOB = torch_cache_blob([])
