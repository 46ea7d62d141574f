"""deploy/kubernetes/: every manifest validates against Kubernetes' own schemas (strict: no unknown
fields), its TOML config loads with the daemon's config loader, and the fields that make a node's
daemon and its engines meet agree: socket directory, groups, probes, ports, memory and the
daemon's /dev/shm. (test_vllm_args.py parses the engines' vLLM command lines with vLLM itself.)"""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from helpers.workload import DEPLOY

from kvtierd.config import load_config

K8S = DEPLOY / "kubernetes"
K8S_VERSION = "1.30.0"
GiB = 1024**3
PROBE = ["kvtierd", "ping"]


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(name: str, kind: str) -> dict:
    found = [d for d in docs(name) if d["kind"] == kind]
    assert len(found) == 1, (name, kind)
    return found[0]


def quantity(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1}
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|)", str(text)).groups()
    return int(number) * units[unit]


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


def mounts(c: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in c["volumeMounts"]}


def check_daemon_shm(pod: dict, c: dict, cfg) -> None:
    """The daemon's /dev/shm: a memory emptyDir holding the arena, within the memory limit."""
    shm = {v["name"]: v for v in pod["volumes"]}["shm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    # 64 MiB is Kubernetes' default /dev/shm; the arena and its rounding must fit
    assert quantity(shm["sizeLimit"]) >= cfg.cpu_bytes + GiB // 2
    # the tmpfs counts against the container's memory: a sizeLimit above the limit would make the
    # OOM killer, not a full /dev/shm, the first to stop the arena
    assert quantity(shm["sizeLimit"]) < quantity(c["resources"]["limits"]["memory"])


def check_engine_shares_nothing_but_the_socket_dir(epod: dict, engine: dict) -> None:
    """Regression: engines set KVTIERD_SOCKET (which kvtier_client never reads) and
    KVTIER_STAGING_GROUP, and shared the host's /dev/shm for staging; the memfd handshake over
    the socket directory replaces all of it."""
    names = {e["name"] for e in engine.get("env", [])}
    assert not {n for n in names if n.startswith(("KVTIERD_", "KVTIER_"))}, names
    host_paths = [v["hostPath"]["path"] for v in epod["volumes"] if "hostPath" in v]
    assert "/dev/shm" not in host_paths and epod["hostIPC"] is False
    # vLLM keeps its own /dev/shm, a memory emptyDir (64 MiB is too small for its workers)
    dshm = next(v for v in epod["volumes"] if v["name"] == next(
        n for n, p in mounts(engine).items() if p == "/dev/shm"))
    assert dshm["emptyDir"]["medium"] == "Memory"


def gpu_scheduling(pod: dict) -> None:
    """Runs on GPU nodes, tainted ones included."""
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod["tolerations"]


def daemon_config(pod: dict, c: dict, configmaps: dict[str, dict], tmp_path):
    """The daemon's Config as the container sees it: the ConfigMap file named by KVTIERD_CONFIG."""
    path = env(c)["KVTIERD_CONFIG"]
    volume = next(v for v in pod["volumes"] if mounts(c).get(v["name"]) and
                  path.startswith(mounts(c)[v["name"]] + "/"))
    cm = configmaps[volume["configMap"]["name"]]
    key = path.rsplit("/", 1)[1]
    file = tmp_path / key
    file.write_text(cm["data"][key])
    return load_config(file, env={k: v for k, v in env(c).items() if k != "KVTIERD_CONFIG"})


def all_configmaps() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for f in K8S.glob("*.yaml") for d in docs(f.name)
            if d["kind"] == "ConfigMap"}


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_every_manifest_validates_strictly_against_the_kubernetes_schema(path):
    for doc in docs(path.name):
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema ships with Kubernetes (checked in test_pod_monitor)
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def check_daemon_container(pod: dict, c: dict, cfg, pod_meta: dict) -> None:
    # probes: the ping op through the daemon's own socket
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"][:2] == PROBE, probe
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 120
    # socket in the shared socket directory, /dev/shm mounted
    assert cfg.ipc_path is not None and str(cfg.ipc_path.parent) == mounts(c)["socket-dir"]
    assert mounts(c)["shm"] == "/dev/shm"
    # metrics: served on all interfaces at the declared port, which the annotations name
    host, port = cfg.metrics_addr.rsplit(":", 1)
    assert host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == int(port) == int(pod_meta["annotations"]["prometheus.io/port"])
    # memory: the arena is charged to this container; Guaranteed so it is never evicted first
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert quantity(limits["memory"]) == quantity(requests["memory"])
    assert quantity(limits["memory"]) >= cfg.cpu_bytes + GiB
    sc = {**pod.get("securityContext", {}), **c["securityContext"]}
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert pod["terminationGracePeriodSeconds"] >= 35  # the daemon drains for up to 30 s


