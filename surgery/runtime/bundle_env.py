"""What a compile-cache bundle is valid for: torch, triton, CUDA, the GPU, Python, the platform.

``environment`` asks torch (in the process that builds or loads a bundle); ``surgery verify``
must not import torch, so ``environment_without_torch`` reads the same facts from files:
torch's own ``version.py`` (the text of ``torch.__version__`` and ``torch.version.cuda``),
package metadata for triton, and ``nvidia-smi`` for the GPU.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys

# The environment keys a bundle must match, in the order reasons name them.
ENV_KEYS = ("torch", "triton", "cuda", "device", "python", "platform")


def _python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _platform() -> str:
    return f"{sys.platform}-{platform.machine()}"


def environment(*, device: str) -> dict[str, str | None]:
    """What a bundle built here, for a model on ``device``, would be valid for (imports torch)."""
    import torch

    try:
        import triton

        triton_version: str | None = str(triton.__version__)
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return {"torch": str(torch.__version__), "triton": triton_version,
            "cuda": torch.version.cuda, "device": name, "python": _python(),
            "platform": _platform()}


def environment_without_torch(*, want_gpu: bool) -> tuple[dict[str, str | None], list[str]]:
    """The same record read from files, without importing torch (for `verify`).

    Returns the record and what could not be checked. The GPU name comes from ``nvidia-smi``
    when ``want_gpu`` and it is on PATH; otherwise it is unknown, and said so.
    """
    # importlib.metadata costs ~70 ms to import (it pulls in the email package): only a bundle
    # check pays for it, not every CLI start (`surgery verify` of a safetensors file).
    import importlib.metadata

    unchecked: list[str] = []
    env: dict[str, str | None] = {"python": _python(), "platform": _platform(), "device": "cpu"}
    # triton ships as `triton`, or as `pytorch-triton` with nightly builds of torch.
    for name, dists in (("torch", ("torch",)), ("triton", ("triton", "pytorch-triton"))):
        env[name] = _torch_version_file("__version__") if name == "torch" else None
        if env[name] is not None:
            continue
        for dist in dists:
            try:
                env[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    env["cuda"] = _torch_cuda_version()
    if want_gpu:
        gpu = _nvidia_smi_gpu()
        env["device"] = gpu
        if gpu is None:
            unchecked.append("device")
    return env, unchecked


def _torch_version_file(name: str) -> str | None:
    """A value assigned in torch/version.py (``__version__``, ``cuda``), read as text:
    find_spec does not import torch. None when torch or the line is missing, or it says None."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                for line in f:
                    left, sep, right = line.partition("=")
                    if sep and left.split(":")[0].strip() == name:
                        value = right.strip().strip("'\"")
                        return None if value == "None" else value
        except OSError:
            continue
    return None


def _torch_cuda_version() -> str | None:
    """torch.version.cuda, without importing torch."""
    return _torch_version_file("cuda")


def same_torch(built: str | None, here: str | None) -> bool:
    """Whether a bundle built under torch ``built`` fits torch ``here``.

    torch.__version__ carries a local part naming the build ("2.14.1+cu130"), and so does the
    text of torch/version.py, which verify reads; the package metadata, verify's fall-back when
    that file cannot be read, may not ("2.14.1" for the wheel from PyPI). Comparing those two
    as strings made a fitting bundle look stale (issue 12). The local part names the CUDA
    build, which the "cuda" key compares on its own, so when one side lacks it the public
    versions are compared, and when both carry it, all of it is.
    """
    if built is None or here is None:
        return built == here
    if "+" in built and "+" in here:
        return built == here
    return built.split("+", 1)[0] == here.split("+", 1)[0]


def _nvidia_smi_gpu() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return names[0] if names else None
