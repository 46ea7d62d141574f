"""KV events: what the daemon stores and drops, on a ZeroMQ PUB socket in vLLM's own wire format.

KV-aware routers (llm-d's KV-cache manager, Dynamo's router) already consume vLLM's KV events to
learn which node holds which prefix; kvtierd speaks the same format so that they learn about its
tiers too, with no adapter. Off unless ``events_addr`` is set (then ``NO_EVENTS`` is replaced).

**Wire** (``vllm.distributed.kv_events``, its ``ZmqEventPublisher``): every message is three
frames ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian counter from 0 at each start;
``payload`` is the msgpack of a ``KVEventBatch`` as msgspec encodes it: the batch as an array
``[ts, [event, ...], data_parallel_rank]``, each event as a map tagged by ``type`` (msgspec's
``tag=True``), every field present but those equal to their default::

    {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
     "lora_id", "medium", "lora_name", ["group_idx"], "locality"}
    {"type": "BlockRemoved", "block_hashes", "medium", ["group_idx"], "locality"}
    {"type": "AllBlocksCleared"}

vLLM 0.32 and 0.33 decode these with their own classes (fields are only ever added, with
defaults); Dynamo's relay reads the map form; ``data_parallel_rank`` is always 0 (Dynamo's
decoder requires it). **Topic**: ``events_topic`` with ``{node}`` and ``{model}`` filled in
(default ``kv@{node}@{model}``, the ``kv@<pod>@<model>`` form llm-d parses; the model is the
namespace's model part, so one stream per model as vLLM has one per engine). **Replay**: with
``events_replay_addr``, a ROUTER answers an 8-byte big-endian start sequence with every buffered
batch from it, then ``[b"", seq -1, b""]`` (vLLM's replay protocol, for subscribers that saw a gap).

**Media** (vLLM's names where vLLM has one): the CPU tier is ``CPU`` (vLLM's ``MEDIUM_CPU``, which
llm-d weighs 0.8 by default), the NVMe tier ``STORAGE`` (vLLM's name for its local disk tier),
the remote tier ``REMOTE``; ``locality`` says ``LOCAL``/``REMOTE`` as vLLM 0.32's offloading does.

**Hashes** are published as vLLM publishes its own by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): a bytes hash becomes the uint64 of its last 8 bytes,
so that kvtierd's events name a block exactly as the engine's GPU events do (llm-d maps engine
keys to its own; Dynamo's relay decodes only ints). ``events_int_hashes = false`` sends the bytes.

**What is announced**: a chunk of rank 0 when it becomes readable in a tier (PUT commit,
promotion, NVMe write), and its removal from that tier (eviction, demotion, DELETE, a failed
check, an NVMe drop) when any rank's copy of it leaves (a prefix needs every rank). Hashes come
from the PUT's ``blocks`` field (``kvtierd.event_blocks``); without it the chunk key stands in.
Each start sends ``AllBlocksCleared`` first, and each clean stop last: what a run said is void
after it (its sequence numbers and tracking are gone). After a clean stop, the next start
re-announces what it recovered (NVMe, a re-attached arena) from the stop's snapshot
(``kvtierd.event_snapshot``); after a crash it does not.

**Threads**: the request loop only appends to lists and dicts (``stored``/``removed``) and, once
per iteration, ``flush`` hands one batch per topic to a bounded queue; the publisher thread
encodes and sends. A full queue drops the batch and a failed send drops it too, both counted in
``kvtierd_events_dropped_total``; the loop never waits on a subscriber. PUB semantics per
subscriber: libzmq drops for a subscriber past its high-water mark without telling us, which the
subscriber sees as a sequence gap (and replays).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import Counter, OrderedDict, defaultdict, deque
from dataclasses import dataclass
from typing import Any, Hashable

import msgpack
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtierd.event_blocks import BlockInfo

log = logging.getLogger(__name__)

# kvtierd tier → (vLLM medium, vLLM locality)
MEDIA = {"cpu": ("CPU", "LOCAL"), "nvme": ("STORAGE", "LOCAL"), "remote": ("REMOTE", "REMOTE")}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUB_HWM = 100_000  # messages libzmq queues per subscriber before dropping for it
DROP_REASONS = ("queue_full", "send_failed", "publisher_down")
KINDS = ("stored", "removed", "cleared")
_POLL_S = 0.05
CLOSE_LINGER_MS = 500  # at stop, for the last batches to reach subscribers
RECENT_REMOVALS = 4096  # blocks of chunks that just left their last tier, kept for a move below


class EventsBindError(OSError):
    """An events endpoint cannot be bound (the daemon's start fails with it, before the arena)."""

    def __init__(self, key: str, value: str, reason: str) -> None:
        super().__init__(f"{key} = {value!r}: {reason}")
        self.key, self.value, self.reason = key, value, reason


@dataclass(frozen=True)
class EventsSettings:
    """The ``events_*`` config keys, resolved (``node`` filled in)."""

    addr: str
    replay_addr: str = ""
    topic: str = "kv@{node}@{model}"
    node: str = ""
    max_queued_batches: int = 10_000
    replay_batches: int = 10_000
    int_hashes: bool = True

    @classmethod
    def from_config(cls, cfg: Any) -> EventsSettings:
        return cls(cfg.events_addr, cfg.events_replay_addr, cfg.events_topic,
                   cfg.events_node or socket.gethostname(), cfg.events_max_queued_batches,
                   cfg.events_replay_batches, cfg.events_int_hashes)


class NoEvents:
    """The hooks the daemon calls; as such, ``events_addr`` unset: every hook is a no-op."""

    enabled = False

    def stored(self, ikey: Hashable, tier: str, info: BlockInfo | None = None) -> None:
        pass

    def removed(self, ikey: Hashable, tier: str) -> None:
        pass

    def cleared(self) -> None:
        pass

    def announcements(self) -> dict[tuple, BlockInfo | None]:
        return {}

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def counts(self) -> dict[str, Any]:
        return {"events": Counter(), "dropped": Counter(), "queued": 0, "subscribers": 0,
                "sequence": -1}


NO_EVENTS = NoEvents()


def wire_hash(value: Any, as_int: bool) -> Any:
    """A block hash as vLLM publishes it: with ``as_int`` (vLLM's default), a bytes hash becomes
    the uint64 of its last 8 bytes (``maybe_convert_block_hash``); ints and None pass."""
    if as_int and isinstance(value, bytes):
        return int.from_bytes(value, "big") & (2**64 - 1)
    return value


def stored_event(info: BlockInfo, tier: str, as_int: bool = False) -> dict:
    medium, locality = MEDIA[tier]
    event = {"type": "BlockStored", "block_hashes": [wire_hash(h, as_int) for h in info.hashes],
             "parent_block_hash": wire_hash(info.parent, as_int), "token_ids": list(info.tokens),
             "block_size": info.block_size, "lora_id": None, "medium": medium, "lora_name": None}
    if info.group is not None:
        event["group_idx"] = info.group
    event["locality"] = locality
    return event


def removed_event(info: BlockInfo, tier: str, as_int: bool = False) -> dict:
    medium, locality = MEDIA[tier]
    event: dict[str, Any] = {"type": "BlockRemoved",
                             "block_hashes": [wire_hash(h, as_int) for h in info.hashes],
                             "medium": medium}
    if info.group is not None:
        event["group_idx"] = info.group
    event["locality"] = locality
    return event


class KVEvents(NoEvents):
    """The publisher (see the module docstring). Bound at construction, so that a taken port
    fails the daemon's start before the arena is mapped; ``start`` runs its thread."""

    enabled = True

    def __init__(self, settings: EventsSettings) -> None:
        self.settings = settings
        self._ctx = zmq.Context()  # its own: a publisher failure never touches the request socket
        self._pub = self._ctx.socket(zmq.XPUB)  # XPUB: PUB that also tells who subscribes
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
            self._pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, for the gauge
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(settings.addr)
            if settings.replay_addr:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (settings.replay_batches + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(settings.replay_addr)
        except zmq.ZMQError as exc:
            self._close_sockets()
            replay = self._replay is not None
            raise EventsBindError("events_replay_addr" if replay else "events_addr",
                                  settings.replay_addr if replay else settings.addr,
                                  f"cannot bind the KV-event socket: {exc}") from None
        self._queue: queue.Queue[tuple[bytes, bytes, int] | None] = queue.Queue(
            settings.max_queued_batches)
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=settings.replay_batches)
        self._thread = threading.Thread(target=self._run, name="kvtierd-events", daemon=True)
        self._pending: defaultdict[str, list] = defaultdict(list)  # namespace: events
        self._pending_kinds: Counter[str] = Counter()
        # (tier, tenant, namespace, key) → what was announced (None: the key stood in).
        self._announced: dict[tuple, BlockInfo | None] = {}
        # (tenant, namespace, key) → the blocks of a chunk whose last announcement was removed,
        # newest last: a chunk on its way between tiers (NVMe's victim cascading to the remote
        # tier) is stored below after it left above, and keeps the hashes its PUT gave.
        self._recent: OrderedDict[tuple, BlockInfo] = OrderedDict()
        self._topics: dict[str, bytes] = {}
        self.events: Counter[str] = Counter()  # loop thread: produced, by kind
        self.dropped: Counter[str] = Counter()  # loop thread: queue_full, publisher_down
        self._send_failed = 0  # publisher thread
        self._subscribers = 0  # publisher thread
        self._seq = -1  # publisher thread: last sequence number sent
        self._down_logged = False
        self._started = False  # batches flushed before start wait in the queue

    def start(self) -> None:
        self._started = True
        self._thread.start()
        log.info("KV events on %s (topic %s, replay %s)", self.settings.addr, self.settings.topic,
                 self.settings.replay_addr or "off")

    # -- hooks: request loop thread only ----------------------------------------------------------
    def stored(self, ikey: Hashable, tier: str, info: BlockInfo | None = None) -> None:
        """A chunk became readable in ``tier``; announced for rank 0, once per tier."""
        (tenant, namespace, rank), key = ikey  # type: ignore[misc]
        ident = (tier, tenant, namespace, key)
        if rank != 0 or ident in self._announced:
            return
        if info is None:  # a move between tiers: what the PUT said, if another tier remembers it
            info = next((self._announced[other] for t in MEDIA
                         if (other := (t, tenant, namespace, key)) in self._announced), None)
            if info is None:
                info = self._recent.pop((tenant, namespace, key), None)
        self._announced[ident] = info.without_tokens() if info is not None else None
        event = stored_event(info or BlockInfo((key,)), tier, self.settings.int_hashes)
        self._add(namespace, event, "stored")

    def removed(self, ikey: Hashable, tier: str) -> None:
        """Any rank's copy of a chunk left ``tier``: the prefix is no longer whole there."""
        (tenant, namespace, _rank), key = ikey  # type: ignore[misc]
        ident = (tier, tenant, namespace, key)
        if ident not in self._announced:
            return
        info = self._announced.pop(ident)
        if info is not None and not any((t, tenant, namespace, key) in self._announced
                                        for t in MEDIA):
            self._recent[(tenant, namespace, key)] = info
            self._recent.move_to_end((tenant, namespace, key))
            if len(self._recent) > RECENT_REMOVALS:
                self._recent.popitem(last=False)
        event = removed_event(info or BlockInfo((key,)), tier, self.settings.int_hashes)
        self._add(namespace, event, "removed")

    def cleared(self) -> None:
        """Everything announced before is void (sent at start: on the topic of no model, which a
        subscriber of ``kv@`` or of every topic receives)."""
        self._announced.clear()
        self._recent.clear()
        self._add("", {"type": "AllBlocksCleared"}, "cleared")

    def announcements(self) -> dict[tuple, BlockInfo | None]:
        """What is announced now: ``(tier, tenant, namespace, key)`` → the PUT's blocks (None:
        the key stood in). For the restart snapshot (``kvtierd.event_snapshot``)."""
        return dict(self._announced)

    def _add(self, namespace: str, event: dict, kind: str) -> None:
        self._pending[namespace].append(event)
        self._pending_kinds[kind] += 1

    def flush(self) -> None:
        """Hand this iteration's events to the publisher thread, one batch per topic."""
        if not self._pending:
            return
        pending, self._pending = self._pending, defaultdict(list)
        kinds, self._pending_kinds = self._pending_kinds, Counter()
        self.events.update(kinds)
        if self._started and not self._thread.is_alive():
            self.dropped["publisher_down"] += sum(kinds.values())
            if not self._down_logged:
                self._down_logged = True
                log.error("the KV-event publisher thread is gone; events are dropped (the daemon "
                          "keeps serving)")
            return
        now = time.time()
        for namespace, events in pending.items():
            try:
                self._queue.put_nowait((self._topic(namespace), msgpack.packb([now, events, 0]),
                                      len(events)))
            except queue.Full:
                self.dropped["queue_full"] += len(events)

    def _topic(self, namespace: str) -> bytes:
        topic = self._topics.get(namespace)
        if topic is None:
            model = namespace.rsplit("/", 1)[0]  # namespaces are "<model>/<fingerprint prefix>"
            topic = self.settings.topic.format(node=self.settings.node, model=model).encode()
            if len(self._topics) < 4096:  # namespaces are bounded by sessions; the cache too
                self._topics[namespace] = topic
        return topic

    def counts(self) -> dict[str, Any]:
        dropped = Counter(self.dropped)
        dropped["send_failed"] += self._send_failed
        return {"events": Counter(self.events), "dropped": dropped,
                "queued": self._queue.qsize(), "subscribers": self._subscribers,
                "sequence": self._seq}

    def close(self) -> None:
        self.flush()
        sent = self._started and self._thread.is_alive()
        if sent:
            self._queue.put(None)  # after everything queued: the thread sends those first
            self._thread.join(timeout=2.0)
        self._close_sockets(linger_ms=CLOSE_LINGER_MS if sent else 0)

    def _close_sockets(self, linger_ms: int = 0) -> None:
        """With ``linger_ms``, libzmq gets that long to hand the last batches (the stop's
        AllBlocksCleared) to subscribers; never longer, whatever they do."""
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=linger_ms)
        self._ctx.term()

    # -- publisher thread -------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                for sock, _ in poller.poll(0):
                    if sock is self._pub:
                        self._subscriptions()
                    else:
                        self._serve_replay()
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            except zmq.ZMQError as exc:  # a socket closed under us: nothing more can be sent
                log.error("KV-event publisher stopped: %s", exc)
                return
            if item is None:
                return
            self._send(*item)

    def _send(self, topic: bytes, payload: bytes, count: int) -> None:
        seq = self._seq + 1
        try:
            self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._send_failed += count
            if self._send_failed < 10 or self._send_failed % 1000 == 0:
                log.warning("KV-event batch %d not sent (%s); dropped", seq, exc)
            return
        self._seq = seq
        self._buffer.append((seq, topic, payload))

    def _subscriptions(self) -> None:
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                self._subscribers += 1
            elif message[:1] == b"\x00":
                self._subscribers = max(0, self._subscribers - 1)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2 or len(frames[-1]) != 8:
                log.warning("replay request of %d frame(s) ignored: expected [identity, b'', "
                            "8-byte start sequence]", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            try:
                for seq, topic, payload in list(self._buffer):
                    if seq >= start:
                        self._replay.send_multipart(
                            [identity, b"", topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                self._replay.send_multipart([identity, b"", b"", END_SEQ, b""], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # gone, or not reading: its replay ends here
                log.warning("replay to a subscriber cut short: %s", exc)


class ChainEventsAdapter:
    """The tier chain's ``ChainEvents`` hooks (``stored``/``dropped`` of ``(tier, entry)``, for
    every tier: cpu, nvme, remote) feeding the publisher."""

    def __init__(self, events: NoEvents) -> None:
        self._events = events

    def stored(self, tier: str, entry: Any) -> None:
        if tier in MEDIA:
            self._events.stored(entry.ikey, tier)

    def dropped(self, tier: str, entry: Any) -> None:
        if tier in MEDIA:
            self._events.removed(entry.ikey, tier)


def make_events(cfg: Any) -> NoEvents:
    """The daemon's events object: bound now when ``events_addr`` is set, else the no-op."""
    return KVEvents(EventsSettings.from_config(cfg)) if cfg.events_addr else NO_EVENTS


class EventsCollector(Collector):
    """``kvtierd_events_*`` at scrape time (zeros, and enabled 0, when events are off)."""

    def __init__(self, events: NoEvents) -> None:
        self._events = events

    def collect(self):
        counts = self._events.counts()
        enabled = GaugeMetricFamily("kvtierd_events_enabled",
                                    "1 when the KV-event publisher is on (events_addr set)")
        enabled.add_metric([], int(self._events.enabled))
        produced = CounterMetricFamily("kvtierd_events", "KV events produced, by kind",
                                       labels=["kind"])
        for kind in KINDS:
            produced.add_metric([kind], counts["events"][kind])
        dropped = CounterMetricFamily(
            "kvtierd_events_dropped", "KV events not published, by reason", labels=["reason"])
        for reason in DROP_REASONS:
            dropped.add_metric([reason], counts["dropped"][reason])
        queued = GaugeMetricFamily("kvtierd_events_queued_batches",
                                   "KV-event batches waiting for the publisher thread")
        queued.add_metric([], counts["queued"])
        subscribers = GaugeMetricFamily("kvtierd_events_subscribers",
                                        "Subscriptions open on the KV-event socket")
        subscribers.add_metric([], counts["subscribers"])
        yield from (enabled, produced, dropped, queued, subscribers)
