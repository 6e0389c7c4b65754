"""The `surgery` command line: the only package that prints or exits.

surgery.cli.app holds the group, the error-to-exit-code mapping and the shared options; each
command module registers its commands on the group when imported here.
"""

from surgery.cli import hygiene_commands, manifest_commands
from surgery.cli.app import cli, error_json, handle_errors, main

__all__ = ["cli", "error_json", "handle_errors", "hygiene_commands", "main",
           "manifest_commands"]
