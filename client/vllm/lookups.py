"""Batched asynchronous scheduler lookups: one daemon round trip per rank per scheduler step.

vLLM asks its ``OffloadingManager`` about one key at a time, and an 8k-token prompt has dozens of
keys per group; a daemon round trip each (~100-200 us per rank) would sit on the scheduler's
critical path. Instead a key nobody has asked about yet is answered ``None`` ("not known yet":
the manager tells vLLM ``RETRY``, so vLLM keeps scanning the request's keys and defers the request)
and collected; at the end of the step the keys of every deferred request go to the daemon as one
LOOKUP per rank, on a background thread, while the engine runs the model. The next step's lookups
find the answers. No vLLM import here: the life cycle is unit-tested with a real daemon alone.

Answers are short-lived on purpose: each one serves the step in which it arrived and the step after
(a deferred request is looked at again in the next step), then is dropped, so a chunk evicted since
is never promised from an old answer. Hits are leased by the LOOKUP, which keeps them in the daemon
for its ``lease_timeout_s``, far longer than two steps.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtierd.protocol import Tier

log = logging.getLogger(__name__)

# Asks the daemon about a batch of keys (one LOOKUP per rank): the tier of each key on every rank,
# or None when the daemon is unavailable (then every key is a miss).
AskFn = Callable[[list[bytes]], "list[Tier] | None"]


class StepLookups:
    """Collects a step's unknown keys, resolves them in one batch, serves the answers."""

    def __init__(self, ask: AskFn) -> None:
        self._ask = ask
        self._step = 0
        self._batch: dict[bytes, None] = {}  # keys to ask at the end of this step (ordered set)
        self._in_flight: set[bytes] = set()
        self._answers: dict[bytes, tuple[Tier, int]] = {}  # key -> (tier, step it arrived in)
        self._arrived: queue.SimpleQueue[tuple[list[bytes], list[Tier]]] = queue.SimpleQueue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-lookup")
        self._closed = threading.Event()
        self.batches_sent = 0  # LOOKUP batches resolved (for tests and the benchmark)

    def tier(self, key: bytes) -> Tier | None:
        """The key's tier if known (``Tier.NONE`` = miss); None while it is being looked up."""
        self._drain()
        answer = self._answers.get(key)
        if answer is not None:
            return answer[0]
        if key not in self._in_flight:
            self._batch[key] = None
        return None

    def known(self, key: bytes) -> Tier | None:
        """The key's answer, if any, without asking for it."""
        answer = self._answers.get(key)
        return answer[0] if answer is not None else None

    @property
    def pending(self) -> bool:
        """True while keys wait for their batch or their answer (the engine must keep stepping)."""
        self._drain()
        return bool(self._batch or self._in_flight)

    def end_step(self) -> None:
        """Send this step's batch; forget the answers the step just ended could already use."""
        self._drain()
        self._answers = {k: a for k, a in self._answers.items() if a[1] >= self._step}
        self._step += 1
        if self._batch and not self._closed.is_set():
            keys = list(self._batch)
            self._batch.clear()
            self._in_flight.update(keys)
            self._executor.submit(self._resolve, keys)

    def clear(self) -> None:
        """Forget every answer (vLLM reset its cache); batches in flight still arrive."""
        self._drain()
        self._answers.clear()
        self._batch.clear()

    def close(self) -> None:
        self._closed.set()
        self._executor.shutdown(wait=True)

    def wait_idle(self, timeout_s: float) -> bool:
        """Test/benchmark helper: wait until no batch is in flight (answers are then drained)."""
        done = self._executor.submit(lambda: None)
        try:
            done.result(timeout=timeout_s)
        except TimeoutError:
            return False
        self._drain()
        return not self._in_flight

    # -- background thread ------------------------------------------------------------------------
    def _resolve(self, keys: list[bytes]) -> None:
        try:
            tiers = self._ask(keys)
        except Exception:  # never leave keys in flight forever: a failed batch is all misses
            log.exception("kvtierd: batched lookup of %d key(s) failed", len(keys))
            tiers = None
        self._arrived.put((keys, list(tiers) if tiers is not None else [Tier.NONE] * len(keys)))

    # -- scheduler thread -------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                keys, tiers = self._arrived.get_nowait()
            except queue.Empty:
                return
            self.batches_sent += 1
            self._in_flight.difference_update(keys)
            for key, tier in zip(keys, _checked(keys, tiers)):
                self._answers[key] = (tier, self._step)


def _checked(keys: Sequence[bytes], tiers: Sequence[Tier]) -> Sequence[Tier]:
    if len(tiers) != len(keys):  # a daemon bug must not shift answers onto other keys
        log.error("kvtierd answered %d tiers for %d keys; treating all as misses",
                  len(tiers), len(keys))
        return [Tier.NONE] * len(keys)
    return tiers
