"""Shows that installing rankguard with a user's extras changes none of their packages.

Runs pip's dry run of ``pip install '.[EXTRAS]'`` (the repository as a user installs it, not
editable) with the running interpreter's environment as the user's stack, and fails when pip
would install, upgrade or downgrade anything but rankguard itself. ``make install-check`` runs it
in both locked environments (it asks the package index, so it is not part of ``make test``).

Usage::

    .venv/bin/python tools/install_check.py --extras lightning,transformers,olmo-core,report
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def planned_installs(extras: str) -> list[tuple[str, str]]:
    """What pip would install for ``rankguard[extras]``: (name, version) pairs."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet"]
    command += ["--report", "-", f"{ROOT}[{extras}]"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"]]


def installed(name: str) -> str:
    """The version of ``name`` installed here, or ``-`` where it is not."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def main() -> int:
    """Prints pip's plan beside what is installed; exit 1 if it touches anything but rankguard."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", required=True, help="comma-separated extras, e.g. lightning")
    extras = parser.parse_args().extras
    plan = planned_installs(extras)
    others = [(name, new) for name, new in plan if name.lower() != "rankguard"]
    lines = [f"{sys.prefix}: pip install 'rankguard[{extras}]' --dry-run would install:"]
    lines += [f"  {name} {new} (installed: {installed(name)})" for name, new in plan]
    if others:
        lines.append(f"FAIL: {len(others)} package(s) besides rankguard would change.")
    else:
        lines.append("OK: rankguard alone; every installed package stays as it is.")
    sys.stdout.write("\n".join(lines) + "\n")
    return 1 if others else 0


if __name__ == "__main__":
    sys.exit(main())
