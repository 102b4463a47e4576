"""The side channel: every cross-rank exchange rankguard makes goes through here.

Holds :class:`SideChannel`, :func:`scaled_timeout` and :func:`own_missing_ranks`.
See docs/scale.md#the-side-channel-exchanges-on-the-store.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

from rankguard.callbacks.core import torch_private
from rankguard.callbacks.core.errors import RanksMissingError
from rankguard.callbacks.core.ranks import rank_label, rank_runs
from rankguard.callbacks.core.store_health import TIMED_REQUESTS, store_health

__all__ = [
    "CHECK_EACH_UP_TO",
    "PER_RANK_WAIT_S",
    "POLLS_PER_S",
    "STORE_TRIPS",
    "MissingOwner",
    "SideChannel",
    "cyclic_gc_paused",
    "default_store",
    "in_transit_s",
    "notices",
    "notify",
    "own_missing_ranks",
    "scaled_timeout",
    "spread_period",
]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.side_channel")

T = TypeVar("T")

_LEADER = 0

#: Added to an exchange's timeout per rank in the world (see :func:`scaled_timeout`).
PER_RANK_WAIT_S = 0.005
#: A rank that gets no verdict names the ranks whose payload is absent up to this world
#: size; beyond, the deciding rank alone (see ``SideChannel._missing_without_verdict``).
CHECK_EACH_UP_TO = 64
_channels_created = 0
_channels_lock = threading.Lock()
#: Connections to the store opened again in this process (see ``_ThreadClient``).
_reconnects = 0

#: Sees a :class:`RanksMissingError` before the exchange raises it (see :func:`own_missing_ranks`).
MissingOwner = Callable[[RanksMissingError], None]
_missing_owner: list[MissingOwner] = []


def own_missing_ranks(owner: MissingOwner) -> Callable[[], None]:
    """Makes ``owner`` the one handler of ranks missing from any exchange in this process.

    Before an exchange raises :class:`RanksMissingError` it calls ``owner``
    with the error, on the thread that called the exchange; the owner may
    raise an error of its own instead, or end the process, or return to let
    the exchange raise as usual. The HangWatchdog owns missing ranks while
    its thread runs.

    Args:
        owner: The handler; it replaces any earlier one.

    Returns:
        A function that removes ``owner`` again (if it is still the owner).
    """
    _missing_owner[:] = [owner]

    def release() -> None:
        if _missing_owner and _missing_owner[0] == owner:
            _missing_owner.clear()

    return release


@dataclass(frozen=True)
class _Missing:
    """Verdict published when some ranks did not arrive in time."""

    ranks: list[int]

    def __reduce__(self) -> tuple:
        # Every rank reads it: as runs, whole nodes missing cost a few bytes, not a list.
        return (_missing_from_runs, (rank_runs(self.ranks),))


def _missing_from_runs(runs: tuple[tuple[int, int], ...]) -> _Missing:
    return _Missing([r for first, last in runs for r in range(first, last + 1)])


#: What a non-deciding rank gets when no verdict came in time.
_NO_VERDICT = object()


@dataclass(frozen=True)
class _Failed:
    """Verdict published when ``decide`` itself raised on the deciding rank."""

    message: str


@dataclass(frozen=True)
class _Waiting:
    """How one exchange waits: until when (``time.monotonic``), and what it does meanwhile."""

    until: float
    meanwhile: Callable[[], None] | None
    every_s: float


#: Round trips to the store that an exchange's wait allows for beyond its timeout (see
#: :func:`in_transit_s`): the verdict before reaches a peer, the peer's payload the store,
#: and the deciding rank's read comes back.
STORE_TRIPS = 3


def in_transit_s(timeout_s: float) -> float:
    """What an exchange waits beyond ``timeout_s`` for its messages' time in the store's hands.

    A timeout counts the peers' time, not the store's: on a congested store host each
    request takes its round trip, so a peer's payload reaches the store that much later
    and the deciding rank's read comes back that much later again. The wait allows
    :data:`STORE_TRIPS` of this process's last measured round trips
    (:meth:`~rankguard.callbacks.core.store_health.StoreHealth.round_trip_s`): nothing
    on a healthy store (well under a millisecond), at most ``timeout_s`` more on a slow
    one, so a store that stopped answering is still found.
    """
    return min(STORE_TRIPS * store_health.round_trip_s(), timeout_s)


def scaled_timeout(timeout_s: float, world_size: int) -> float:
    """The time the deciding rank waits for an exchange at ``world_size`` ranks.

    ``timeout_s`` is what a small job needs; each rank adds
    :data:`PER_RANK_WAIT_S`, 5 ms, more than ten times the deciding rank's
    measured work per rank (``benchmarks/scale.py``): 20 s more at 4096 ranks.

    Args:
        timeout_s: The configured timeout (seconds).
        world_size: Ranks taking part.

    Returns:
        The timeout in seconds.
    """
    return timeout_s + PER_RANK_WAIT_S * world_size


#: Store requests a second that the polls of every rank together may make (see
#: :func:`spread_period`): every wake up to 512 ranks, every 16 s at 16,384. A request
#: one at a time costs the store's thread 5-30 us (docs/scale.md): 1024 a second, 1-3%.
POLLS_PER_S = 1024.0


def spread_period(period_s: float, world_size: int, per_s: float) -> float:
    """``period_s``, or longer where ``world_size`` ranks would make more than ``per_s`` requests.

    Each rank makes one request every period: together ``world_size / period_s`` a second,
    all served by the store's one thread. Up to ``per_s * period_s`` ranks the period is
    the one asked for; beyond, it grows with the world size so that the job's total
    stays at ``per_s`` (the first ranks' behaviour does not change).

    Args:
        period_s: The period a small job uses (seconds).
        world_size: Ranks making the request.
        per_s: The job-wide requests a second the store may spend on it.

    Returns:
        The period in seconds.
    """
    return max(period_s, world_size / per_s)


def _notices_key(channel: Any) -> str:
    return f"{channel.prefix}/notices"


def notify(channel: Any) -> None:
    """Says on ``channel``'s store that something was published (a fault, a stop request).

    One counter for everything a rank's watchdog polls for: it reads it with one request
    (:func:`notices`) and reads the rest only once it changed. Call it after what it
    announces is written.
    """
    channel.store.add(_notices_key(channel), 1)


def notices(channel: Any) -> int:
    """How many times :func:`notify` was called on ``channel`` so far (one store request)."""
    return int(channel.store.add(_notices_key(channel), 0))


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector while the deciding rank reads and decides.

    Reading 16,384 payloads and deciding allocates some 10^5 containers while the
    payloads are alive: each full collection the allocations trigger walks all of them,
    so with the collector on, the work grows with the square of the world size (the
    stall verdict: 0.24 s at 4,096 ranks, 2.4 s at 16,384; paused, 0.27 and 1.1 s).
    What is freed meanwhile is freed by reference counts; the collector runs again
    after. Nested and concurrent pauses (the status and the interval exchange on one
    rank) keep it paused until the last ends; a collector the user turned off stays off.
    """
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def _TCPStore() -> type:
    from torch.distributed import TCPStore

    return TCPStore


def _unwrap(store: Any) -> Any:
    """The store under any ``PrefixStore`` layers: every thread's client sees the same keys."""
    from torch.distributed import PrefixStore

    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def _dropped(exc: BaseException) -> bool:
    """Whether ``exc`` says a store client's connection is gone (not a timeout, not a key)."""
    return type(exc).__name__ == "DistNetworkError"


class StoreGoneError(RuntimeError):
    """Nothing listens where the store was: the process that hosted it has ended."""


#: How long a look at the store's port may take before a client connects (a refusal is
#: at once; a host that does not answer is the client's own timeout to wait out).
PROBE_S = 2.0


def _check_listening(address: tuple[str, int]) -> None:
    """Raises :class:`StoreGoneError` where the store's port refuses connections.

    A TCPStore client's connect retries a refused port until its timeout (a minute here),
    so a thread that opens a client to a store whose host died (rank 0, under Composer's
    or Lightning's launcher) would wait that minute: to tell the others this rank raised,
    or to close. A refusal means nobody listens there; the server itself is left alone.
    """
    try:
        socket.create_connection(address, timeout=PROBE_S).close()
    except ConnectionRefusedError as exc:
        raise StoreGoneError(
            f"the store at {address[0]}:{address[1]} refuses connections: the process "
            "that hosted it has ended"
        ) from exc
    except OSError:
        pass  # unreachable or slow: the client's own connect says what it says


#: Requests the store does not answer (``TCPStore``'s protocol).
_UNANSWERED = frozenset(("set", "multi_set"))


class _ThreadClient:
    """One thread's TCPStore client that connects again once its connection dropped.

    A TCPStore client never reconnects: after its connection dropped (a network fault,
    a proxy or a firewall that ended it) every request fails. Here a request that
    failed so is sent once more on a new connection (the requests rankguard makes
    are idempotent: a set, a read, a wait, a delete, a counter it only compares). The
    store answers no set, so a set sent into a connection that had already dropped
    reports no error: the sets sent since the last answer go again on the new one. A
    store that is gone fails the new connection too, and that error is raised. The
    first time in a process it says so at WARNING, then at DEBUG.

    A store whose port refuses connections is gone: :class:`StoreGoneError` at once,
    before a client would retry the refusal for its whole timeout. The look costs one
    connection opened and closed per thread's client (about three a rank): a client
    that first tried within a shorter timeout took 3.6-5.1 s to give up on a refused port
    (torch 2.13 and 2.7, backing off between tries), for each thread, which ended a job
    whose store died with rank 0 in 18 s instead of 1.4 s.

    Args:
        connect: Opens a new client (with the channel's timeout).
        address: The store's host and port.
    """

    def __init__(self, connect: Callable[[], Any], address: tuple[str, int]) -> None:
        self._connect = connect
        self._address = address
        _check_listening(address)
        self._client = connect()
        self._timeout: timedelta | None = None
        #: Sets sent since the last answer: the store does not answer a set, so one sent
        #: into a connection that had dropped is lost unless sent again.
        self._unanswered: list[tuple[str, tuple, dict]] = []

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the client's timeout; a new connection gets it too."""
        self._timeout = timeout
        self._client.set_timeout(timeout)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        timed = name in TIMED_REQUESTS

        def request(*args: Any, **kwargs: Any) -> Any:
            started = store_health.begin() if timed else 0.0
            try:
                result = getattr(self._client, name)(*args, **kwargs)
            except RuntimeError as exc:
                if not _dropped(exc):
                    raise
                self._reopen(exc)
                result = getattr(self._client, name)(*args, **kwargs)
            finally:
                if timed:
                    store_health.end(started)
            if name in _UNANSWERED:
                self._unanswered.append((name, args, kwargs))
            else:  # answered in order: every set before it reached the store
                self._unanswered.clear()
            return result

        return request

    def _reopen(self, exc: RuntimeError) -> None:
        _check_listening(self._address)
        self._client = self._connect()
        if self._timeout is not None:
            self._client.set_timeout(self._timeout)
        for name, args, kwargs in self._unanswered:
            getattr(self._client, name)(*args, **kwargs)
        global _reconnects
        with _channels_lock:
            _reconnects += 1
            first = _reconnects == 1
        (logger.warning if first else logger.debug)(
            "rankguard: this rank's connection to the store dropped (%s: %s); connected again",
            type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "",
        )


def default_store() -> Any:
    """Returns the key-value store of the default process group (``torch_private``)."""
    return torch_private.default_store()


class SideChannel:
    """Bounded, rank-naming exchanges of small Python objects between ranks.

    Args:
        store: A ``torch.distributed.Store`` every rank can reach, or ``None``
            for a local (single-rank) channel.
        rank: This process's global rank.
        world_size: Number of ranks taking part.
        timeout_s: Default time the deciding rank waits for every rank, before
            scaling with the world size (:func:`scaled_timeout`).
        prefix: Key prefix; channels with different prefixes never collide.

    Attributes:
        exchanges: Exchanges this rank has taken part in.
        bytes_sent: Payload bytes this rank wrote to the store.
        bytes_received: Payload and verdict bytes this rank read from the store.
        decide_s: Time the deciding rank spent reading payloads and deciding.

    Example::

        channel = SideChannel.from_environment(timeout_s=60)
        counts = channel.all_gather("eval_batches", 12)   # {0: 12, 1: 12}
    """

    def __init__(
        self,
        store: Any | None,
        *,
        rank: int = 0,
        world_size: int = 1,
        timeout_s: float = 60.0,
        prefix: str = "rankguard",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"`timeout_s` must be > 0, got {timeout_s!r}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"`rank` must be in [0, world_size={world_size}), got {rank!r}.")
        self._root = _unwrap(store) if world_size > 1 else None
        # A TCPStore gets a client per thread (see `store`); any other store is shared.
        self._per_thread = self._root is not None and isinstance(self._root, _TCPStore())
        self._local = threading.local()
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.prefix = prefix
        self._seq: dict[str, int] = {}
        #: Per exchange name, the verdict keys the deciding rank has not deleted yet.
        self._verdicts: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self.exchanges = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.decide_s = 0.0

    @classmethod
    def from_environment(cls, *, timeout_s: float = 60.0, name: str = "rankguard") -> SideChannel:
        """Builds a channel over the initialised default process group's store.

        Every rank must create its channels in the same order (each gets the
        next generation number in its prefix, so two channels never share keys);
        under torchrun the prefix also holds the restart attempt.

        Args:
            timeout_s: Default time the deciding rank waits for every rank.
            name: First part of the key prefix.

        Returns:
            A channel; a local one at world size 1 or without ``torch.distributed``.
        """
        global _channels_created
        with _channels_lock:
            _channels_created += 1
            generation = _channels_created
        # torchrun may keep one store across restarts of the workers, isolating each
        # attempt by a key prefix this channel looks past (see `_unwrap`): keep its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
        prefix = f"{name}/attempt{attempt}/{generation}" if attempt else f"{name}/{generation}"
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(None, timeout_s=timeout_s, prefix=prefix)
        return cls(
            default_store(),
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            timeout_s=timeout_s,
            prefix=prefix,
        )

    @property
    def store(self) -> Any | None:
        """This thread's store client (``None`` for a local channel).

        A TCPStore client is one socket: a blocking ``wait`` on one thread
        stalls every other thread's request on it (the watchdog thread waits
        while the main thread checks). So each thread gets its own connection
        to the same server, opened again when it drops (:class:`_ThreadClient`); other
        stores are shared.
        """
        if not self._per_thread:
            return self._root
        client = getattr(self._local, "client", None)
        if client is None:
            root = self._root
            client = _ThreadClient(
                partial(
                    _TCPStore(),
                    root.host,
                    root.port,
                    is_master=False,
                    timeout=timedelta(seconds=max(60.0, 2 * self.timeout_s)),
                    wait_for_workers=False,
                ),
                (root.host, root.port),
            )
            self._local.client = client
        return client

    @property
    def is_distributed(self) -> bool:
        """Whether exchanges cross process boundaries."""
        return self._root is not None

    @property
    def is_leader(self) -> bool:
        """Whether this rank decides exchanges."""
        return self.rank == _LEADER

    def exchange(
        self,
        name: str,
        payload: Any,
        decide: Callable[[Mapping[int, Any]], T],
        *,
        timeout_s: float | None = None,
        meanwhile: Callable[[], None] | None = None,
        every_s: float = 0.5,
    ) -> T:
        """Sends ``payload`` to the deciding rank and returns its verdict.

        Every rank must call ``exchange`` with the same ``name`` the same
        number of times; calls are matched by (name, call count).

        Args:
            name: What is exchanged, e.g. ``"batch_parity/eval_start/val"``.
            payload: A small picklable object.
            decide: Pure function from the payload of every rank to the
                verdict; runs on the deciding rank only.
            timeout_s: How long the deciding rank waits for the others
                (default: the channel's ``timeout_s``), scaled with the world
                size by :func:`scaled_timeout`, plus the store's measured round
                trips (:func:`in_transit_s`). The others wait a little longer for
                the verdict.
            meanwhile: Called every ``every_s`` seconds while this rank waits (for the
                others' payloads, or for the verdict); an exception it raises ends the
                wait and leaves the exchange. ``None``: one wait, one request.
            every_s: How often ``meanwhile`` is called: each call re-sends the wait (one
                request), so callers at scale pass a period spread over the world.

        Returns:
            ``decide``'s result, the same object value on every rank.

        Raises:
            RanksMissingError: Some ranks did not arrive within the timeout;
                the error names them. The owner of missing ranks
                (:func:`own_missing_ranks`) sees it first and may raise its own.
        """
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            self.exchanges += 1
            seq = self._seq.get(name, 0)
            self._seq[name] = seq + 1
        if self._root is None:
            return decide({self.rank: payload})
        configured = timeout
        timeout = scaled_timeout(timeout, self.world_size) + in_transit_s(timeout)
        base = f"{self.prefix}/{name}/{seq}"
        verdict_key = f"{base}/verdict"
        waiting = _Waiting(time.monotonic() + timeout, meanwhile, every_s)
        if self.is_leader:  # its own payload never goes through the store
            verdict: Any = self._decide(base, payload, decide, waiting)
            self._set(verdict_key, verdict)
            self._forget_verdicts(name, verdict_key, everyone=not isinstance(verdict, _Missing))
        else:
            self._set(f"{base}/r{self.rank}", payload)
            verdict = self._await_verdict(base, verdict_key, waiting)
            if verdict is not _NO_VERDICT:
                # Each rank removes its own payload (the deciding rank has read it by now),
                # so the deciding rank makes no per-rank request.
                self._delete(f"{base}/r{self.rank}")
            else:  # payloads stay: the others tell the missing ranks by their absence
                verdict = self._missing_without_verdict(base)
        if isinstance(verdict, _Missing):
            error = self._missing_error(name, verdict.ranks, configured)
            for owner in tuple(_missing_owner):
                owner(error)  # may raise its own error instead
            raise error
        if isinstance(verdict, _Failed):
            raise RuntimeError(f"rankguard exchange {name!r} failed on rank 0: {verdict.message}")
        return verdict

    def all_gather(self, name: str, payload: T, *, timeout_s: float | None = None) -> dict[int, T]:
        """Returns every rank's payload, keyed by rank (O(world size) on every rank)."""
        return self.exchange(name, payload, dict, timeout_s=timeout_s)

    def broadcast(self, name: str, payload: T, *, timeout_s: float | None = None) -> T:
        """Returns rank 0's payload on every rank."""
        return self.exchange(name, payload, lambda values: values[_LEADER], timeout_s=timeout_s)

    def barrier(self, name: str, *, timeout_s: float | None = None) -> None:
        """Waits until every rank arrives; names the ranks that did not."""
        self.exchange(name, None, lambda values: None, timeout_s=timeout_s)

    def _forget_verdicts(self, name: str, verdict_key: str, everyone: bool) -> None:
        """Deletes the earlier verdicts of ``name`` once ``everyone`` sent this one's payload.

        A rank sends an exchange's payload only after it has read the verdict of the
        one before of the same name, so then no rank can still need the earlier ones:
        the deciding rank deletes them, one request an exchange and none from the
        others. The last verdict of each name stays in the store (a few bytes).
        """
        left = self._verdicts.setdefault(name, [])
        if everyone and left:
            self._delete(*left)
            left.clear()
        left.append(verdict_key)

    def _wait_read(self, keys: list[str], waiting: _Waiting) -> list[bytes] | None:
        """Every key's value once all exist, or ``None`` at ``waiting``'s deadline.

        Where ``waiting`` has something to do meanwhile, the wait goes in slices of its
        period, and it is done between them. Its requests, and this client's after the
        wait, get the whole wait's timeout, as one read leaves it (a slice's would fail
        them on a store that answers slowly).
        """
        total = waiting.until - time.monotonic()
        if waiting.meanwhile is None or total <= waiting.every_s:
            return self._read(keys, max(total, 0.001))
        try:
            while True:
                left = waiting.until - time.monotonic()
                raw = self._read(keys, max(min(left, waiting.every_s), 0.001))
                if raw is not None or left <= waiting.every_s:
                    return raw
                self._keep_timeout(total)
                waiting.meanwhile()
        finally:
            self._keep_timeout(total)

    def _keep_timeout(self, seconds: float) -> None:
        """This thread's client answers its next requests within ``seconds`` (its own only)."""
        if self._per_thread:
            self.store.set_timeout(timedelta(seconds=seconds))

    def _read(self, keys: list[str], timeout: float) -> list[bytes] | None:
        """Every key's value once all exist, or ``None`` after ``timeout`` seconds.

        On this thread's own TCPStore client one request does both: it takes the
        timeout (its other requests wait on no key); a shared store waits first.
        """
        store = self.store
        if self._per_thread:
            store.set_timeout(timedelta(seconds=timeout))
            try:
                return store.multi_get(keys)
            except RuntimeError:  # DistStoreError: not every key within the timeout
                return None
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except RuntimeError:
            return None
        return store.multi_get(keys)

    def _decide(
        self,
        base: str,
        payload: Any,
        decide: Callable[[Mapping[int, Any]], Any],
        waiting: _Waiting,
    ) -> Any:
        """``decide`` over this rank's ``payload`` and every other rank's, read from the store."""
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        keys = [f"{base}/r{rank}" for rank in others]
        raw = self._wait_read(keys, waiting)
        if raw is None:
            checked = zip(others, keys, strict=True)
            missing = [r for r, key in checked if not self.store.check([key])]
            if missing:
                return _Missing(missing)
            # Every payload was in by the time it was checked: late by less than the
            # store's round trip, which is the store's, not the ranks'.
            raw = self.store.multi_get(keys)
        started = time.perf_counter()
        self.bytes_received += sum(len(b) for b in raw)
        try:
            with cyclic_gc_paused():
                # A copy, as every other rank's payload is: ``decide`` sees no object the
                # caller holds.
                own = pickle.loads(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
                values = {rank: pickle.loads(blob) for rank, blob in zip(others, raw, strict=True)}
                values[self.rank] = own
                values = dict(sorted(values.items()))
                del raw
                return decide(values)
        except Exception as exc:  # a verdict must reach every rank, even a failed one
            logger.exception("rankguard: deciding exchange %s failed", base)
            return _Failed(f"{type(exc).__name__}: {exc}")
        finally:
            self.decide_s += time.perf_counter() - started

    def _await_verdict(self, base: str, verdict_key: str, waiting: _Waiting) -> Any:
        # Wait longer than the deciding rank so it can publish who is missing.
        started = time.monotonic()
        grace = max(5.0, 0.25 * (waiting.until - started))
        raw = self._wait_read([verdict_key], replace(waiting, until=waiting.until + grace))
        if raw is None:
            logger.debug(
                "rankguard: no verdict for %s after %.1f s", base, time.monotonic() - started
            )
            return _NO_VERDICT
        blob = raw[0]
        self.bytes_received += len(blob)
        return pickle.loads(blob)

    def _missing_without_verdict(self, base: str) -> _Missing:
        """The deciding rank never decided: it is missing itself, or late; so may others be.

        The others are named where the world has at most :data:`CHECK_EACH_UP_TO` ranks:
        beyond, every rank checking every rank's key would ask the store for the square
        of the world size (268 million requests at 16,384 ranks) while it may be the one
        that is slow; naming the missing ranks is the deciding rank's.
        """
        missing = [_LEADER]  # it writes no payload: its verdict is how it arrives
        if self.world_size > CHECK_EACH_UP_TO:
            return _Missing(missing)
        for rank in range(self.world_size):
            if rank == _LEADER:
                continue
            try:
                present = self.store.check([f"{base}/r{rank}"])
            except RuntimeError:
                present = False
            if not present:
                missing.append(rank)
        return _Missing(missing)

    def _set(self, key: str, value: Any) -> None:
        blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        self.bytes_sent += len(blob)
        self.store.set(key, blob)

    def _delete(self, *keys: str) -> None:
        for key in keys:
            try:
                self.store.delete_key(key)
            except RuntimeError:  # best effort: a leftover key costs a few bytes
                logger.debug("rankguard: could not delete store key %s", key)

    def _missing_error(self, name: str, missing: list[int], timeout: float) -> RanksMissingError:
        """The error naming ``missing``; ``timeout`` is the configured one (before scaling)."""
        who = rank_label(missing)
        allowance = scaled_timeout(timeout, self.world_size) - timeout
        extra = f" + {allowance:.0f} s for {self.world_size} ranks" if allowance >= 1 else ""
        return RanksMissingError(
            f"{who} did not reach rankguard exchange {name!r} within {timeout:g} s{extra} "
            f"(world size {self.world_size}); {'it is' if len(missing) == 1 else 'they are'} "
            "still busy in an earlier phase, stuck, or dead.",
            name=name,
            missing=missing,
            timeout_s=timeout,
        )
