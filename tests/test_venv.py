"""The venv works outside pytest (issue 21): the zoo's model packages import in a plain process.

PyPI's x86_64 torchvision is built against CUDA torch; beside the CPU torch 2.13.0 it failed to
import, and with it timm and transformers' BertModel, while tests/conftest.py hid that inside
pytest. The Makefile now installs a torchvision that matches its torch (VISION), and `.ci/run`
checks the imports first (`make check-venv`). This test runs the same imports in a fresh
interpreter, without conftest's help.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _makefile() -> str:
    with open(os.path.join(ROOT, "Makefile")) as f:
        return f.read()


def test_the_zoo_imports_in_a_plain_interpreter() -> None:
    zoo = re.search(r"^ZOO_IMPORTS := (.+)$", _makefile(), re.M)
    assert zoo is not None
    code = zoo.group(1)
    for name in ("import timm", "transformers", "diffusers", "from transformers import BertModel"):
        assert name in code
    done = subprocess.run([sys.executable, "-c", code + "; print('ok')"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_ci_checks_the_venv_before_the_tests() -> None:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        run = f.read()
    assert run.index("make check-venv") < run.index("make test")
    make = _makefile()
    assert "check-venv:" in make and "$(ZOO_IMPORTS)" in make
    # The torch pin is read without importing torch, which printed a NumPy warning in
    # `make demo` before numpy was installed.
    pin = make.split("\npin:\n", 1)[1].split("\n\n", 1)[0]
    assert "importlib.metadata" in pin and "import torch" not in pin
