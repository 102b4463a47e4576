"""The ``rankguard`` command: ``rankguard report DIR``, ``rankguard --version``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rankguard import __version__, report

__all__ = ["build_parser", "main"]

DESCRIPTION = """\
rankguard: training callbacks that keep every rank of a distributed PyTorch job
in step. The callbacks go into your trainer (from rankguard.integrations.composer
import RankGuard, or .lightning, .transformers, .torch for a hand-written loop);
this command reads what they leave behind."""

EPILOG = """\
example:
  rankguard report ./rankguard_reports   # after a HangWatchdog found a hang

Run `rankguard COMMAND --help` for a command's details."""


def build_parser() -> argparse.ArgumentParser:
    """The ``rankguard`` argument parser, with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="rankguard",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rankguard {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    reader = commands.add_parser("report", help=report.REPORT_HELP, prog="rankguard report")
    report.add_arguments(reader).set_defaults(run=report.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a ``rankguard`` command and returns its exit code.

    Args:
        argv: Arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The command's exit code (2 for a usage error, as argparse exits).
    """
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        parser.print_help(sys.stderr)
        return 2
    parsed = parser.parse_args(args)
    return parsed.run(parsed)


if __name__ == "__main__":
    sys.exit(main())
