"""``make lint``'s type check: mypy over the public surface, as an installed package shows it.

setuptools maps ``rankguard.callbacks`` and ``rankguard.integrations`` to the
repository's ``callbacks/`` and ``integrations/`` (``pyproject.toml``,
``package-dir``), and the editable install finds them with an import hook,
which mypy does not run. So this script first links the package as a wheel
lays it out under :data:`TREE` (symbolic links to the sources, rebuilt from
``package-dir`` on every run), then runs mypy with the settings of
``[tool.mypy]`` in ``pyproject.toml`` on :data:`TARGETS`: the README's
quickstart for every integration (``tests/typecheck/quickstart.py``) and the
integration modules. Paths in mypy's messages are the repository's.

Usage::

    .venv/bin/python tools/typecheck.py [extra mypy arguments or files]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
#: Where the package is linked as installed (``build/`` is git-ignored); ``mypy_path``.
TREE = ROOT / "build" / "typecheck"
#: The integrations whose public modules are checked (not ``config``, nor ``_*`` helpers).
INTEGRATIONS = ("composer", "lightning", "olmo_core", "torch", "transformers")
TARGETS = [
    "tests/typecheck/quickstart.py",
    *[f"{TREE.relative_to(ROOT)}/rankguard/integrations/{name}.py" for name in INTEGRATIONS],
]


def package_dirs() -> dict[str, Path]:
    """Each package of ``pyproject.toml`` and the folder that holds it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools = config["tool"]["setuptools"]
    mapping = setuptools.get("package-dir", {})
    dirs = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):  # the longest mapped prefix, then the rest
            prefix = ".".join(parts[:cut])
            if prefix in mapping:
                dirs[package] = ROOT / mapping[prefix] / Path(*parts[cut:])
                break
        else:
            dirs[package] = ROOT / Path(*parts)
    return dirs


def link_tree(tree: Path = TREE) -> None:
    """Links every package under ``tree`` where an installed wheel would put it.

    A package whose sub-packages all lie inside its own folder is one link to
    that folder; one with a sub-package mapped elsewhere (``rankguard``) is a
    folder of links to its files, and its sub-packages are linked into it.
    """
    if tree.exists():
        shutil.rmtree(tree)
    dirs = package_dirs()
    linked: list[str] = []
    for package in sorted(dirs, key=lambda p: p.count(".")):
        if any(package.startswith(f"{done}.") for done in linked):
            continue  # inside a folder linked whole
        target = tree / Path(*package.split("."))
        target.parent.mkdir(parents=True, exist_ok=True)
        source = dirs[package]
        elsewhere = [
            sub
            for sub in dirs
            if sub.startswith(f"{package}.") and not dirs[sub].is_relative_to(source)
        ]
        if not elsewhere:
            target.symlink_to(source, target_is_directory=True)
            linked.append(package)
            continue
        target.mkdir()
        for entry in source.iterdir():
            if entry.name != "__pycache__":
                (target / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


def main(argv: list[str]) -> int:
    """Links the package, runs mypy on :data:`TARGETS` (and ``argv``); mypy's exit status."""
    link_tree()
    command = [sys.executable, "-m", "mypy", *TARGETS, *argv]
    env = {**os.environ, "MYPYPATH": str(TREE)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    shown = proc.stdout + proc.stderr
    deepest_first = sorted(package_dirs().items(), key=lambda item: -item[0].count("."))
    for package, path in deepest_first:
        linked = TREE.relative_to(ROOT) / Path(*package.split("."))
        shown = shown.replace(f"{linked}/", f"{path.relative_to(ROOT)}/")
    sys.stdout.write(shown)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
