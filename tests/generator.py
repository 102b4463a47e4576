"""``docs/generate.py`` (``make docs``) as a module, loaded once for every test that reads it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "docs_generate"


def _load():
    if _NAME not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "docs" / "generate.py"
        spec = importlib.util.spec_from_file_location(_NAME, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[_NAME]


generate = _load()
