"""Command line. Each command parses, calls one library function and prints: `group` holds the
`worker` group and what its commands share; the commands live by what they do."""

from worker.cli import admin, inspect, measure, process  # noqa: F401  (registers the commands)
from worker.cli.group import cli, main

__all__ = ["cli", "main"]
