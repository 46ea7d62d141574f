"""Arena lifecycle: the flock says who is alive; stale arenas are reclaimed, never live or
persistent ones; an arena that does not fit is refused with the numbers and the fix."""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import uuid

import pytest

from kvtierd.tiers.arena import SHM_DIR, Arena, ArenaError, reclaim_stale_arenas
from kvtierd.tiers.capacity import CapacityError, check_arena_fits

MiB = 1024**2


def write(path, nbytes=64 * 1024):
    path.write_bytes(os.urandom(nbytes))
    return path


def test_reclaim_frees_only_unlocked_non_persistent_arenas(tmp_path, caplog):
    dead = write(tmp_path / "kvtierd-dead")
    live = write(tmp_path / "kvtierd-live")
    persistent = write(tmp_path / "kvtierd-warm")
    write(tmp_path / "kvtierd-warm.index", 4096)
    other = write(tmp_path / "not-ours")
    (tmp_path / "kvtierd-link").symlink_to(other)
    mine = write(tmp_path / "kvtierd-mine")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live daemon holds its arena's lock
    try:
        with caplog.at_level(logging.INFO, logger="kvtierd.tiers.arena"):
            freed = reclaim_stale_arenas(tmp_path, keep="kvtierd-mine")
    finally:
        os.close(fd)
    assert [name for name, _ in freed] == ["kvtierd-dead"]
    assert freed[0][1] >= 64 * 1024  # bytes freed, as logged
    assert not dead.exists()
    for kept in (live, persistent, tmp_path / "kvtierd-warm.index", other, mine,
                 tmp_path / "kvtierd-link"):
        assert os.path.lexists(kept), kept
    assert "kvtierd-dead" in caplog.text and "bytes freed" in caplog.text
    assert "kept the persistent arena" in caplog.text


def test_an_arena_of_our_name_left_by_a_dead_daemon_is_reused_not_refused(caplog):
    name = f"kvtierd-test-unit-{secrets.token_hex(6)}"
    write(SHM_DIR / name, 128 * 1024)  # as a kill -9 leaves it (no lock)
    with caplog.at_level(logging.WARNING, logger="kvtierd.tiers.arena"):
        arena = Arena(name, MiB, prefault=False, lock=False)
    try:
        assert "reclaimed the stale arena" in caplog.text
        assert bytes(arena.view[:4096]) == bytes(4096)  # starts empty, nothing of the old one
        with pytest.raises(ArenaError, match="in use by another kvtierd"):
            Arena(name, MiB, prefault=False, lock=False)  # a live one is never taken over
    finally:
        arena.close()
    assert not (SHM_DIR / name).exists()


def test_capacity_check_names_the_numbers_and_the_fix(tmp_path):
    with pytest.raises(CapacityError) as info:
        check_arena_fits(1 << 50, tmp_path)
    text = str(info.value)
    assert "cpu_bytes = 1024.0 TiB" in text and "free of" in text
    assert "--shm-size=" in text and "medium: Memory" in text
    with pytest.raises(CapacityError) as info:  # room in /dev/shm, not in memory
        check_arena_fits(1 << 50, tmp_path, reusable_bytes=1 << 52)
    assert "physical RAM" in str(info.value) or "cgroup memory limit" in str(info.value)
    assert "resources.limits.memory" in str(info.value)
    check_arena_fits(MiB, tmp_path)  # fits: no error


def test_mlock_advice_blames_rlimit_memlock_only_when_it_is_the_cause():
    import errno
    import resource

    from kvtierd.tiers import arena as arena_mod

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    capable = arena_mod._has_capability(arena_mod.CAP_IPC_LOCK)
    advice = arena_mod._mlock_advice(errno.ENOMEM, 1 << 40)
    if capable or soft == resource.RLIM_INFINITY:  # the limit does not bind here: memory does
        assert "RLIMIT_MEMLOCK allows it" in advice and "memory" in advice
    else:
        assert f"RLIMIT_MEMLOCK is {soft} bytes" in advice
    if capable or soft == resource.RLIM_INFINITY or soft >= 4096:
        small = arena_mod._mlock_advice(errno.ENOMEM, 4096)  # within the limit: not the rlimit
        assert "raise it" not in small


def test_reattached_arena_is_allocated_whole_and_keeps_its_bytes():
    """A re-attach skips fallocate only when every block is there already; a sparse file of the
    right size (holes: a SIGBUS on first touch when /dev/shm is full) is allocated whole."""
    name = f"kvtierd-test-{uuid.uuid4().hex}"
    nbytes = 64 * 4096
    path = SHM_DIR / name
    data = os.urandom(4096)
    with open(path, "wb") as f:  # sparse: one page written, the rest holes
        f.truncate(nbytes)
        f.seek(8 * 4096)
        f.write(data)
    try:
        assert os.stat(path).st_blocks * 512 < nbytes
        arena = Arena(name, nbytes, prefault=False, lock=False, persistent=True)
        assert arena.attached and os.stat(path).st_blocks * 512 >= nbytes
        assert bytes(arena.view[8 * 4096:9 * 4096]) == data
        arena.close(unlink=False)
        again = Arena(name, nbytes, prefault=False, lock=False, persistent=True)
        assert again.attached and bytes(again.view[8 * 4096:9 * 4096]) == data
        again.close(unlink=False)
    finally:
        path.unlink(missing_ok=True)
