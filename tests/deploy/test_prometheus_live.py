"""A real Prometheus server on loopback scrapes a live daemon (1 s interval) with our rules loaded:
after a workload, what Prometheus stored matches `kvtierd stats`, the rules evaluate healthy, and
every Grafana dashboard query runs without error."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from helpers.workload import DEPLOY, engine_half_hits, run_workload
from test_grafana_dashboard import dashboard, queries

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, tool, workdir, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules = workdir / "kvtierd-rules.yml"
        rules.write_text((DEPLOY / "prometheus" / "kvtierd-rules.yml").read_text())
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "kvtierd", "static_configs": [{"targets": [target]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = tool.popen(
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            stdout=self.log, stderr=subprocess.STDOUT)
        self.workdir = workdir

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
        return body

    def query(self, expr: str) -> dict[frozenset, float]:
        body = self.api("query", query=expr)
        assert body["status"] == "success", (expr, body)
        return {frozenset(r["metric"].items()): float(r["value"][1])
                for r in body["data"]["result"]}

    def wait_until(self, what: str, check, timeout_s: float = 60.0):
        """Poll ``check()`` (returns (ok, detail)) until ok; fail naming ``what`` and the detail."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, (self.workdir / "prometheus.log").read_text()[-3000:]
            try:
                ok, detail = check()
            except (OSError, urllib.error.URLError) as exc:
                ok, detail = False, exc
            if ok:
                return detail
            assert time.monotonic() < deadline, f"{what}: {detail}"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus(prometheus_server, daemon_factory, tmp_path):
    d = daemon_factory("--nvme-bytes", "0", cpu_bytes="4MiB")
    metrics_url = urllib.parse.urlparse(d.stats()["daemon"]["metrics"])
    prom = Prometheus(prometheus_server, tmp_path, metrics_url.netloc)

    def ready():
        with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5) as resp:
            return resp.status == 200, resp.status

    prom.wait_until("Prometheus ready", ready)
    yield prom, d
    prom.stop()


def only(samples: dict[frozenset, float], **labels: str) -> float:
    want = set(labels.items())
    found = [v for k, v in samples.items() if want <= k]
    assert len(found) == 1, (labels, samples)
    return found[0]


def test_prometheus_sees_what_kvtierd_stats_says(prometheus):
    prom, d = prometheus
    prom.wait_until("target up", lambda: (prom.query('up{job="kvtierd"}') and
                                          set(prom.query('up{job="kvtierd"}').values()) == {1.0},
                                          prom.query("up")))
    seen = run_workload(d.address)
    stats = d.stats()
    cpu, counts, ghost = stats["tiers"]["cpu"], stats["counts"], stats["ghosts"]["cpu"]
    hits, cpu_hits = counts.get("lookup_hits", 0), counts.get("lookup_hits_cpu", 0)
    misses = counts.get("lookup_misses", 0)
    assert hits == seen["hits"] and hits + misses == seen["lookups"]
    assert (counts["get_served"], counts["get_failed"]) == \
        (seen["served"], seen["gets"] - seen["served"])
    expected = {
        'kvtierd_tier_used_bytes{tier="cpu"}': cpu["used_bytes"],
        'kvtierd_tier_capacity_bytes{tier="cpu"}': cpu["capacity_bytes"],
        'kvtierd_tier_chunks{tier="cpu", state="ready"}': cpu["chunks"],
        'kvtierd_evictions_total{tier="cpu"}': cpu["evictions"],
        'kvtierd_hits_total{tier="cpu"}': cpu_hits,
        "sum(kvtierd_hits_total)": hits,
        "sum(kvtierd_misses_total)": misses,
        'kvtierd_get_results_total{result="ok"}': seen["served"],
        "sum(kvtierd_get_results_total)": seen["gets"],
        'kvtierd_ghost_accesses_total{tier="cpu"}': ghost["accesses"],
        'kvtierd_ghost_hits_total{tier="cpu", scale="1"}': ghost["hits"]["1"],
        'kvtierd_ghost_hits_total{tier="cpu", scale="2"}': ghost["hits"]["2"],
        'kvtierd_ghost_hits_total{tier="cpu", scale="4"}': ghost["hits"]["4"],
        "kvtierd_sessions": stats["sessions"],
    }
    assert cpu["evictions"] > 0 and 0 < hits and misses > 0

    def stored():
        got = {expr: sum(prom.query(expr).values()) for expr in expected}
        return got == expected, {"prometheus": got, "stats": expected}

    prom.wait_until("Prometheus' values match kvtierd stats", stored)
    # the recording rules computed from those series agree too
    ratio = hits / (hits + misses)
    prom.wait_until("recorded tier usage", lambda: (
        only(prom.query("kvtierd:tier_used:ratio"), tier="cpu") ==
        cpu["used_bytes"] / cpu["capacity_bytes"], prom.query("kvtierd:tier_used:ratio")))
    assert 0 < ratio < 1


