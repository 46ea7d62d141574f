"""The Dockerfile: hadolint, what the image promises (non-root, health check, entrypoint, ports,
volumes), and — since no Docker engine runs here — its build steps replayed in a fresh venv from
exactly the files the build context holds, then the daemon started the way the image starts it."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from helpers.workload import REPO

from kvtierd.config import load_config

pytestmark = pytest.mark.timeout(300)

DOCKERFILE = REPO / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        if line.strip().startswith("#") and not current:
            continue
        if line.strip().startswith("#"):
            continue
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if line.rstrip().endswith("\\"):
            continue
        if current:
            word, _, args = current.partition(" ")
            out.append((word.upper(), args.strip()))
        current = ""
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions(DOCKERFILE.read_text())
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, args in stage:
        if word == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def exec_form(args: str) -> list[str]:
    return json.loads(args)


def daemon_requirements() -> list[str]:
    """The quoted requirement strings the final stage pip-installs."""
    runs = " ".join(args for word, args in final_stage() if word == "RUN")
    return re.findall(r'"([A-Za-z0-9_.-]+[<>=!~][^"]*)"', runs)


def test_hadolint_passes(hadolint_tool):
    result = hadolint_tool.run("--no-color", str(DOCKERFILE))
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_really_lints(hadolint_tool, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    result = hadolint_tool.run("--no-color", str(bad))
    assert result.returncode != 0 and "DL3007" in result.stdout, result.stdout


def test_the_image_runs_the_daemon_as_a_non_root_user_with_a_ping_health_check():
    stage = final_stage()
    words = dict(stage)  # the last of each instruction wins, as in Docker
    assert re.fullmatch(r"\$\{PYTHON_IMAGE\}", words["FROM"])
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text()).group(1)
    assert re.fullmatch(r"python:3\.1[1-9]-slim-\w+", base), base
    user = words["USER"].split(":")
    assert all(part.isdigit() and int(part) != 0 for part in user), words["USER"]
    health = words["HEALTHCHECK"]
    assert "--start-period" in health
    assert exec_form(health.split("CMD", 1)[1].strip())[:2] == ["kvtierd", "ping"]
    entry = exec_form(words["ENTRYPOINT"])
    assert entry[:2] == ["/bin/sh", "-c"] and "exec kvtierd serve \"$@\"" in entry[2]
    assert words["STOPSIGNAL"] == "SIGTERM"
    env = env_of(stage)
    cfg = load_config(image_config_source(), env={})
    port = cfg.metrics_addr.rsplit(":", 1)[1]
    assert words["EXPOSE"] == port
    assert cfg.metrics_addr.startswith("0.0.0.0:")  # scrapable from outside
    volumes = exec_form(words["VOLUME"])
    assert cfg.ipc_path is not None and str(cfg.ipc_path.parent) in volumes
    assert f"{env['XDG_STATE_HOME']}/kvtierd" in volumes  # persistent tiers


def image_config_source() -> Path:
    """The build-context file the final stage copies to the path KVTIERD_CONFIG names."""
    target = env_of(final_stage())["KVTIERD_CONFIG"]
    copies = [args.split() for word, args in final_stage()
              if word == "COPY" and "--from" not in args]
    sources = [REPO / src for *srcs, dest in copies for src in srcs if dest == target]
    assert len(sources) == 1, (target, copies)
    return sources[0]


def test_the_image_environment_sets_no_config_key_that_would_shadow_a_mounted_file():
    """Regression: ENV KVTIERD_SOCKET / KVTIERD_METRICS_ADDR silently overrode the socket and
    metrics address of a mounted config file (a Kubernetes ConfigMap): env beats file."""
    env = env_of(final_stage())
    assert [k for k in env if k.startswith("KVTIERD_")] == ["KVTIERD_CONFIG"], env
    # the socket and metrics address live in the image's own file, which a mount replaces
    cfg = load_config(image_config_source(), env={})
    assert cfg.socket == "ipc:///run/kvtierd/kvtierd.sock" and cfg.metrics_addr == "0.0.0.0:9464"
    # and ARG/ENTRYPOINT/CMD do not set one either
    text = " ".join(args for word, args in final_stage() if word in {"ARG", "ENTRYPOINT", "CMD"})
    assert "KVTIERD_" not in text and "--socket" not in text and "--metrics-addr" not in text


def test_daemon_dependencies_are_pyproject_less_the_engine_side():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    engine_only = {"torch", "numpy"}
    expected = [d for d in project["dependencies"]
                if re.match(r"[A-Za-z0-9_.-]+", d).group(0) not in engine_only]
    assert daemon_requirements() == expected


def context_files() -> list[Path]:
    """Files a `docker build .` sends, following .dockerignore ("*" then "!" exceptions)."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    chosen = []
    for path in REPO.rglob("*"):
        if not path.is_file() or ".git" in path.parts:
            continue
        rel = path.relative_to(REPO).as_posix()
        keep = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern.lstrip("!").rstrip("/")
            if (fnmatch.fnmatch(rel, pat) or rel.startswith(pat + "/")
                    or fnmatch.fnmatch(rel, pat.replace("**/", "*/"))
                    or fnmatch.fnmatch(path.name, pat.removeprefix("**/"))):
                keep = negate
        if keep:
            chosen.append(path)
    return chosen


