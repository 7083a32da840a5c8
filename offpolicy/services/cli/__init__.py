"""The `offpolicy` command line: `main` (the console script `offpolicy`) and its parser, re-exported."""

from offpolicy.services.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
