"""``make lint``'s type check: mypy over the public surface.

Runs mypy with the settings of ``[tool.mypy]`` in ``pyproject.toml``
(``mypy_path = "src"``: the package as a wheel lays it out) on
:data:`TARGETS`: the README's quickstart for every integration
(``tests/typecheck/quickstart.py``), the mistakes it must reject
(``tests/typecheck/mistakes.py``), the integration modules and the one
declaration of their public classes' settings (``_api.py``).

Usage::

    .venv/bin/python tools/typecheck.py [extra mypy arguments or files]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The integrations whose public modules are checked (not ``config``, nor ``_*`` helpers).
INTEGRATIONS = ("composer", "lightning", "olmo_core", "torch", "transformers")
TARGETS = [
    "tests/typecheck/quickstart.py",
    "tests/typecheck/mistakes.py",
    "src/rankguard/integrations/_api.py",
    # an integration is a module or a package of its own
    *[
        f"src/rankguard/integrations/{name}"
        + ("" if (ROOT / "src/rankguard/integrations" / name).is_dir() else ".py")
        for name in INTEGRATIONS
    ],
]


def main(argv: list[str]) -> int:
    """Runs mypy on :data:`TARGETS` (and ``argv``); mypy's exit status."""
    return subprocess.run([sys.executable, "-m", "mypy", *TARGETS, *argv], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
