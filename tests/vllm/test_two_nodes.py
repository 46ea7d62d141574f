"""Real vLLM on two "nodes" sharing a real Mooncake Store: node B's engine takes its prefix from
what node A's engine computed, with the same tokens and logprobs.

Two daemons (their own sockets, arenas and NVMe directories) run inside the master's private
network namespace (``helpers.mooncake``), node B as a pure client of the store (no segment of its
own: every byte it loads comes from node A's). Each vLLM engine runs in its own process on its
node's daemon (ipc sockets are files: they reach into the namespace). Engine A computes and stores;
its daemon publishes every commit to the store (``remote_publish = "on-commit"``); engine B, whose
daemon never saw these prompts, must answer them from the remote tier: external hits, none local,
identical tokens, logprobs within the batch-shape noise (float32, as in test_offloading_spec).
"""

from __future__ import annotations

import uuid

import pytest
from helpers import mooncake as mc
from helpers.nvme import metric
from helpers.vllm_engine import assert_close, drive
from helpers.wait import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow,  # two engines and a master: about a minute
              pytest.mark.skipif(mc.unavailable_reason() is not None,
                                 reason=str(mc.unavailable_reason()))]


def scrape(master, daemon) -> str:
    with master.ns.entered():  # the daemons' exporters listen inside the namespace
        return daemon.metrics_text()


def test_node_b_serves_from_the_remote_tier_what_node_a_computed(daemon_factory, tmp_path):
    master = mc.shared_master(tmp_path / "mooncake")
    cluster = f"vllm-{uuid.uuid4().hex[:12]}"

    def node(name: str, **remote):
        config = tmp_path / f"{name}.toml"
        config.write_text(master.remote_toml(cluster_id=cluster, **remote))
        return daemon_factory("--config", str(config), preexec_fn=master.ns.preexec)

    a, b = node("a"), node("b", global_segment_bytes=0)
    common = dict(kind="gemma4", model_dir=str(tmp_path / "model"), dtype="float32")
    first = drive(tmp_path, "node-a", address=a.address, **common,
                  rounds=[{"name": "A", "settle": True}])
    committed = a.cpu()["committed_bytes"]
    assert committed > 0
    wait_for(lambda: metric(scrape(master, a), "kvtierd_bytes_total", direction="write_through",
                            tier="remote") >= committed, 60,
             "node A published every chunk its engine stored")
    assert b.cpu()["chunks"] == 0  # node B has seen nothing of these prompts

    second = drive(tmp_path, "node-b", address=b.address, **common, rounds=[{"name": "X"}])
    a_round, x = first["rounds"]["A"], second["rounds"]["X"]
    assert x["external_hits"] > 0, x
    assert x["local_hits"] == 0, x
    assert all(n >= 512 for n in x["num_cached_tokens"]), x["num_cached_tokens"]
    assert x["tokens"] == a_round["tokens"]
    assert_close(x["logprobs"], a_round["logprobs"])
    text = scrape(master, b)
    assert metric(text, "kvtierd_hits_total", tier="remote") > 0
    assert metric(text, "kvtierd_bytes_total", direction="promote", tier="remote") > 0
    assert metric(text, "kvtierd_integrity_failures_total", tier="remote") == 0
