"""The loop's requests, from the ROUTER socket to the reply: ``RequestServing``, which ``Daemon``
mixes in.

Every request gets exactly one reply with one envelope (``protocol.reply``): the handler's fields,
a ``ProtocolError``'s status and message, or INTERNAL for anything else (logged). A batch whose
copies are in flight is answered later, by ``DataOps.finish``, through the same ``_send``. The
loop drains at most ``DRAIN_MAX`` requests per wake-up, so housekeeping still gets its turn.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any

import zmq

from kvtierd.protocol import Op, ProtocolError, Status, pack, reply, unpack
from kvtierd.server import envelope

log = logging.getLogger("kvtierd.server.daemon")  # the loop's logger, as before the split

DRAIN_MAX = 256  # requests handled per poll wake-up before housekeeping gets a turn
NEEDS_SESSION = {Op.LOOKUP, Op.PUT, Op.GET, Op.DELETE, Op.BYE}
LARGE_FRAME = 64 * 1024  # frames above this are sent without a copy


class RequestServing:
    """The request half of ``Daemon``; it uses the daemon's ``socket``, ``cfg``, ``sessions``,
    ``admission``, ``handlers``, ``_dispatch`` (op -> handler), ``metrics`` and ``idle_trim``."""

    def _drain_requests(self) -> None:
        assert self.socket is not None
        self.idle_trim.served()
        for _ in range(DRAIN_MAX):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        started = time.perf_counter()
        request_id: Any = None
        op_label = "invalid"
        try:
            if len(frames) < 2:
                raise ProtocolError(Status.BAD_MESSAGE, "message has no header frame")
            header = unpack(frames[1].bytes, self.cfg.max_header_bytes)
            request_id = header.get("id")
            op = envelope.check_envelope(header)
            op_label = op.name.lower()
            session = (None if op is Op.HELLO
                       else self.sessions.get(identity, header.get("secret")))
            envelope.check_frame_count(op, session, len(frames) - 1, self.cfg.max_batch)
            result = self._run(op, identity, session, header, [f.buffer for f in frames[2:]])
            if result is None:
                return  # copies in flight: answered by OpHandlers.finish
            fields, out = result if isinstance(result, tuple) else (result, [])
            self._send(identity, reply(request_id, Status.OK, **fields), out)
            status_label = "OK"
        except ProtocolError as exc:
            self._send(identity, reply(request_id, exc.status, exc.message), [])
            status_label = exc.status.name
        except Exception as exc:
            log.exception("internal error handling %s", op_label)
            self._send(identity, reply(request_id, Status.INTERNAL, f"internal error: {exc}"), [])
            status_label = Status.INTERNAL.name
        self.metrics.requests.labels(op_label, status_label).inc()
        self.metrics.latency.labels(op_label).observe(time.perf_counter() - started)

    def _run(self, op: Op, identity: bytes, session: Any, header: dict, payload: list) -> Any:
        """``session``: the sender's, when the request carries its secret (None for HELLO)."""
        if op is Op.HELLO:
            self.admission.check_hello(self.sessions, identity)
            return self.handlers.hello(identity, header, payload)
        if session is None and op in NEEDS_SESSION:
            if identity in self.sessions.by_identity:  # a session, but not this request's
                raise self.admission.refuse(
                    "secret", Status.NO_SESSION, f"{op.name} does not carry the secret of the "
                    "session on this routing id (HELLO's reply 'secret', sent as 'secret' in "
                    "every request); send HELLO to open a session of your own")
            raise ProtocolError(
                Status.NO_SESSION, f"{op.name} needs a session: send HELLO first (or again)"
            )
        self.admission.check_admin(op, session, header)
        if op is Op.PUT or op is Op.GET:
            self.admission.check_batch(op, session)
        return self._dispatch[op](session, header, payload)

    def _send(self, identity: bytes, header: dict, frames: list, track: bool = False
              ) -> zmq.MessageTracker | None:
        """Send a reply; with ``track``, return what tells when libzmq let go of the payload
        frames (None: the reply was dropped, nothing is held)."""
        assert self.socket is not None
        if track:  # one tracker per frame: pyzmq's send_multipart tracks only the last frame
            frames = [zmq.Frame(f, track=True) for f in frames]
        parts = [identity, pack(header), *frames]
        copy = not track and not any(len(f) > LARGE_FRAME for f in frames)
        try:
            self.socket.send_multipart(parts, zmq.NOBLOCK, copy=copy)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                log.debug("reply to a peer that is gone dropped")
            elif exc.errno == errno.EAGAIN:
                log.warning("reply dropped: the peer's queue is full (it does not read replies)")
            else:
                raise
            return None
        return zmq.MessageTracker(*frames) if track else None
