"""``kvtierd serve`` with a ``DirRemoteTier`` at the end of its tier chain (tests only).

Usage: ``python tests/helpers/dir_remote_serve.py REMOTE_DIR [kvtierd serve flags...]``. The
remote's publishing policy comes from the daemon's own config (``remote_publish``,
``remote_publish_after_reads``), exactly as a configured remote tier's does. Two daemons run one
after the other on the same REMOTE_DIR are two "nodes" sharing one remote store (the directory is
locked by one daemon at a time).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.dir_remote import DirRemoteTier  # noqa: E402
from kvtierd import cli  # noqa: E402
from kvtierd.server.daemon import Daemon  # noqa: E402
from kvtierd.server.tier_setup import remote_policy  # noqa: E402

REMOTE_BYTES = 64 * 1024**2


def main() -> int:
    remote_dir = Path(sys.argv[1])
    chain_tiers = Daemon._lower_tiers

    def with_remote(self, cfg):
        tiers = chain_tiers(self, cfg)
        tiers.append((DirRemoteTier(remote_dir, REMOTE_BYTES, cfg.page_bytes),
                      remote_policy(cfg)))
        return tiers

    Daemon._lower_tiers = with_remote
    return cli.main(["serve", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
