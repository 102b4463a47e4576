"""Checks of the settings a guard is built with; each raises ``ValueError`` naming the setting.

Every message has the form ``"`<name>` must be <what>; got <value>."``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["check_choice", "check_fraction", "check_int", "check_positive", "check_seconds"]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Returns ``value`` if it is one of ``choices``, else raises ``ValueError`` naming ``name``."""
    choices = tuple(choices)
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {valid}; got {value!r}.")
    return value


def check_int(name: str, value: Any, minimum: int = 1, *, must_be: str | None = None) -> int:
    """Returns ``value`` if it is an int (not a bool) >= ``minimum``, else raises ``ValueError``.

    Args:
        name: The setting, named in the message.
        value: What was given.
        minimum: The smallest value allowed.
        must_be: What the message says the setting must be (default
            ``"an integer >= <minimum>"``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = must_be or f"an integer >= {minimum}"
        raise ValueError(f"`{name}` must be {what}; got {value!r}.")
    return value


def check_positive(name: str, value: Any) -> float:
    """Returns ``value`` as a float if it is a number > 0, else raises ``ValueError`` naming it."""
    if not _number(value) or not value > 0:
        raise ValueError(f"`{name}` must be a number > 0 (seconds); got {value!r}.")
    return float(value)


def check_seconds(name: str, value: Any) -> float:
    """Returns ``value`` as a float if it is a number >= 0, else raises ``ValueError`` naming it."""
    if not _number(value) or value < 0:
        raise ValueError(f"`{name}` must be a number of seconds >= 0; got {value!r}.")
    return float(value)


def check_fraction(name: str, value: Any, *, one: bool) -> float:
    """Returns ``value`` as a float if it is a number in (0, 1), or (0, 1] with ``one``."""
    if not _number(value) or not (0 < value <= 1 if one else 0 < value < 1):
        raise ValueError(f"`{name}` must be a number in (0, 1{']' if one else ')'}; got {value!r}.")
    return float(value)