@pytest.mark.slow
def test_build_steps_replayed_give_a_daemon_that_serves_and_passes_its_health_check(tmp_path):
    # 1. the build context, and only the paths the build stage COPYs from it
    context = tmp_path / "context"
    copies = [args.split() for word, args in instructions(DOCKERFILE.read_text())
              if word == "COPY" and "--from" not in args]
    sources = {src for args in copies for src in args[:-1]}
    files = context_files()
    for path in files:
        rel = path.relative_to(REPO)
        if rel.parts[0] in sources or rel.as_posix() in sources:
            (context / rel).parent.mkdir(parents=True, exist_ok=True)
            (context / rel).write_bytes(path.read_bytes())
    for src in sources:
        assert (context / src).exists(), f"COPY {src}: not in the build context"
    # 2. the final stage's install: daemon dependencies, then the project without its own
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *daemon_requirements()], check=True, timeout=240)
    subprocess.run([*pip, "--no-deps", str(context)], check=True, timeout=240)
    # 3. start it as the ENTRYPOINT does, with the image's environment and an operator's config
    #    file mounted at KVTIERD_CONFIG (paths moved to tmp): the file's socket and metrics
    #    address are the ones the daemon and its health check use
    stage = final_stage()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")},
           **env_of(stage)}
    socket_path = tmp_path / "run" / "kvtierd.sock"
    socket_path.parent.mkdir(mode=0o750)
    mounted = tmp_path / "etc" / "kvtierd.toml"
    mounted.parent.mkdir()
    mounted.write_text(f'socket = "ipc://{socket_path}"\nmetrics_addr = "127.0.0.1:0"\n')
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", KVTIERD_CONFIG=str(mounted),
               XDG_STATE_HOME=str(tmp_path / "state"),
               KVTIERD_CPU_BYTES="16MiB", KVTIERD_NVME_BYTES="64MiB",
               KVTIERD_ARENA_NAME=f"kvtierd-docker-test-{os.getpid()}")
    words = dict(stage)
    entry = exec_form(words["ENTRYPOINT"])
    health = exec_form(words["HEALTHCHECK"].split("CMD", 1)[1].strip())
    log = open(tmp_path / "daemon.log", "wb")
    proc = subprocess.Popen([*entry, "--log-level", "INFO"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            check = subprocess.run(health, env=env, capture_output=True, text=True, timeout=30)
            if check.returncode == 0:
                break
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
            assert time.monotonic() < deadline, check.stderr + (tmp_path / "daemon.log").read_text()
            time.sleep(0.2)
        assert socket_path.is_socket()  # the mounted file's socket, not the image's
        # the entrypoint's umask: engines in the daemon's group may connect to the socket
        assert stat.S_IMODE(socket_path.stat().st_mode) & 0o060 == 0o060
        assert stat.S_IMODE(socket_path.stat().st_mode) & 0o007 == 0
        proc.send_signal(getattr(signal, words["STOPSIGNAL"]))
        assert proc.wait(timeout=30) == 0, (tmp_path / "daemon.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    check = subprocess.run(health, env=env, capture_output=True, text=True, timeout=30)
    assert check.returncode != 0, "the health check must fail when the daemon is gone"
    text = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in text and "torch" not in text, text
    # the build compiled the copy loop (setup.py is in the context and the build stage)
    assert ("host copies: compiled copies and xxh3, index columns: compiled, request items: "
            "compiled, lru stamps: compiled, ghost sampling: compiled, ghosts: compiled") in text, text
