"""The integrations' public classes: their settings are declared once and stay the guards'.

``rankguard/integrations/_api.py`` declares ``RankGuard``'s settings and, per guard, a
settings class whose ``__init__`` is the core guard's own; each integration module joins
them to its adapter. ``make lint`` runs mypy on ``tests/typecheck/`` (the README's
quickstart, and the mistakes it must reject).
"""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path

import pytest

from rankguard.callbacks import registry
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.hang.hang_watchdog import HangWatchdog
from rankguard.integrations import _api
from rankguard.integrations._common import class_name
from rankguard.integrations.config import FRAMEWORKS

#: Each integration's adapter, the base its public classes join the settings to.
ADAPTERS = {
    "composer": "_ComposerAdapter",
    "lightning": "_LightningAdapter",
    "olmo_core": "_OlmoCoreAdapter",
    "torch": "_LoopGuard",
    "transformers": "_TrainerAdapter",
}


def settings_class(name: str) -> type:
    """The settings class ``_api`` declares for a guard name, or for ``rank_guard``."""
    return getattr(_api, f"{class_name(name)}Settings")


def declared_params(cls: type) -> list[tuple[str, object, object, object]]:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [(p.name, p.kind, p.annotation, p.default) for p in params]


def undeclared() -> list[str]:
    """What the registry's guards take that ``_api``'s settings classes do not declare."""
    problems = []
    bundle = [p[0] for p in declared_params(_api.RankGuardSettings)]
    if bundle[1:] != list(registry.GUARDS):
        problems.append(f"RankGuard takes {bundle[1:]}, the registry has {list(registry.GUARDS)}")
    for name, guard in registry.GUARDS.items():
        settings = getattr(_api, f"{class_name(name)}Settings", None)
        if settings is None:
            problems.append(f"{name}: no {class_name(name)}Settings in _api.py")
            continue
        params = inspect.signature(guard.__init__, eval_str=True).parameters.values()
        wanted = [(p.name, p.kind, p.annotation, p.default) for p in params][1:]
        missing = [param for param in wanted if param not in declared_params(settings)]
        problems += [f"{name}: {param[0]} is not declared" for param in missing]
    return problems


def test_every_guard_of_the_registry_has_its_settings_declared_once():
    assert undeclared() == []


def test_a_setting_or_guard_the_declarations_lack_is_named(monkeypatch):
    class Wider(HangWatchdog):
        def __init__(self, *, timeout_s: float | None = None, grace_s: float = 1.5) -> None:
            super().__init__(timeout_s=timeout_s)

    class Extra(Guard):
        name = "extra_guard"

    monkeypatch.setitem(registry.GUARDS, "hang_watchdog", Wider)
    monkeypatch.setitem(registry.GUARDS, "extra_guard", Extra)
    problems = undeclared()
    assert "hang_watchdog: grace_s is not declared" in problems
    assert "extra_guard: no ExtraGuardSettings in _api.py" in problems
    assert any(p.startswith("RankGuard takes") for p in problems)


def test_each_settings_class_names_its_own_guard_to_type_checkers():
    """The decorator editors and mypy read names the guard the class builds at run time."""
    tree = ast.parse(Path(_api.__file__).read_text(encoding="utf-8"))
    named = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            (init,) = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            named[node.name] = ast.unparse(init.decorator_list[0])
    assert named == {
        "RankGuardSettings": "bundle_settings",
        **{
            f"{class_name(n)}Settings": f"guard_settings({g.__name__})"
            for n, g in registry.GUARDS.items()
        },
    }
    for name in registry.GUARDS:
        assert vars(settings_class(name).__init__)["guard"] == name


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_public_class_joins_its_settings_to_the_adapter(framework):
    module = pytest.importorskip(f"rankguard.integrations.{framework}", exc_type=ImportError)
    adapter = getattr(module, ADAPTERS[framework])
    for name in ["rank_guard", *registry.GUARDS]:
        cls = getattr(module, class_name(name))
        assert cls.__bases__ == (settings_class(name), adapter), cls
        assert pickle.loads(pickle.dumps(cls)) is cls


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_config_tools_read_the_defaults_each_class_uses(framework):
    """``inspect.signature`` (jsonargparse) shows the integration's own defaults, as built."""
    module = pytest.importorskip(f"rankguard.integrations.{framework}", exc_type=ImportError)
    defaults = getattr(module, ADAPTERS[framework]).__dict__.get("framework_defaults", {})
    for name, guard_class in registry.GUARDS.items():
        cls = getattr(module, class_name(name))
        shown = {p.name: p.default for p in inspect.signature(cls).parameters.values()}
        core = inspect.signature(guard_class).parameters.values()
        assert shown == {p.name: defaults.get(name, {}).get(p.name, p.default) for p in core}
        (guard,) = cls().runner.guards
        for key, value in defaults.get(name, {}).items():
            assert shown[key] == getattr(guard, key) == value, (name, key)
    bundle = inspect.signature(module.RankGuard).parameters
    assert list(bundle) == ["exchange_timeout_s", *registry.GUARDS]
