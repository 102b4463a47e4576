"""The integrations' public classes are written out from the registry, and stay so.

``tools/generate_api.py`` writes ``RankGuard`` and one class per guard into every
integration module, with their settings in their signatures for editors and type
checkers (``make lint`` runs mypy on ``tests/typecheck/quickstart.py``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from rankguard.callbacks import registry
from rankguard.callbacks.hang.hang_watchdog import HangWatchdog
from rankguard.integrations._common import class_name

ROOT = Path(__file__).resolve().parents[2]
RUN_AGAIN = "run `.venv/bin/python tools/generate_api.py`"


def _load():
    name = "tools_generate_api"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "generate_api.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass looks its module up
        spec.loader.exec_module(module)
    return sys.modules[name]


generate_api = _load()


def test_every_integration_module_holds_the_classes_the_registry_makes():
    assert generate_api.stale() == [], RUN_AGAIN


def test_a_changed_guard_setting_makes_every_integration_module_stale(monkeypatch):
    class Wider(HangWatchdog):
        def __init__(self, *, timeout_s: float | None = None, grace_s: float = 1.5) -> None:
            super().__init__(timeout_s=timeout_s)

    monkeypatch.setitem(registry.GUARDS, "hang_watchdog", Wider)
    assert generate_api.stale() == list(generate_api.INTEGRATIONS)
    assert "        grace_s: float = 1.5,\n" in generate_api.rendered("composer")


def _declared(init: ast.FunctionDef) -> list[tuple[str, object]]:
    """The parameters of a written ``__init__`` after ``self``, with their defaults."""
    args = init.args  # every parameter but self has a default
    names = [a.arg for a in [*args.args[1:], *args.kwonlyargs]]
    defaults = [ast.literal_eval(d) for d in [*args.defaults, *args.kw_defaults]]
    return list(zip(names, defaults, strict=True))


@pytest.mark.parametrize("integration", list(generate_api.INTEGRATIONS))
def test_what_an_editor_shows_is_what_config_tools_read(integration):
    """The signatures in the source (editors, mypy) are ``inspect.signature``'s (jsonargparse)."""
    module = importlib.import_module(f"rankguard.integrations.{integration}")
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for name in ["RankGuard", *map(class_name, registry.GUARDS)]:
        (init,) = [node for node in classes[name].body if isinstance(node, ast.FunctionDef)]
        shown = inspect.signature(getattr(module, name)).parameters.values()
        assert _declared(init) == [(p.name, p.default) for p in shown], name
