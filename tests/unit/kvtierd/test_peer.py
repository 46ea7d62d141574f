"""UserNamespace: which peers' credentials the daemon's user namespace cannot tell apart."""

from __future__ import annotations

from pathlib import Path

from kvtierd.peer import ALL_IDS, UserNamespace, mapped_ids, read_user_namespace


def _proc(tmp_path: Path, uid_map: str, gid_map: str, overflow: str = "65534") -> Path:
    (tmp_path / "self").mkdir()
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "self" / "uid_map").write_text(uid_map)
    (tmp_path / "self" / "gid_map").write_text(gid_map)
    for name in ("overflowuid", "overflowgid"):
        (tmp_path / "sys" / "kernel" / name).write_text(overflow + "\n")
    return tmp_path


def test_the_initial_namespace_maps_every_id_so_65534_is_just_nobody(tmp_path):
    ns = read_user_namespace(_proc(tmp_path, "         0          0 4294967295\n",
                                   "         0          0 4294967295\n"))
    assert ns.maps_every_id
    assert not ns.peer(65534, 65534, 7).unmapped
    assert "initial" in ns.describe()


def test_map_root_user_leaves_every_other_user_unmapped(tmp_path):
    # unshare --user --map-root-user run by root: only root is mapped
    ns = read_user_namespace(_proc(tmp_path, "0 0 1\n", "0 0 1\n", "65534"))
    assert not ns.maps_every_id and (ns.mapped_uids, ns.mapped_gids) == (1, 1)
    assert ns.peer(65534, 65534, 0).unmapped
    assert ns.peer(65534, 0, 0).unmapped and ns.peer(0, 65534, 0).unmapped  # either id
    assert not ns.peer(0, 0, 12).unmapped
    assert "refused unless they present a tenant token" in ns.describe()


def test_a_kubernetes_pod_range_counts_every_line_and_reads_its_overflow_ids(tmp_path):
    ns = read_user_namespace(_proc(tmp_path, "0 100000 65536\n", "0 100000 65536\n", "4242"))
    assert ns.mapped_uids == 65536 and ns.overflow_uid == ns.overflow_gid == 4242
    assert ns.peer(4242, 5, 1).unmapped and not ns.peer(65534, 5, 1).unmapped
    assert mapped_ids("0 1000 1\n1 100000 65535\n") == 65536


def test_no_proc_means_the_initial_namespace(tmp_path):
    assert read_user_namespace(tmp_path / "missing") == UserNamespace(ALL_IDS, ALL_IDS)


def test_this_process_reads_its_own_namespace():
    ns = read_user_namespace()
    assert ns.mapped_uids > 0 and ns.mapped_gids > 0
