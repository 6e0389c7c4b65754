"""The runner loader opens a package's library deep-bound (surgery.runtime.aoti_bundle).

The AOTInductor crash on torch 2.11 (H200) is inside the std::regex code a package's library
instantiates; torch's libraries export their own copies of that code. These tests show, with
two small libraries built here by g++, what RTLD_DEEPBIND changes (a library's references bind
to its own definitions, not to an earlier library's), and that the runner loader opens the
library that way before torch's runner does.
"""

from __future__ import annotations

import ctypes
import io
import os
import shutil
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from surgery.runtime import aoti_bundle

pytestmark = pytest.mark.skipif(not aoti_bundle.DEEPBIND or shutil.which("g++") is None,
                                reason="needs RTLD_DEEPBIND (Linux) and g++")

# Both define the same weak, default-visibility function, as a package's library and torch's
# libraries each define the std::regex code they instantiate.
FIRST = '__attribute__((weak)) int which() { return 1; }\n'
PACKAGE = ('__attribute__((weak)) int which() { return 2; }\n'
           'extern "C" int ask() { return which(); }\n')


def _build(tmp: Path, name: str, src: str) -> str:
    (tmp / f"{name}.cpp").write_text(src)
    out = str(tmp / f"{name}.so")
    subprocess.run(["g++", "-shared", "-fPIC", "-O0", "-o", out, str(tmp / f"{name}.cpp")],
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture
def libs(tmp_path: Path) -> tuple[str, Path]:
    """The earlier library (loaded into the global scope, as torch's are), and a folder with
    two copies of the package's library (one per way of opening it)."""
    first = _build(tmp_path, "first", FIRST)
    ctypes.CDLL(first, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    pkg = _build(tmp_path, "package", PACKAGE)
    shutil.copy(pkg, tmp_path / "package2.so")
    return pkg, tmp_path


def _packaged(pkg: str, tmp: Path) -> tuple[bytes, Path]:
    """A package's zip holding the library ``pkg``, and an empty folder to unpack it into."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.write(pkg, "model/data/aotinductor/model/m.wrapper.so")
    folder = tmp / "unpacked"
    folder.mkdir()
    return buf.getvalue(), folder


def test_a_deep_bound_library_calls_its_own_definitions(libs) -> None:
    pkg, tmp = libs
    plain = ctypes.CDLL(str(tmp / "package2.so"), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    assert plain.ask() == 1  # opened normally: bound to the earlier library's definition
    deep = aoti_bundle.open_deep_bound(pkg)
    assert deep is not None and deep.ask() == 2  # deep-bound: its own


def test_the_runner_loader_opens_the_library_deep_bound_before_torchs_runner(
        libs, monkeypatch) -> None:
    """The library torch's runner gets is the deep-bound one: opened first, by path, and the
    same path handed to the runner (dlopen answers it with that handle)."""
    pkg, tmp = libs
    seen: list[tuple[str, str]] = []
    real = aoti_bundle.open_deep_bound

    def deep(lib: str):  # type: ignore[no-untyped-def]
        seen.append(("deep", lib))
        return real(lib)

    class Runner:
        def __init__(self, lib: str, n: int) -> None:
            seen.append(("runner", lib))
            # the same path, opened as torch's runner opens it: already deep-bound
            self.answer = ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_LOCAL).ask()

        def get_constant_names_to_original_fqns(self) -> dict[str, str]:
            return {}

    monkeypatch.setattr(aoti_bundle, "open_deep_bound", deep)
    monkeypatch.setattr(torch._C, "_aoti", SimpleNamespace(AOTIModelContainerRunnerCpu=Runner))
    data, folder = _packaged(pkg, tmp)
    runner = aoti_bundle._SoRunner.unpack(data, str(folder), "cpu")
    assert [k for k, _ in seen] == ["deep", "runner"] and seen[0][1] == seen[1][1], seen
    assert runner._runner.answer == 2  # torch's runner sees the library's own definitions


def test_a_runner_that_fails_closes_the_deep_bound_handle_and_the_folder(libs,
                                                                        monkeypatch) -> None:
    """torch's runner raising after the deep-bound open: that handle is closed (not kept for
    the process's life) and the unpacked folder is gone, and the error reaches the caller."""
    pkg, tmp = libs
    closed: list[object] = []
    monkeypatch.setattr(aoti_bundle, "_dlclose", closed.append)

    class Failing:
        def __init__(self, lib: str, n: int) -> None:
            raise RuntimeError("the runner refused the library")

    monkeypatch.setattr(torch._C, "_aoti", SimpleNamespace(AOTIModelContainerRunnerCpu=Failing))
    data, folder = _packaged(pkg, tmp)
    with pytest.raises(RuntimeError, match="refused the library"):
        aoti_bundle._SoRunner.unpack(data, str(folder), "cpu")
    assert len(closed) == 1 and isinstance(closed[0], ctypes.CDLL), closed
    assert not folder.exists()
