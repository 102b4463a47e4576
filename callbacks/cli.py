"""The ``rankguard`` command: ``rankguard report DIR``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rankguard.callbacks import hang_report

__all__ = ["main"]

COMMANDS = {"report": hang_report.main}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a ``rankguard`` subcommand and returns its exit code.

    Args:
        argv: Arguments after the program name (default: ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="rankguard")
        parser.add_argument("command", choices=sorted(COMMANDS))
        parser.parse_args(args[:1])  # prints usage and exits 2
    return COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())