def test_daemonset_and_node_engines_share_the_socket_dir_on_gpu_nodes(tmp_path):
    ds = one("daemonset.yaml", "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = container(pod, "kvtierd")
    cfg = daemon_config(pod, c, all_configmaps(), tmp_path)
    check_daemon_container(pod, c, cfg, ds["spec"]["template"]["metadata"])
    check_daemon_shm(pod, c, cfg)
    gpu_scheduling(pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    socket_host = volumes["socket-dir"]["hostPath"]["path"]
    assert pod["hostIPC"] is False and pod["hostPID"] is False
    assert not cfg.mlock  # see configmap.yaml: no swap, no RLIMIT_MEMLOCK in a container
    # the init container hands the host directories to the daemon's user, and nothing more
    init = pod["initContainers"][0]
    uid, gid = c["securityContext"]["runAsUser"], c["securityContext"]["runAsGroup"]
    assert f"chown {uid}:{gid} {mounts(init)['socket-dir']}" in " ".join(init["command"])
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                       "add": ["CHOWN", "FOWNER"]}
    # an engine pod on the node: the same host directory at the same place, in the daemon's group,
    # on the nodes that run a daemon
    engine_deploy = one("vllm-node-client.yaml", "Deployment")
    epod = engine_deploy["spec"]["template"]["spec"]
    engine = container(epod, "vllm")
    evolumes = {v["name"]: v for v in epod["volumes"]}
    sock_vol = next(n for n, p in mounts(engine).items() if p == str(cfg.ipc_path.parent))
    assert evolumes[sock_vol]["hostPath"]["path"] == socket_host
    assert gid in epod["securityContext"]["supplementalGroups"]
    check_engine_shares_nothing_but_the_socket_dir(epod, engine)
    gpu_scheduling(epod)


def test_sidecar_shares_the_socket_dir_and_sizes_the_daemons_dev_shm(tmp_path):
    deploy = one("sidecar.yaml", "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    c = container(pod, "kvtierd")
    cfg = daemon_config(pod, c, all_configmaps(), tmp_path)
    check_daemon_container(pod, c, cfg, deploy["spec"]["template"]["metadata"])
    check_daemon_shm(pod, c, cfg)
    engine = container(pod, "vllm")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts(engine)["socket-dir"] == mounts(c)["socket-dir"]
    assert "emptyDir" in volumes["socket-dir"]
    # each container its own /dev/shm: the daemon's arena is not the engine's
    assert "shm" not in mounts(engine)
    check_engine_shares_nothing_but_the_socket_dir(pod, engine)
    assert pod["hostIPC"] is False and pod["hostPID"] is False


def test_pod_monitor_scrapes_both_deployments_on_their_metrics_port():
    monitor = one("podmonitor.yaml", "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    expr = monitor["spec"]["selector"]["matchExpressions"][0]
    assert expr["key"] == "app.kubernetes.io/name" and expr["operator"] == "In"
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert {"targetLabel": "job", "replacement": "kvtierd"} in endpoint["relabelings"]
    for name, kind in (("daemonset.yaml", "DaemonSet"), ("sidecar.yaml", "Deployment")):
        template = one(name, kind)["spec"]["template"]
        assert template["metadata"]["labels"][expr["key"]] in expr["values"]
        ports = [p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])]
        assert endpoint["port"] in ports


def test_strict_validation_really_rejects_a_misspelt_field():
    ds = one("daemonset.yaml", "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # sic
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)
