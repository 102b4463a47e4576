"""DropLastGuard: loader and sampler settings agree across ranks.

Holds :class:`DropLastGuard`, the guard, and its cross-rank comparison.
See docs/data.md#how-droplastguard-works.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from rankguard.callbacks.core.errors import DropLastMismatchError
from rankguard.callbacks.core.events import EventFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.ranks import format_groups
from rankguard.callbacks.core.settings import check_choice
from rankguard.callbacks.data.loaders import (
    LoaderSettings,
    SampleAccounting,
    enforce_drop_last,
    loader_settings,
    sample_accounting,
)

__all__ = ["DropLastGuard", "settings_mismatches"]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.drop_last")

MODES = ("check", "enforce")

FIX = (
    "Fix: build every rank's loader from the same settings: the same batch_size and "
    "drop_last on the DataLoader and, for DistributedSampler, the same drop_last, "
    "shuffle and seed (num_replicas = world size)."
)


def settings_mismatches(per_rank: Mapping[int, Mapping[str, LoaderSettings]]) -> dict[str, str]:
    """Finds, per loader, the settings that differ between ranks.

    Args:
        per_rank: For each rank, the settings of each loader by name.

    Returns:
        ``{loader: "drop_last: rank 0: True; rank 1: False, ..."}`` for loaders
        with any difference; loaders missing on some ranks count as different.
    """
    names = sorted({name for settings in per_rank.values() for name in settings})
    fields = [f.name for f in dataclasses.fields(LoaderSettings)]
    mismatches: dict[str, str] = {}
    for name in names:
        parts = []
        for fname in fields:
            values = {
                rank: getattr(s[name], fname) if name in s else "<no such loader>"
                for rank, s in per_rank.items()
            }
            if len(set(values.values())) > 1:
                parts.append(f"{fname}: {format_groups(values, repr, sep=', ')}")
        if parts:
            mismatches[name] = "; ".join(parts)
    return mismatches


class DropLastGuard(Guard):
    """Checks (or enforces) consistent drop_last and sampler settings across ranks.

    Args:
        mode: ``"check"`` (default) or ``"enforce"`` (see docs/data.md#how-droplastguard-works).
        on_violation: ``"raise"`` (default) or ``"warn"`` for cross-rank differences.
        warn_eval_padding: Warn when an eval loader's sampler pads samples.

    Raises:
        ValueError: A setting out of range.
        DropLastMismatchError: Loader or sampler settings differ between ranks, or ``"enforce"``
            cannot be applied to a train loader (``on_violation="raise"``).

    Example::

        guard = DropLastGuard(mode="enforce")
    """

    name = "drop_last_guard"

    def __init__(
        self, *, mode: str = "check", on_violation: str = "raise", warn_eval_padding: bool = True
    ) -> None:
        super().__init__(on_violation=on_violation)
        self.mode = check_choice("mode", mode, MODES)
        self.warn_eval_padding = bool(warn_eval_padding)

    def on_fit_start(self, facts: EventFacts) -> None:
        """Compares settings across ranks, reports padding, enforces if asked."""
        if not facts.loaders:
            return
        settings = {lf.name: loader_settings(lf.loader) for lf in facts.loaders}
        mismatches = self.channel.exchange(f"{self.name}/fit_start", settings, settings_mismatches)
        if mismatches:
            lines = " | ".join(f"loader {name!r}: {desc}" for name, desc in mismatches.items())
            self.violation(
                DropLastMismatchError(f"Loader settings differ between ranks: {lines}. {FIX}")
            )
        for lf in facts.loaders:
            if self.mode == "enforce" and lf.is_train:
                self._enforce(lf.name, lf.loader)
                # The framework planned from the old length; what will run is the new one.
                lf.num_batches = len(lf.loader)
            accounting = sample_accounting(lf.loader)
            self._report(lf.name, lf.is_train, accounting)

    def _enforce(self, name: str, loader: object) -> None:
        if not enforce_drop_last(loader):
            raise DropLastMismatchError(
                f"DropLastGuard(mode='enforce') cannot give train loader {name!r} "
                f"({type(loader).__name__}) drop_last semantics from a callback. Fix: build it "
                "with DataLoader(..., drop_last=True) and DistributedSampler(..., "
                "drop_last=True), or make its iterable yield the same number of full batches "
                "on every rank."
            )
        logger.info("rankguard %s: train loader %r now drops partial batches", self.name, name)

    def _report(self, name: str, is_train: bool, acc: SampleAccounting) -> None:
        if acc.samples is None:
            return
        logger.info(
            "rankguard %s: loader %r on rank %d: %d of %s samples, %d padded, %d dropped "
            "by the sampler, %d dropped by drop_last, last batch %s",
            self.name,
            name,
            self.channel.rank,
            acc.samples,
            acc.dataset_len,
            acc.padded,
            acc.dropped_by_sampler,
            acc.dropped_by_loader,
            acc.last_batch or "full",
        )
        if acc.padded and not is_train and self.warn_eval_padding:
            self.warn_once(
                f"padding/{name}",
                "eval loader %r: the DistributedSampler repeats %d sample(s) so that %d ranks "
                "get equal shares of %s samples; eval metrics count them twice. Fix: make the "
                "eval dataset length a multiple of the world size, or pass "
                "`warn_eval_padding=False` if repeated samples are acceptable.",
                name,
                acc.padded,
                self.channel.world_size,
                acc.dataset_len,
            )
