"""load_config: precedence flag > env > file > default, units, and refusals naming key and value."""

import os
from pathlib import Path

import pytest

from kvtierd.config import (
    Config,
    ConfigError,
    default_runtime_dir,
    load_config,
    resolve_config,
)


def write_toml(tmp_path, text: str):
    path = tmp_path / "kvtierd.toml"
    path.write_text(text)
    return path


def refused(key: str, value, *, path=None, env=None, overrides=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {}, overrides=overrides)
    assert key in str(info.value), str(info.value)
    assert str(value) in str(info.value), str(info.value)
    return info.value


def test_defaults_validate():
    cfg = load_config(None, env={})
    assert cfg == Config()
    assert cfg.cpu_bytes % cfg.page_bytes == 0 and cfg.page_bytes % 4096 == 0
    assert cfg.socket.startswith("ipc://") and cfg.ipc_path is not None
    assert cfg.cpu_pages == cfg.cpu_bytes // cfg.page_bytes


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = write_toml(tmp_path, 'max_batch = 11\ncopy_threads = 3\nlog_level = "debug"\n')
    env = {"KVTIERD_COPY_THREADS": "5", "KVTIERD_LOG_LEVEL": "warning", "OTHER": "x"}
    cfg = load_config(path, env=env, overrides={"log_level": "error", "max_batch": None})
    assert cfg.max_batch == 11  # file (a None flag is "not given")
    assert cfg.copy_threads == 5  # env beats file
    assert cfg.log_level == "ERROR"  # flag beats env and file
    assert cfg.lease_timeout_s == Config().lease_timeout_s  # default


def test_sizes_with_units_in_file_env_and_flags(tmp_path):
    path = write_toml(tmp_path, 'cpu_bytes = "8MiB"\nmax_header_bytes = "2 MiB"\n')
    env = {"KVTIERD_PAGE_BYTES": "128KiB"}
    cfg = load_config(path, env=env, overrides={"max_inline_bytes": "1MB"})
    assert (cfg.cpu_bytes, cfg.page_bytes) == (8 * 1024**2, 128 * 1024)
    assert (cfg.max_header_bytes, cfg.max_inline_bytes) == (2 * 1024**2, 1_000_000)


def test_kvtierd_table_is_accepted(tmp_path):
    path = write_toml(tmp_path, '[kvtierd]\ncpu_bytes = "4MiB"\nprefault = false\n')
    cfg = load_config(path, env={})
    assert cfg.cpu_bytes == 4 * 1024**2 and cfg.prefault is False


@pytest.mark.parametrize(
    "text, expected", [("on", True), ("Yes", True), ("0", False), ("off", False)]
)
def test_env_bools(text, expected):
    assert load_config(None, env={"KVTIERD_MLOCK": text}).mlock is expected


def test_bare_path_socket_becomes_absolute_ipc(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, env={}, overrides={"socket": "run/k.sock"})
    assert cfg.socket == f"ipc://{tmp_path / 'run' / 'k.sock'}"
    assert cfg.ipc_path == tmp_path / "run" / "k.sock" and cfg.ipc_path.is_absolute()


