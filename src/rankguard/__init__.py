"""rankguard: training callbacks that keep every rank of a distributed PyTorch job in step.

Import the callbacks from the integration for your framework::

    from rankguard.integrations.composer import RankGuard      # MosaicML Composer
    from rankguard.integrations.lightning import RankGuard     # PyTorch Lightning
    from rankguard.integrations.transformers import RankGuard  # Hugging Face Trainer
    from rankguard.integrations.torch import RankGuard         # a hand-written loop

The framework-free core (guards, errors, the side channel) is
``rankguard.callbacks``, one sub-package per concern; ``rankguard --help``
lists the command-line tools. See docs/design.md#layout.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["__version__", "integrations_available"]

try:
    __version__: str = version("rankguard")
except PackageNotFoundError:  # pragma: no cover - imported from a source tree, not installed
    __version__ = "0+unknown"

#: Subpackages loaded on first attribute access (``rankguard.callbacks``).
_SUBPACKAGES = ("callbacks", "integrations")


def integrations_available() -> list[str]:
    """The integration modules that ship with this install, e.g. ``["composer", "lightning"]``.

    Listed from the ``rankguard.integrations`` package without importing any
    training framework.
    """
    package = importlib.import_module("rankguard.integrations")
    return sorted(
        info.name
        for info in pkgutil.iter_modules(package.__path__)
        if not info.name.startswith("_") and info.name != "config"
    )


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    message = f"module {__name__!r} has no attribute {name!r}"
    if not name.startswith("_"):
        modules = ", ".join(f"rankguard.integrations.{n}" for n in integrations_available())
        message += (
            ". rankguard's callbacks come from the integration for your training framework, "
            f"e.g. `from rankguard.integrations.composer import {name}` (integrations: "
            f"{modules}); the framework-free guards are in rankguard.callbacks."
        )
    # AttributeError, as tools that look names up (jsonargparse's class paths) expect.
    raise AttributeError(message, name=name, obj=sys.modules[__name__])
