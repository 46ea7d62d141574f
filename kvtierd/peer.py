"""Who is on the other end of a session, as the kernel says (SO_PEERCRED), never as the client says.

The staging handshake (a Unix socket beside the ZeroMQ socket) reads these credentials from the
connected socket and hands them to the session its one-time ticket opens. A session without a
handshake (an inline client over TCP) has no ``Peer``: its tenant can only come from its token.

**User namespaces.** The kernel translates a peer's credentials into the *reader's* user
namespace. A daemon started outside the initial one (``unshare --user``, Kubernetes
``hostUsers: false``, a rootless container) reads every peer whose uid or gid its namespace does
not map as the overflow ids (``/proc/sys/kernel/overflowuid``, 65534): two different users would
look like one. ``UserNamespace`` reads the daemon's maps once at start; a peer that shows an
overflow id while some id is unmapped is marked ``unmapped``, and HELLO refuses it unless a
configured tenant's token says who it is (``kvtierd.tenants``). In a namespace that maps every id
(the initial one), 65534 is simply the user ``nobody``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: ids a user namespace can map: 0 .. 2**32 - 2 (2**32 - 1 is the invalid id)
ALL_IDS = 2**32 - 1
_PROC = Path("/proc")


@dataclass(frozen=True)
class Peer:
    uid: int  # effective user id of the connecting process
    gid: int  # effective group id of the connecting process
    pid: int  # process id at connect time (informational: pids are reused)
    # Its uid or gid read as an overflow id in a daemon whose namespace leaves ids unmapped: the
    # kernel could not say who it is (see the module docstring).
    unmapped: bool = False

    def describe(self) -> str:
        extra = " (unmapped in the daemon's user namespace)" if self.unmapped else ""
        return f"uid {self.uid} gid {self.gid} pid {self.pid}{extra}"


@dataclass(frozen=True)
class UserNamespace:
    """The daemon's user namespace as far as peer credentials are concerned."""

    mapped_uids: int  # how many uids the namespace maps (ALL_IDS in the initial namespace)
    mapped_gids: int
    overflow_uid: int = 65534
    overflow_gid: int = 65534

    @property
    def maps_every_id(self) -> bool:
        """Every uid and gid is mapped, so no peer's credentials can read as overflow ids."""
        return self.mapped_uids >= ALL_IDS and self.mapped_gids >= ALL_IDS

    def peer(self, uid: int, gid: int, pid: int) -> Peer:
        unmapped = not self.maps_every_id and (uid == self.overflow_uid
                                               or gid == self.overflow_gid)
        return Peer(uid=uid, gid=gid, pid=pid, unmapped=unmapped)

    def describe(self) -> str:
        if self.maps_every_id:
            return "every uid and gid mapped (the initial user namespace)"
        return (f"a user namespace mapping {self.mapped_uids} uid(s) and {self.mapped_gids} "
                f"gid(s): peers outside it read as uid {self.overflow_uid} / gid "
                f"{self.overflow_gid} and are refused unless they present a tenant token")


def mapped_ids(map_text: str) -> int:
    """How many ids a ``/proc/PID/uid_map`` or ``gid_map`` maps (lines ``inside outside count``)."""
    total = 0
    for line in map_text.splitlines():
        fields = line.split()
        if len(fields) == 3:
            total += int(fields[2])
    return total


def read_user_namespace(proc: Path = _PROC) -> UserNamespace:
    """This process's user namespace (``proc``: a /proc to read, for tests). Without a readable
    /proc the initial namespace is assumed: it is what every kernel without user namespaces has."""
    try:
        uids = mapped_ids((proc / "self" / "uid_map").read_text())
        gids = mapped_ids((proc / "self" / "gid_map").read_text())
    except OSError:
        return UserNamespace(ALL_IDS, ALL_IDS)
    return UserNamespace(uids, gids, _overflow(proc, "overflowuid"), _overflow(proc, "overflowgid"))


def _overflow(proc: Path, name: str) -> int:
    try:
        return int((proc / "sys" / "kernel" / name).read_text())
    except (OSError, ValueError):
        return 65534
