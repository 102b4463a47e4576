"""What both adapters share: building guards from callback arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rankguard.callbacks.guard import Guard
from rankguard.callbacks.registry import GUARDS, build_guard, build_guards

__all__ = ["bundle_guards", "single_guard"]


def bundle_guards(per_guard_config: Mapping[str, Mapping[str, Any] | bool | None]) -> list[Guard]:
    """The guards of a ``RankGuard`` callback (every guard unless disabled)."""
    return build_guards(per_guard_config)


def single_guard(name: str, settings: Mapping[str, Any]) -> list[Guard]:
    """The one guard of a single-guard callback such as ``BatchParityGuard``."""
    return [build_guard(GUARDS[name], settings)]