@pytest.mark.parametrize("sock", ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:7"])
def test_loopback_tcp_socket_allowed(sock):
    assert load_config(None, env={}, overrides={"socket": sock}).socket == sock


def test_remote_tcp_socket_needs_allow_remote():
    refused("socket", "tcp://10.1.2.3:5555", overrides={"socket": "tcp://10.1.2.3:5555"})
    refused("socket", "tcp://0.0.0.0:5555", env={"KVTIERD_SOCKET": "tcp://0.0.0.0:5555"})
    cfg = load_config(
        None, env={"KVTIERD_ALLOW_REMOTE": "true"}, overrides={"socket": "tcp://10.1.2.3:5555"}
    )
    assert cfg.socket == "tcp://10.1.2.3:5555" and cfg.allow_remote


@pytest.mark.parametrize(
    "key, value, overrides",
    [
        ("page_bytes", 6000, {"page_bytes": 6000}),
        ("page_bytes", 0, {"page_bytes": 0}),
        ("cpu_bytes", 4096, {"cpu_bytes": 4096, "page_bytes": 65536}),
        ("cpu_bytes", 200704, {"cpu_bytes": 3 * 65536 + 4096, "page_bytes": 65536}),
        ("low_watermark", 0.97, {"low_watermark": 0.97, "high_watermark": 0.9}),
        ("high_watermark", 1.5, {"high_watermark": 1.5}),
        ("low_watermark", 0.0, {"low_watermark": 0.0}),
        ("eviction_policy", "fifo", {"eviction_policy": "fifo"}),
        ("socket", "udp://x", {"socket": "udp://x"}),
        ("socket", "ipc://", {"socket": "ipc://"}),
        ("socket", "tcp://127.0.0.1:http", {"socket": "tcp://127.0.0.1:http"}),
        ("metrics_addr", "9464", {"metrics_addr": "9464"}),
        ("metrics_addr", "127.0.0.1:70000", {"metrics_addr": "127.0.0.1:70000"}),
        ("metrics_addr", "localhost:", {"metrics_addr": "localhost:"}),
        ("lease_timeout_s", 0.0, {"lease_timeout_s": 0}),
        ("copy_threads", "two", {"copy_threads": "two"}),
        ("io_queue_depth", 0, {"io_queue_depth": 0}),
        ("max_frame_bytes", 1024, {"max_frame_bytes": 1024}),
        ("arena_name", "a/b", {"arena_name": "a/b"}),
        ("log_level", "CHATTY", {"log_level": "chatty"}),
        ("cpu_bytes", "12XB", {"cpu_bytes": "12XB"}),
        ("socket_mode", "440", {"socket_mode": "440"}),  # the owner cannot write
        ("socket_mode", "0400", {"socket_mode": "0400"}),
        ("socket_mode", "0680", {"socket_mode": "0680"}),
        ("socket_mode", "1660", {"socket_mode": "1660"}),
        ("socket_mode", "0777", {"socket_mode": "0777"}),  # execute bits
        ("socket_mode", "rw-rw----", {"socket_mode": "rw-rw----"}),
        ("handshake_socket", "rel/hs.sock", {"handshake_socket": "rel/hs.sock"}),
        ("handshake_socket", "/" + "h" * 120, {"handshake_socket": "/" + "h" * 120}),
        ("socket", "/" + "s" * 105 + ".hs", {"socket": "ipc:///" + "s" * 105}),
        ("ticket_timeout_s", 0.0, {"ticket_timeout_s": 0}),
        ("remote_publish", "on-read", {"remote_publish": "on-read"}),
        ("nvme_publish_after_reads", -1, {"nvme_publish_after_reads": -1}),
        ("remote_publish_after_reads", -2, {"remote_publish_after_reads": -2}),
    ],
)
def test_invalid_values_name_key_and_value(key, value, overrides):
    refused(key, value, overrides=overrides)


def test_bad_bool_in_file_and_env(tmp_path):
    refused("prefault", "maybe", path=write_toml(tmp_path, 'prefault = "maybe"\n'))
    refused("allow_remote", "2", env={"KVTIERD_ALLOW_REMOTE": "2"})


def test_unknown_key_in_a_file_is_an_error_naming_the_closest_key(tmp_path):
    err = refused("bogus", 1, path=write_toml(tmp_path, "bogus = 1\n"))
    assert "cpu_bytes" in str(err)  # lists what is allowed
    err = refused("cpu_byte", 1, path=write_toml(tmp_path, "cpu_byte = 1\n"))
    assert "did you mean cpu_bytes?" in str(err)


def test_unknown_env_variable_warns_with_the_closest_key_and_is_ignored():
    loaded = resolve_config(None, env={"KVTIERD_CPU_BYTE": "1GiB", "KVTIERD_BOGUS": "x"})
    assert loaded.config == Config()
    assert len(loaded.warnings) == 2
    typo = next(w for w in loaded.warnings if "KVTIERD_CPU_BYTE " in w)
    assert "did you mean KVTIERD_CPU_BYTES?" in typo


@pytest.mark.parametrize("name", [
    "KVTIERD_SERVICE_HOST", "KVTIERD_SERVICE_PORT", "KVTIERD_SERVICE_PORT_METRICS", "KVTIERD_PORT",
    "KVTIERD_PORT_9464_TCP", "KVTIERD_PORT_9464_TCP_PROTO", "KVTIERD_PORT_9464_TCP_PORT",
    "KVTIERD_PORT_9464_TCP_ADDR", "KVTIERD_PORT_53_UDP", "KVTIERD_PORT_7_SCTP_ADDR",
])
def test_kubernetes_service_link_variables_are_ignored_silently(name):
    loaded = resolve_config(None, env={name: "tcp://10.0.0.7:9464"})
    assert loaded.config == Config() and loaded.warnings == ()


def test_each_value_has_its_source(tmp_path):
    path = write_toml(tmp_path, 'cpu_bytes = "8MiB"\npage_bytes = "8KiB"\nmax_batch = 7\n')
    loaded = resolve_config(path, env={"KVTIERD_PAGE_BYTES": "16KiB", "KVTIERD_MAX_BATCH": "9"},
                            overrides={"max_batch": "11"})
    assert loaded.sources["cpu_bytes"] == "file"
    assert loaded.sources["page_bytes"] == "env"
    assert loaded.sources["max_batch"] == "flag" and loaded.config.max_batch == 11
    assert loaded.sources["lease_timeout_s"] == "default"
    lines = {line.split()[0]: line for line in loaded.lines()}
    assert lines["page_bytes"].endswith("(env)") and "16384" in lines["page_bytes"]
    assert "(derived)" in lines["arena_name"] and "(derived)" in lines["nvme_dir"]


def test_arena_and_nvme_dir_are_named_per_instance_never_per_pid():
    one = load_config(None, env={}, overrides={"socket": "ipc:///tmp/a/kvtierd.sock"})
    again = load_config(None, env={}, overrides={"socket": "ipc:///tmp/a/kvtierd.sock"})
    other = load_config(None, env={}, overrides={"socket": "ipc:///tmp/b/kvtierd.sock"})
    assert one.resolved_arena_name() == again.resolved_arena_name()  # a restart finds it
    assert one.resolved_arena_name() != other.resolved_arena_name()
    assert str(os.getpid()) not in one.resolved_arena_name()
    assert one.resolved_nvme_dir() != other.resolved_nvme_dir()
    named = load_config(None, env={"KVTIERD_INSTANCE": "gpu0"})
    assert named.resolved_arena_name() == "kvtierd-gpu0"
    assert named.resolved_nvme_dir().parent.name == "gpu0"
    assert load_config(None, env={}, overrides={"nvme_dir": "/x/y"}).resolved_nvme_dir() == \
        Path("/x/y")
    refused("instance", "a/b", overrides={"instance": "a/b"})


def test_missing_and_invalid_config_file(tmp_path):
    refused("config", tmp_path / "nope.toml", path=tmp_path / "nope.toml")
    bad = write_toml(tmp_path, "cpu_bytes = = 3\n")
    assert "valid TOML" in str(refused("config", bad, path=bad))


def test_config_env_variable_itself_is_not_a_key():
    assert load_config(None, env={"KVTIERD_CONFIG": "/nowhere.toml"}) == Config()


def test_public_dict_masks_token():
    cfg = load_config(None, env={"KVTIERD_AUTH_TOKEN": "s3cret"})
    assert cfg.auth_token == "s3cret" and cfg.public_dict()["auth_token"] == "***"


def test_fractional_int_value_is_refused():
    refused("copy_threads", 2.7, overrides={"copy_threads": 2.7})


def test_nan_timeout_is_refused():
    refused("lease_timeout_s", "nan", env={"KVTIERD_LEASE_TIMEOUT_S": "nan"})


def test_tcp_socket_port_out_of_range_is_refused():
    refused("socket", "tcp://127.0.0.1:99999", overrides={"socket": "tcp://127.0.0.1:99999"})


def test_handshake_socket_sits_beside_the_ipc_socket_or_in_the_runtime_dir(tmp_path):
    cfg = load_config(env={}, overrides={"socket": f"ipc://{tmp_path}/k.sock"})
    assert cfg.handshake_path == tmp_path / "k.sock.hs"
    assert cfg.socket_mode == "0660" and cfg.socket_mode_bits == 0o660
    cfg = load_config(env={}, overrides={"socket": "tcp://127.0.0.1:5555"})
    assert cfg.handshake_path == default_runtime_dir() / "kvtierd-5555.hs"
    cfg = load_config(env={"KVTIERD_HANDSHAKE_SOCKET": f"{tmp_path}/hs",
                           "KVTIERD_SOCKET_MODE": "0600"}, overrides={})
    assert cfg.handshake_path == tmp_path / "hs" and cfg.socket_mode_bits == 0o600


# -- tenants ---------------------------------------------------------------------------------------

TENANTS = """\
tenant_max_bytes = "1GiB"
[tenants.team-a]
uids = [1001, 1002]
gids = [3000]
tokens = ["s3cret"]
max_bytes = "16GiB"
[tenants.ops]
gids = [4000]
max_bytes = 0
"""


def test_tenants_table_becomes_frozen_tenant_configs(tmp_path):
    from kvtierd.config import TenantConfig

    cfg = load_config(write_toml(tmp_path, TENANTS), env={})
    assert cfg.tenants == (
        TenantConfig("team-a", (1001, 1002), (3000,), ("s3cret",), 16 * 1024**3),
        TenantConfig("ops", (), (4000,), (), 0),
    )
    assert cfg.tenant_max_bytes == 1024**3
    public = cfg.public_dict()
    assert public["tenants"][0]["tokens"] == ["***"] and "s3cret" not in repr(public)
    with pytest.raises(Exception):
        cfg.tenants[0].uids = ()  # frozen


def test_tenants_inside_the_kvtierd_table(tmp_path):
    cfg = load_config(write_toml(tmp_path, '[kvtierd.tenants.t1]\nuids = [5]\n'), env={})
    assert cfg.tenants[0].name == "t1" and cfg.tenants[0].max_bytes is None


@pytest.mark.parametrize("text, key, value", [
    ('[tenants.a]\nuids = [1]\n[tenants.b]\nuids = [1]\n', "tenants.b.uids", "tenants.a"),
    ('[tenants.a]\ngids = [7]\n[tenants.b]\ngids = [7]\n', "tenants.b.gids", "7"),
    ('[tenants.a]\ntokens = ["t"]\n[tenants.b]\ntokens = ["t"]\n', "tenants.b.tokens", "***"),
    ('[tenants.a]\nuids = [-1]\n', "tenants.a.uids", "-1"),
    ('[tenants.a]\nuids = [4294967296]\n', "tenants.a.uids", "4294967296"),
    ('[tenants.a]\nuids = "1001"\n', "tenants.a.uids", "1001"),
    ('[tenants.a]\ntokens = [""]\n', "tenants.a.tokens", "***"),
    ('[tenants.a]\nuids = [1]\nmax_bytes = "lots"\n', "tenants.a.max_bytes", "lots"),
    ('[tenants.a]\nuids = [1]\ncolour = "red"\n', "tenants.a.colour", "red"),
    ('[tenants.a]\n', "tenants.a", "at least one of"),
    ('[tenants.anonymous]\nuids = [1]\n', "tenants.anonymous", "anonymous"),
    ('[tenants.other]\nuids = [1]\n', "tenants.other", "other"),
    ('[tenants."uid:5"]\nuids = [1]\n', "tenants.uid:5", "uid:5"),
    ('tenants = 3\n', "tenants", "3"),
    ('state_dir_mode = "0777"\n', "state_dir_mode", "0777"),
])
def test_bad_tenants_name_key_and_value(tmp_path, text, key, value):
    err = refused(key, value, path=write_toml(tmp_path, text))
    assert "s3cret" not in str(err)


def test_tenants_only_from_the_file():
    refused("KVTIERD_TENANTS", "x", env={"KVTIERD_TENANTS": "x"})
    refused("tenants", "x", overrides={"tenants": "x"})


def test_token_of_a_tenant_is_not_shown_in_errors(tmp_path):
    text = '[tenants.a]\ntokens = ["hunter2"]\n[tenants.b]\ntokens = ["hunter2"]\n'
    err = refused("tenants.b.tokens", "***", path=write_toml(tmp_path, text))
    assert "hunter2" not in str(err)
