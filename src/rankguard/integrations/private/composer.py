"""Every private name of MosaicML Composer rankguard reads (see the package's docstring).

Composer's callbacks receive its ``State`` and ``Logger``, never the ``Trainer``,
and ``Trainer.__init__`` loads a checkpoint before ``State`` records which one:
what the adapter needs of the ``Trainer`` under construction is read from
``Trainer.__init__``'s frame on the call stack. And Composer calls every
callback's ``run_event`` some 13 times a batch: the adapter tests each event's
value string (an ``Enum``'s ``_value_``) inline, the one read it makes there.
``tests/integrations/test_private_composer.py`` fails if Composer changes any of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import FrameType
from typing import Any

from composer import Trainer
from composer.core import Event

__all__ = [
    "EVENT_VALUE",
    "constructing_trainer",
    "event_value",
    "resume_request",
    "trainer_init_locals",
    "trainer_load_path",
]

#: The attribute of a Composer ``Event`` (an ``Enum`` member) that ``run_event`` reads
#: inline: its value string, in the member's ``__dict__`` (``Event.value`` is a property).
EVENT_VALUE = "_value_"


def event_value(event: Event) -> str:
    """What ``event._value_`` reads: the key of ``event``'s row in ``run_event``'s table.

    Composer calls ``run_event`` some 13 times a batch, often on a cold cache; the
    member's value string, which Composer has just read and whose hash it holds, is
    the cheapest thing to look up. The public ``Event.value`` is a property (a Python
    call) and ``Event.__hash__`` is Python code, so a table keyed by members costs a call too.
    """
    return vars(event)[EVENT_VALUE]


def _trainer_init_frame() -> FrameType | None:
    """The frame of the ``Trainer.__init__`` on the call stack, or ``None``."""
    frame = inspect.currentframe()
    init = Trainer.__init__.__code__
    while frame is not None and frame.f_code is not init:
        frame = frame.f_back
    return frame


def trainer_init_locals() -> Mapping[str, Any]:
    """The local variables of the ``Trainer.__init__`` on the call stack (empty if none).

    Read from a callback's ``INIT`` or ``BEFORE_LOAD``, which ``Trainer.__init__`` fires.
    """
    frame = _trainer_init_frame()
    return frame.f_locals if frame is not None else {}


def constructing_trainer() -> Trainer | None:
    """The ``Trainer`` under construction, read at ``INIT`` (its ``__init__``'s ``self``).

    Composer's callbacks never receive the Trainer, and it has no exception event:
    the adapter wraps ``fit`` on this instance to see an error leave it.
    """
    trainer = trainer_init_locals().get("self")
    return trainer if isinstance(trainer, Trainer) else None


def trainer_load_path() -> str | None:
    """The ``load_path`` the ``Trainer`` being constructed will load, read at ``BEFORE_LOAD``.

    Composer loads the checkpoint inside ``Trainer.__init__`` and records the path
    (``State.load_path``) only after loading, so before loading it is a local
    variable of ``Trainer.__init__`` (its argument).

    Returns:
        The path, or ``None`` (no checkpoint to load, or not called from a
        ``Trainer`` under construction).
    """
    load_path = trainer_init_locals().get("load_path")
    return str(load_path) if load_path else None


def resume_request() -> tuple[str, str | None] | None:
    """How the ``Trainer`` asks for a resume, and its ``save_folder`` (read at BEFORE_LOAD).

    ``autoresume`` and ``save_folder`` are ``Trainer.__init__``'s arguments; ``State``
    keeps neither.

    Returns:
        ``("autoresume=True", save_folder)``, ``("load_path='...'", None)``, or ``None``
        (no resume asked for).
    """
    local = trainer_init_locals()
    if local.get("autoresume"):
        return "autoresume=True", local.get("save_folder")
    return (f"load_path={local['load_path']!r}", None) if local.get("load_path") else None
