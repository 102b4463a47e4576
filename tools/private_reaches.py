"""Counts the reaches into another object's private attributes in a package's modules.

A reach is an attribute access ``x._name`` (not a dunder) where ``x`` is not ``self`` or
``cls``: one object reading, writing or calling what another keeps private, or a module's
private function called from another module. Not counted (``--all`` counts them too):
accesses on a module from outside the project (``sys._current_frames``, ``os._exit``), and
a named tuple's methods (``_replace``, ``_asdict``...), public API whose underscore only
keeps them apart from the fields.

Usage::

    .venv/bin/python tools/private_reaches.py [--list] [--all] [FOLDER ...]

The default folder is ``src/rankguard/callbacks/hang``. Prints the count (and with ``--list``
each reach as ``path:line: expression``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "src" / "rankguard" / "callbacks" / "hang"
#: The receivers that are the object itself.
OWN = frozenset({"self", "cls"})
#: The project's top-level package: a module imported from elsewhere is not the project's.
PROJECT = "rankguard"
#: A named tuple's public methods and attributes (``collections.namedtuple``'s documentation).
NAMED_TUPLE_API = frozenset({"_replace", "_asdict", "_make", "_fields", "_field_defaults"})


def _external_modules(tree: ast.Module) -> set[str]:
    """The names a module binds to modules from outside the project (``import sys``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != PROJECT:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != PROJECT:
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def reaches(path: Path, *, everything: bool = False) -> Iterator[tuple[int, str]]:
    """The private reaches in the module at ``path``: ``(line, expression)`` each."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    external = set() if everything else _external_modules(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        if not everything and node.attr in NAMED_TUPLE_API:
            continue
        receiver = node.value
        if isinstance(receiver, ast.Name) and (receiver.id in OWN or receiver.id in external):
            continue
        yield node.lineno, ast.unparse(node)


def main(argv: list[str] | None = None) -> int:
    """Prints the count of private reaches under the folders given (the hang package)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path, default=[DEFAULT])
    parser.add_argument("--list", action="store_true", help="print each reach")
    parser.add_argument("--all", action="store_true", help="count the stdlib's privates too")
    args = parser.parse_args(argv)
    total = 0
    for folder in args.folders:
        for path in sorted(folder.rglob("*.py")):
            for line, text in reaches(path, everything=args.all):
                total += 1
                if args.list:
                    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    sys.stdout.write(f"{shown}:{line}: {text}\n")
    sys.stdout.write(f"{total} private reaches\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
