"""Building rankguard callbacks from plain (YAML or dict) configs.

The names are the ones llm-foundry's ``callbacks:`` section and this
function both use: ``rank_guard`` for the bundle and each guard's snake-case
name (``batch_parity_guard``, ...). Values are the callback's keyword
arguments.

Example::

    callbacks = build_callbacks(
        {"rank_guard": {"hang_watchdog": {"timeout_s": 600}}}, framework="composer"
    )
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from rankguard.callbacks.registry import GUARDS, unknown_name_error
from rankguard.integrations._common import class_name

__all__ = ["CALLBACK_NAMES", "FRAMEWORKS", "build_callbacks", "callback_class"]

#: The integration modules that build callbacks (``torch``: guards for a hand-written loop).
FRAMEWORKS = ("composer", "lightning", "olmo_core", "torch", "transformers")

#: Config name -> class name in each integration module.
CALLBACK_NAMES: dict[str, str] = {
    "rank_guard": "RankGuard",
    **{name: class_name(name) for name in GUARDS},
}


def callback_class(name: str, framework: str) -> type:
    """The callback class for a config name in ``framework`` (one of :data:`FRAMEWORKS`).

    Raises:
        ValueError: Unknown framework or name (lists the valid ones, suggests the closest).
    """
    if framework not in FRAMEWORKS:
        raise unknown_name_error("framework", framework, list(FRAMEWORKS))
    if name not in CALLBACK_NAMES:
        raise unknown_name_error("rankguard callback", name, list(CALLBACK_NAMES))
    module = importlib.import_module(f"rankguard.integrations.{framework}")
    return getattr(module, CALLBACK_NAMES[name])


def build_callbacks(config: Mapping[str, Mapping[str, Any] | None], framework: str) -> list[Any]:
    """Builds callbacks from ``{name: kwargs}``, in the config's order.

    Args:
        config: Callback names (``rank_guard`` or a guard name) to their
            keyword arguments (``None`` or ``{}`` for the defaults).
        framework: ``"composer"``, ``"lightning"``, ``"transformers"`` (the Hugging Face
            Trainer), ``"olmo_core"`` (OLMo-core's Trainer) or ``"torch"`` (a hand-written
            loop: ``callback.fit(...)``).

    Returns:
        The callback objects, ready for ``Trainer(callbacks=...)`` (or, for ``"torch"``,
        the loop's guards).

    Raises:
        ValueError: An unknown framework, callback name or setting.
    """
    if framework not in FRAMEWORKS:
        raise unknown_name_error("framework", framework, list(FRAMEWORKS))
    callbacks = []
    for name, kwargs in config.items():
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValueError(f"`{name}` must map to a dict of settings; got {kwargs!r}.")
        callbacks.append(callback_class(name, framework)(**(kwargs or {})))
    return callbacks
