"""Deployment: `apply_manifest` (surgery.runtime.apply) compiles a manifest's regions in place,
warms them up and captures their CUDA graphs; the signed compile-cache bundle; the report.

Depends on surgery.formats (the manifest, the fingerprint) and surgery.runtime.graphs only:
nothing here imports planning, hygiene or the CLI (tests/test_layers.py checks it, in a fresh
interpreter too). The public entry points are re-exported lazily by the top-level `surgery`
package, so this one imports nothing: the torch-free bundle reader that `surgery verify` uses
(surgery.runtime.bundle) does not pull torch in.
"""
