"""Key hygiene, offline: `verify` proves a checkpoint is prefix-free, `export` writes one that is.

Both read checkpoints through surgery.formats; verify also reports on a cache bundle beside a
manifest (surgery.runtime.bundle, without torch). Nothing in the runtime imports this package.
"""

from surgery.hygiene.export import ExportResult, export_checkpoint
from surgery.hygiene.verify import VerifyReport, verify_checkpoint

__all__ = ["ExportResult", "VerifyReport", "export_checkpoint", "verify_checkpoint"]
