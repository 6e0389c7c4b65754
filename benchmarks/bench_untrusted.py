"""Reading untrusted inputs at scale: safetensors headers and manifests (issue 10).

Each figure is one fresh Python process (so peak RSS is its own), timing only the read:
- `read_safetensors_layout` of a header-only file with N tensors (the header is checked
  against safetensors' rules: bounded JSON, duplicate keys, dtypes, shapes, tiling);
- `load_manifest` of a manifest with one region of N paths (tomllib, then the schema);
- how long a hostile header (100k-deep JSON) takes to be refused.

    .venv/bin/python benchmarks/bench_untrusted.py [--sizes 10000,100000,1000000]

Run it with PYTHONPATH pointing at another tree to measure that tree's code (the "before"
figures in RESULTS.md come from the tree before this change).
"""

from __future__ import annotations

import argparse
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from tests_support import write_header_only_safetensors  # noqa: E402

CHILD = """
import sys, time
kind, path = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if kind == "header":
    from surgery.formats.st_file import read_safetensors_layout
    n = len(read_safetensors_layout(path).tensors)
elif kind == "manifest":
    from surgery.formats.manifest import load_manifest
    n = sum(len(r.paths) for r in load_manifest(path).regions)
else:
    from surgery.formats.st_file import read_safetensors_layout
    from surgery.errors import SurgeryError
    try:
        read_safetensors_layout(path)
        n = -1
    except SurgeryError:
        n = 0
    except BaseException as e:  # the tree before issue 10: RecursionError
        print(f"{type(e).__name__}", file=sys.stderr)
        n = 2
secs = time.perf_counter() - t
# VmHWM is this process's own peak (ru_maxrss would carry the forking parent's over exec).
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")).split()[1]
print(secs, n, int(hwm) / 1024)
print(sys.modules["surgery"].__file__, file=sys.stderr)
"""


def child(kind: str, path: str) -> tuple[float, int, float]:
    # cwd is the temp folder: `python -c` puts the cwd first on sys.path, which would import
    # whatever `surgery` sits there instead of the tree PYTHONPATH names.
    out = subprocess.run([sys.executable, "-c", CHILD, kind, path], check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(path)
                         ).stdout.split()
    return float(out[0]), int(out[1]), float(out[2])


def write_manifest(path: str, n: int) -> None:
    import tomli_w

    from surgery.formats.manifest import Manifest, Region

    m = Manifest(fingerprint="sha256:" + "0" * 64,
                 regions=[Region(kind="block", paths=[f"blocks.{i}" for i in range(n)])])
    with open(path, "w", encoding="utf-8") as f:
        f.write(tomli_w.dumps(m.to_dict()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# {time.strftime('%Y-%m-%d')}  {platform.machine()} {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")
    print("| input | N | file | read (s) | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for n in sizes:
            path = os.path.join(work, f"h{n}.safetensors")
            write_header_only_safetensors(path, {f"l.{i}.w": ((4,), "F32") for i in range(n)})
            with open(path, "rb") as f:
                header = struct.unpack("<Q", f.read(8))[0]
            secs, got, rss = child("header", path)
            assert got == n
            print(f"| safetensors header | {n} | {header / 1e6:.1f} MB header | {secs:.2f} | "
                  f"{rss:.0f} |")
            os.unlink(path)
        for n in sizes:
            path = os.path.join(work, f"m{n}.surgery.toml")
            write_manifest(path, n)
            secs, got, rss = child("manifest", path)
            assert got == n
            print(f"| manifest paths | {n} | {os.path.getsize(path) / 1e6:.1f} MB | {secs:.2f} | "
                  f"{rss:.0f} |")
            os.unlink(path)
        path = os.path.join(work, "deep.safetensors")
        raw = ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
        secs, got, rss = child("refuse", path)
        what = {0: "refused", 2: "crashed"}.get(got, "accepted")
        print(f"| 100k-deep JSON header ({what}) | 1 | {len(raw) / 1e3:.0f} KB | {secs:.3f} | "
              f"{rss:.0f} |")


if __name__ == "__main__":
    main()
