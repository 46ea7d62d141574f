"""The [remote] table: parsed from the file only, every key validated with a clear error."""

from __future__ import annotations

import pytest

from kvtierd.config import ConfigError, load_config
from kvtierd.config_remote import RemoteConfig, parse_remote


def load(tmp_path, text: str, env=None):
    path = tmp_path / "k.toml"
    path.write_text(text)
    return load_config(path, env=env or {})


def test_no_table_no_remote_tier(tmp_path) -> None:
    assert load(tmp_path, "").remote is None


def test_table_with_units(tmp_path) -> None:
    cfg = load(tmp_path, '[remote]\nmaster_addr = "10.0.0.5:50051"\n'
                         'global_segment_bytes = "1GiB"\nretry_s = 3\n').remote
    assert cfg == RemoteConfig(master_addr="10.0.0.5:50051", global_segment_bytes=1024**3,
                               retry_s=3.0)


def test_env_cannot_set_the_table(tmp_path) -> None:
    with pytest.raises(ConfigError, match="KVTIERD_REMOTE"):
        load(tmp_path, "", env={"KVTIERD_REMOTE": "x"})


@pytest.mark.parametrize("table, key, allowed", [
    ({"backend": "redis"}, "remote.backend", "mooncake"),
    ({"protocol": "udp"}, "remote.protocol", "tcp, rdma"),
    ({"protocol": "rdma"}, "remote.device", "RDMA device names"),
    ({"device": "mlx5_0"}, "remote.device", "empty with protocol"),
    ({"master_addr": "nohost"}, "remote.master_addr", "HOST:PORT"),
    ({"master_addr": "h:99999"}, "remote.master_addr", "1..65535"),
    ({"metadata_url": "etcd://x"}, "remote.metadata_url", "P2PHANDSHAKE"),
    ({"local_hostname": "a b"}, "remote.local_hostname", "address"),
    ({"cluster_id": "a/b"}, "remote.cluster_id", "letters"),
    ({"global_segment_bytes": "lots"}, "remote.global_segment_bytes", ""),
    ({"local_buffer_bytes": 0}, "remote.local_buffer_bytes", "positive"),
    ({"retry_s": 0}, "remote.retry_s", "positive number of seconds"),
    ({"retry_s": True}, "remote.retry_s", "positive number of seconds"),
    ({"max_batch": 0}, "remote.max_batch", "positive integer"),
    ({"known_keys": -1}, "remote.known_keys", "non-negative"),
    ({"master": "x"}, "remote.master", "one of backend"),
    ({"replicas": 0}, "remote.replicas", "1..8"),
    ({"replicas": 9}, "remote.replicas", "1..8"),
    ({"replicas": "2"}, "remote.replicas", "non-negative integer"),
])
def test_bad_values_name_the_key_and_what_is_allowed(table, key, allowed) -> None:
    with pytest.raises(ConfigError, match="allowed") as err:
        parse_remote(table)
    assert err.value.key == key
    assert allowed in str(err.value)
