"""Which node a rank runs on: the hostname plus the launcher's node rank.

The node rank is ``NODE_RANK`` (Composer's and Lightning's launchers), else
``GROUP_RANK`` (torchrun); the local rank is ``LOCAL_RANK``. An empty variable
counts as unset. Two ranks are on the same node when both agree, so tests can
simulate several nodes on one machine by setting ``NODE_RANK`` and
``LOCAL_RANK`` per process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["NodeId", "node_identity"]


@dataclass(frozen=True)
class NodeId:
    """Which node a rank runs on.

    Attributes:
        host: ``socket.gethostname()``.
        node_rank: ``NODE_RANK`` (or ``GROUP_RANK``), or ``None`` when unset.
        local_rank: ``LOCAL_RANK``, or ``None`` when unset.
    """

    host: str
    node_rank: str | None
    local_rank: int | None

    @property
    def key(self) -> str:
        """The node's name in messages, e.g. ``"gpu-12"`` or ``"gpu-12/node1"``."""
        return self.host if self.node_rank is None else f"{self.host}/node{self.node_rank}"


def node_identity(env: Mapping[str, str] | None = None) -> NodeId:
    """Returns this process's node identity from the hostname and launcher variables."""
    env = os.environ if env is None else env
    node = env.get("NODE_RANK") or env.get("GROUP_RANK") or None
    local = env.get("LOCAL_RANK")
    return NodeId(socket.gethostname(), node, int(local) if local else None)
