"""ResumeGuard: every rank resumes alike, checked before the first resumed step.

The same checkpoint and step on every rank, with each rank's own data position and
random state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from rankguard.callbacks.core.errors import ResumeMismatchError
from rankguard.callbacks.core.events import EventFacts, ResumeFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.nodes import node_identity
from rankguard.callbacks.resume.position import (
    brief,
    checkpoint_identity,
    digest,
    loader_positions,
    rng_digests,
    sibling_checkpoints,
)
from rankguard.callbacks.resume.verdict import RankResume, ResumeVerdict, judge

__all__ = ["ResumeGuard", "rank_resume"]

logger = logging.getLogger("rankguard.callbacks.resume")


class ResumeGuard(Guard):
    """Checks that every rank resumed alike, before the first resumed step.

    A restart is where ranks silently fall out of step: each resolves "the latest
    checkpoint" on its own disk, and restores its own loader position and random
    state, or rank 0's. Where the job asked for a resume (``ckpt_path=``,
    ``resume_from_checkpoint=``, Composer's ``autoresume`` or ``load_path``,
    OLMo-core's load, the loop's ``guard.resumed``), every rank sends, once the
    framework restored everything and before the first train batch, what it
    loaded (the checkpoint as resolved, a size), its counters after the load, a
    digest of each data position (a stateful loader's, its dataset's or sampler's
    ``state_dict``, the sampler's epoch) and of each random generator's state.

    It raises, before the first resumed step, when ranks loaded different
    checkpoints (naming what each node sees in the checkpoint folder: a
    node-local or lagging copy), when some found none, when the counters differ,
    or when a data position lost the pattern it had at the save (one rank's
    position restored on every rank, or positions that matched no longer do). It
    warns when a random generator's pattern (alike or different across ranks)
    is not what the save, or where the framework does not restore random states
    this run's start, had. Patterns, not values, are compared: a job that seeds
    or shards per rank on purpose is not an alarm.

    The pattern at the save is recorded at each save (one exchange) and kept in
    the guard's checkpoint state: a checkpoint saved without it is checked for
    checkpoints and counters only.

    Args:
        on_violation: ``"raise"`` (default) or ``"warn"``.
        timeout_s: How long an exchange waits for every rank (scaled with the
            world size).
    """

    name = "resume_guard"

    def __init__(self, *, on_violation: str = "raise", timeout_s: float = 300.0) -> None:
        super().__init__(on_violation=on_violation)
        self.timeout_s = float(timeout_s)
        self._train_loader: Any = None
        self._rng_start: dict[str, str] = {}
        self._saved: dict[str, list[str]] = {}  # this fit's last save
        self._loaded: dict[str, list[str]] = {}  # the resumed checkpoint's
        self.verdict: ResumeVerdict | None = None

    def on_fit_start(self, facts: EventFacts) -> None:
        """Records the train loader and the random states at the fit's start."""
        train = next((lf for lf in facts.loaders if lf.is_train), None)
        self._train_loader = train.loader if train and train.read_by_each_rank else None
        self._rng_start = rng_digests()
        self._saved = {}

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """Records each rank's data positions and random states, to keep with the save."""
        if not self.channel.is_distributed:
            return
        states = _position_states(self._train_loader, facts.positions)
        mine = {f"data/{k}": digest(v) for k, v in states.items()}
        mine.update({f"rng/{g}": d for g, d in rng_digests().items()})
        # Every rank's digests stay on the deciding rank, the one whose copy the resume
        # check reads (see on_resumed): sent to every rank they would make each save's
        # exchange grow with the square of the world size (12 GB at 16,384 ranks).
        kept: list[dict[str, list[str]]] = []

        def keep(per_rank: Mapping[int, Mapping[str, str]]) -> int:
            kept.append(_columns(per_rank))
            return len(per_rank)

        self.channel.exchange(f"{self.name}/save", mine, keep, timeout_s=self.timeout_s)
        self._saved = kept[0] if kept else {}

    def on_resumed(self, facts: EventFacts) -> None:
        """Compares every rank's resume; raises (or warns) before the first resumed step."""
        if facts.resume is None or not self.channel.is_distributed:
            return
        # Every rank's digests at the save, for every rank: the deciding rank's copy is the
        # one the decision reads, so the others send none (O(world) bytes each, not O(world²)).
        saved = self._loaded if self.channel.is_leader else {}
        mine = rank_resume(facts.resume, self._rng_start, saved)
        self._loaded = {}
        self.verdict = verdict = self.channel.exchange(
            f"{self.name}/resumed", mine, judge, timeout_s=self.timeout_s
        )
        for warning in verdict.warnings:
            self.warn_once(warning.split(" random state", 1)[0], warning)
        if verdict.error:
            self.violation(ResumeMismatchError(verdict.error))

    def state_dict(self) -> dict[str, Any]:
        """Each rank's data-position and random-state digests at the last save (rank 0's).

        Rank 0 keeps them; the other ranks' state is empty (the resume check reads rank
        0's copy, however the framework saves and loads the state).
        """
        return {"saved": self._saved} if self._saved else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Takes the digests the resumed checkpoint was saved with."""
        saved = state.get("saved") if isinstance(state, Mapping) else None
        if not isinstance(saved, Mapping):
            saved = {}
        self._loaded = {str(k): list(v) for k, v in saved.items()}

    def close(self) -> None:
        """Forgets the fit's loader (a later fit records its own)."""
        self._train_loader = None


def _columns(per_rank: Mapping[int, Mapping[str, str]]) -> dict[str, list[str]]:
    """Per key, every rank's value in rank order (keys every rank sent)."""
    ranks = sorted(per_rank)
    keys = set.intersection(*(set(per_rank[r]) for r in ranks))
    return {k: [per_rank[r][k] for r in ranks] for k in sorted(keys)}


def _position_states(loader: Any, extra: Mapping[str, Any]) -> dict[str, Any]:
    """Every data position by name: the train loader's, then the framework's own."""
    states = {f"train {where}": state for where, state in loader_positions(loader).items()}
    states.update(extra)
    return states


def rank_resume(
    resume: ResumeFacts, rng_start: Mapping[str, str], saved: Mapping[str, list[str]]
) -> RankResume:
    """What this rank sends to the resume check (``saved``: only the deciding rank's is read)."""
    checkpoint = os.fspath(resume.checkpoint) if resume.checkpoint is not None else None
    local = checkpoint is not None and "://" not in checkpoint
    folder = resume.folder or (os.path.dirname(checkpoint.rstrip("/")) if checkpoint else None)
    states = _position_states(resume.loader, resume.positions)
    return RankResume(
        node=node_identity().key,
        asked=resume.asked,
        checkpoint=checkpoint,
        identity=checkpoint_identity(checkpoint) if local else None,
        folder=folder,
        seen=sibling_checkpoints(folder, checkpoint if local else None),
        counters={k: int(v) for k, v in resume.counters.items()},
        positions={k: digest(v) for k, v in states.items()},
        position_text={k: brief(v) for k, v in states.items()},
        rng=rng_digests(),
        rng_start=dict(rng_start),
        saved=dict(saved),
        restores_rng=resume.restores_rng,
        fix=resume.fix,
        data_fix=resume.data_fix,
    )