def test_rules_load_healthy_and_every_dashboard_query_evaluates(prometheus):
    prom, d = prometheus
    run_workload(d.address)

    # every rule of the file (counted from it: other rules land there without editing this test)
    ours = [r for g in yaml.safe_load((DEPLOY / "prometheus" / "kvtierd-rules.yml").read_text())
            ["groups"] for r in g["rules"]]

    def rules_healthy():
        groups = prom.api("rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return (len(rules) == len(ours) and all(r["health"] == "ok" for r in rules),
                [(r["name"], r["health"], r.get("lastError")) for r in rules])

    prom.wait_until("rules loaded and healthy", rules_healthy)
    alerts = {r["name"] for g in prom.api("rules", type="alert")["data"]["groups"]
              for r in g["rules"]}
    assert alerts == {r["alert"] for r in ours if "alert" in r}
    for title, expr in queries(dashboard()):
        concrete = (expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
                    .replace("$tier", ".*"))
        if concrete.startswith("label_values("):
            metric = concrete[len("label_values("):].rsplit(",", 1)[0]
            concrete = f"count({metric})"
        body = prom.api("query", query=concrete)
        assert body["status"] == "success", (title, concrete, body)


def test_recorded_hit_ratio_of_engines_hitting_half_the_time_is_half(prometheus):
    """Regression: the LOOKUP hit and the GET that loads it were both counted as hits, so 50 %
    engine hits were recorded as 0.67 (2 hits per hit, 1 miss per miss)."""
    prom, d = prometheus
    prom.wait_until("target up", lambda: (set(prom.query('up{job="kvtierd"}').values()) == {1.0},
                                          prom.query("up")))
    seen = engine_half_hits(d.address)
    assert seen["hits"] * 2 == seen["lookups"] and seen["served"] == seen["hits"]

    def counted():  # the last GETs came after every LOOKUP: scraped, the traffic is all in
        got = (sum(prom.query("sum(kvtierd_misses_total)").values()),
               sum(prom.query('sum(kvtierd_get_results_total{result="ok"})').values()))
        return got == (seen["lookups"] - seen["hits"], seen["served"]), got

    prom.wait_until("the scraped counters", counted)
    # the rule evaluated after a scrape that holds the final counts (transient values while the
    # traffic ran do not count), then its value
    scraped = max(prom.query("timestamp(kvtierd_misses_total)").values())
    prom.wait_until("a rule evaluation after that scrape", lambda: (
        max(prom.query("timestamp(kvtierd:hit:ratio10m)").values(), default=0) > scraped + 1,
        prom.query("timestamp(kvtierd:hit:ratio10m)")))
    ratio = prom.query("kvtierd:hit:ratio10m")
    assert list(ratio.values()) == [pytest.approx(0.5, abs=1e-9)], ratio
    assert sum(prom.query("sum(kvtierd_hits_total)").values()) == seen["hits"]
    failed = prom.query("kvtierd:get_failed:ratio10m")
    assert list(failed.values()) == [0.0], failed
