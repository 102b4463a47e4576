"""CheckpointPlanner: say before the first save whether a full checkpoint fits in host RAM.

Holds :class:`CheckpointPlanner`, the guard; the plan itself is in ``plan``.
See docs/checkpoint.md#how-checkpointplanner-works.
"""

from __future__ import annotations

import logging
from typing import Any

from rankguard.callbacks.checkpoint.host_memory import host_memory_available
from rankguard.callbacks.checkpoint.plan import (
    MATERIALIZE,
    MODES,
    WRITER_OVERHEAD,
    CheckpointPlan,
    RankMemory,
    plan_save,
)
from rankguard.callbacks.checkpoint.state_size import StateSize, estimate_state_size
from rankguard.callbacks.core.errors import CheckpointMemoryError
from rankguard.callbacks.core.events import EventFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.nodes import node_identity
from rankguard.callbacks.core.settings import check_choice, check_int

__all__ = ["CheckpointPlanner"]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.checkpoint_planner")


class CheckpointPlanner(Guard):
    """Checks, before the first save, that a full checkpoint fits in host memory.

    Args:
        mode: ``"warn"`` (default) logs a warning, ``"raise"`` raises
            :class:`CheckpointMemoryError`, ``"auto"`` switches the job to
            sharded saves when that fits and the adapter can switch it
            (``facts.switch_to_sharded``), else raises.
        materialize: ``"rank0"`` (default): only global rank 0 holds the full
            state; ``"every_rank"``: every local rank does.
        writer: ``"file"`` (default): ``torch.save`` to a file (Composer);
            ``"buffer"``: to an ``io.BytesIO`` first (Lightning).
        host_memory_bytes: Memory available per node, overriding what is read
            from the cgroup and ``/proc/meminfo``; ``None`` reads it.
        state_dict_type: ``"full"`` (default) or ``"sharded"``: what the job
            saves now, if the adapter does not say (``facts.state_dict_type``).

    Raises:
        ValueError: A setting out of range.
        CheckpointMemoryError: A full checkpoint would not fit in host memory (``mode="raise"``,
            or ``"auto"`` where the job cannot be switched to sharded saves).

    Attributes:
        plan: The last :class:`CheckpointPlan`, or ``None`` before it is made.
        switched: What the adapter changed to make saves sharded, if it did.

    Example::

        planner = CheckpointPlanner(mode="auto", materialize="rank0")
        # at fit start: planner.plan.action in {"ok", "warn", "switch_to_sharded"};
        # "switch_to_sharded" has been applied through facts.switch_to_sharded
    """

    name = "checkpoint_planner"

    def __init__(
        self,
        *,
        mode: str = "warn",
        materialize: str = "rank0",
        writer: str = "file",
        host_memory_bytes: int | None = None,
        state_dict_type: str = "full",
    ) -> None:
        super().__init__(on_violation="raise")
        self.mode = check_choice("mode", mode, MODES)
        self.materialize = check_choice("materialize", materialize, MATERIALIZE)
        self.writer = check_choice("writer", writer, tuple(WRITER_OVERHEAD))
        self.host_memory_bytes = (
            None
            if host_memory_bytes is None
            else check_int("host_memory_bytes", host_memory_bytes, 1, must_be="an int > 0 or None")
        )
        self.state_dict_type = check_choice("state_dict_type", state_dict_type, ("full", "sharded"))
        self.plan: CheckpointPlan | None = None
        self.switched: str | None = None

    def on_fit_start(self, facts: EventFacts) -> None:
        """Plans from the model (and optimizer) known at fit start."""
        if facts.model is not None:
            self.check(facts.model, facts.optimizer, facts)

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """Plans at the first save if fit start had no model."""
        if self.plan is None and facts.model is not None:
            self.check(facts.model, facts.optimizer, facts)

    def check(
        self, model: Any, optimizer: Any = None, facts: EventFacts | None = None
    ) -> CheckpointPlan:
        """Estimates, exchanges per-node numbers, decides, and acts on the decision.

        Args:
            model: The model (a ``torch.nn.Module``).
            optimizer: Its optimizer, if known.
            facts: The event facts (``state_dict_type``, ``switch_to_sharded``,
                ``sharded_setting``), if any.

        Returns:
            The plan, also stored in :attr:`plan`.

        Raises:
            CheckpointMemoryError: ``mode="raise"`` and a full save does not
                fit, or ``mode="auto"`` and a sharded save does not fit either
                or the job cannot be switched to it.
        """
        channel = self.channel
        try:
            size = estimate_state_size(model, optimizer, shard_world_size=channel.world_size)
        except Exception as exc:  # never fail a healthy run over an estimate
            self.warn_once("estimate", "cannot estimate the checkpoint size (%s); skipped", exc)
            size = StateSize()
        memory = host_memory_available()
        node = node_identity()
        mine = RankMemory(
            node=node.key,
            local_rank=node.local_rank or 0,
            state_bytes=size.total,
            state_sharded=size.sharded,
            available_bytes=self.host_memory_bytes or memory.available_bytes,
            source="host_memory_bytes" if self.host_memory_bytes else memory.source,
            largest_bytes=size.largest,
        )
        facts = facts or EventFacts()
        sdt = facts.state_dict_type or self.state_dict_type
        plan = channel.exchange(
            f"{self.name}/plan",
            mine,
            lambda per_rank: plan_save(
                per_rank,
                materialize=self.materialize,
                overhead=WRITER_OVERHEAD[self.writer],
                mode=self.mode,
                state_dict_type=sdt,
                switchable=facts.switch_to_sharded is not None,
                setting=facts.sharded_setting,
                host_copy=facts.save_copies_to_host,
            ),
        )
        self.plan = plan
        node = plan.node_of(channel.rank)
        if node is not None:
            sharded = plan.action == "switch_to_sharded"
            self.log_metrics(
                {
                    "rankguard/checkpoint_needed_bytes": float(
                        node.sharded_bytes if sharded else node.needed_bytes
                    ),
                    "rankguard/checkpoint_available_bytes": float(node.available_bytes or 0),
                }
            )
        self._act(plan, facts)
        return plan

    def _act(self, plan: CheckpointPlan, facts: EventFacts) -> None:
        text = f"{plan.reason}\n{plan.table()}"
        if plan.action == "ok":
            logger.info("rankguard %s: %s", self.name, text)
        elif plan.action == "raise":
            self.raise_on_every_rank(CheckpointMemoryError(text))
        elif plan.action == "switch_to_sharded" and facts.switch_to_sharded is not None:
            self.switched = facts.switch_to_sharded()
            logger.warning(
                "rankguard %s: %s Done: %s. Later saves write one shard per rank (a directory); "
                "to resume from them, set %s in the job's configuration.\n%s",
                self.name,
                plan.reason,
                self.switched,
                f"`{facts.sharded_setting}`" if facts.sharded_setting else "sharded checkpoints",
                plan.table(),
            )
        else:
            logger.warning("rankguard %s: %s", self.name, text)
