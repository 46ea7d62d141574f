"""TicketBook: one-time, kind-bound, expiring, bounded; expired or misused tickets close their
staging."""

from __future__ import annotations

import time

import pytest

from kvtier_client.staging import MemfdStagingBuffer
from kvtierd.peer import Peer
from kvtierd.protocol import ProtocolError, Status
from kvtierd.server.tickets import TicketBook
from kvtierd.staging import MemfdStaging

PEER = Peer(uid=1234, gid=99, pid=42)


def Staging() -> MemfdStaging:
    """A real verified mapping of a client memfd, as the handshake leaves in a ticket."""
    buf = MemfdStagingBuffer(4096)
    try:
        return MemfdStaging(buf.fd, 4096, 4096, (0, 0))
    finally:
        buf.close()


def refused(book: TicketBook, ticket, kind: str, fragment: str) -> None:
    with pytest.raises(ProtocolError) as info:
        book.take(ticket, kind)
    assert info.value.status is Status.BAD_HANDLE and fragment in info.value.message, info.value


def test_ticket_is_taken_once_with_its_peer_and_staging():
    book, staging = TicketBook(10.0, 8), Staging()
    ticket = book.issue("memfd", PEER, 4096, staging)
    assert isinstance(ticket, bytes) and len(ticket) == 16 and len(book) == 1
    entry = book.take(ticket, "memfd")
    assert (entry.peer, entry.nbytes, entry.staging) == (PEER, 4096, staging)
    assert len(book) == 0 and not staging.closed  # the session owns it now
    refused(book, ticket, "memfd", "unknown")


def test_ticket_of_another_kind_is_refused_and_consumed():
    book, staging = TicketBook(10.0, 8), Staging()
    ticket = book.issue("memfd", PEER, 4096, staging)
    refused(book, ticket, "inline", "issued for kind 'memfd'")
    assert staging.closed and len(book) == 0
    refused(book, ticket, "memfd", "unknown")


@pytest.mark.parametrize("ticket", [None, "x" * 16, b"x" * 15, b"x" * 17, 16])
def test_malformed_tickets_are_refused(ticket):
    refused(TicketBook(10.0, 8), ticket, "memfd", "must be the 16 bytes")


def test_expired_tickets_close_their_staging():
    book = TicketBook(0.05, 8)
    kept, dropped = Staging(), Staging()
    late = book.issue("memfd", PEER, 4096, dropped)
    time.sleep(0.1)
    fresh = book.issue("memfd", PEER, 4096, kept)  # issuing expires the old ones
    assert dropped.closed and not kept.closed and len(book) == 1
    refused(book, late, "memfd", "unknown")
    assert book.take(fresh, "memfd").staging is kept


def test_expired_ticket_taken_before_the_sweep_is_refused():
    book, staging = TicketBook(0.05, 8), Staging()
    ticket = book.issue("memfd", PEER, 4096, staging)
    time.sleep(0.1)
    refused(book, ticket, "memfd", "expired")
    assert staging.closed


def test_outstanding_tickets_are_bounded():
    book = TicketBook(10.0, 2, max_per_uid=8)
    book.issue("inline", PEER, 0)
    book.issue("inline", PEER, 0)
    with pytest.raises(ProtocolError) as info:
        book.issue("inline", PEER, 0)
    assert info.value.status is Status.BUSY and "limit is 2" in info.value.message
    staging = Staging()
    book.close_all()
    assert len(book) == 0
    book.issue("memfd", PEER, 1, staging)
    book.close_all()
    assert staging.closed


def test_one_user_cannot_hold_every_ticket():
    book = TicketBook(10.0, 8, max_per_uid=2)
    book.issue("inline", PEER, 0)
    book.issue("inline", PEER, 0)
    with pytest.raises(ProtocolError) as info:
        book.issue("inline", PEER, 0)
    assert info.value.status is Status.BUSY and "uid 1234" in info.value.message
    assert "limit per user is 2" in info.value.message
    other = Peer(uid=5678, gid=99, pid=43)
    assert len(book.take(book.issue("inline", other, 0), "inline").peer.describe()) > 0
