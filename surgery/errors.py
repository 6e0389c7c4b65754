"""Every failure the library reports is a SurgeryError; the CLI maps each kind to an exit code.

Each subclass carries what it names (a path, a key, a region) so callers and tests can inspect
it without parsing the message.
"""

from __future__ import annotations

# Exit codes of the CLI (DESIGN.md): 0 clean, 1 findings, 2 usage (Click's own), 3 could not run.
EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_CANNOT_RUN = 3


class SurgeryError(Exception):
    """Base class. `exit_code` is what the CLI exits with when this reaches it."""

    exit_code: int = EXIT_CANNOT_RUN

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  fix: {self.hint}"


class CheckpointError(SurgeryError):
    """A checkpoint that cannot be read: missing, truncated, garbage, or an unknown layout."""

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class UnsafeCheckpointError(CheckpointError):
    """A pickle that needs arbitrary globals to load. It is reported, never executed."""


class ManifestError(SurgeryError):
    """A manifest that is missing, not TOML, or does not match the schema.

    `location` is the dotted TOML location of the problem (e.g. ``region[2].paths[0]``).
    """

    def __init__(
        self, message: str, *, path: str | None = None, location: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.path = path
        self.location = location


class KeyCollisionError(SurgeryError):
    """Stripping wrapper segments would merge two or more keys into one."""

    def __init__(self, message: str, *, collisions: dict[str, list[str]], hint: str | None = None):
        super().__init__(message, hint=hint)
        self.collisions = collisions


class ModelSourceError(SurgeryError):
    """A `--model package.module:factory` that cannot be imported or built."""


class EmptyPlanError(SurgeryError):
    """`plan --input` found no region: an empty plan is a finding, never a success (exit 1).

    `reasons` counts why modules were left out (reason -> modules), most common first.
    """

    exit_code = EXIT_FINDINGS

    def __init__(self, message: str, *, reasons: dict[str, int], hint: str | None = None):
        super().__init__(message, hint=hint)
        self.reasons = reasons


class OutputExistsError(SurgeryError):
    """Refusing to overwrite an existing output without --force."""

    exit_code = EXIT_CANNOT_RUN

    def __init__(self, path: str) -> None:
        super().__init__(
            f"output {path!r} already exists",
            hint="pass --force to overwrite it, or choose another path with -o",
        )
        self.path = path


class RegionError(SurgeryError):
    """A manifest region that does not fit the live model (unresolved path, bad options)."""

    def __init__(self, message: str, *, region: str | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.region = region


class FingerprintMismatchError(SurgeryError):
    """The manifest was planned for a different checkpoint than the model or file at hand."""

    def __init__(self, message: str, *, expected: str, actual: str, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.expected = expected
        self.actual = actual


class CacheBundleError(SurgeryError):
    """A compile-cache bundle that cannot be written, or read back as a valid bundle.

    Loading never raises it to a deployment: `apply_manifest` turns it into a reason and
    compiles as usual. Building a bundle (`surgery warm`, `handle.save_cache`) does raise it.
    """

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class BytecodeFolderError(SurgeryError):
    """A bytecode folder (`surgery bytecode`) that is not private, or a compile that failed."""

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class CacheKeyError(SurgeryError):
    """No usable key to sign or check compile-cache bundles: none set, unreadable, or too short.

    Building a bundle (`surgery warm`, ``handle.save_cache()``) raises it; loading one turns it
    into the reason the bundle is ignored.
    """


class CacheSignatureError(CacheBundleError):
    """A bundle that cannot be trusted: ``state`` is "unsigned", "no-key" or "bad-signature"."""

    def __init__(self, message: str, *, path: str, state: str, hint: str | None = None) -> None:
        super().__init__(message, path=path, hint=hint)
        self.state = state
