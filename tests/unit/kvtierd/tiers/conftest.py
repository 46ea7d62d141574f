"""Fixtures of the NvmeTier tests (tests/helpers/nvme_tier.py): arena, arena_pages, nvme_dir,
tiers; of the CPU batch-primitive tests (tests/helpers/cpu_pair.py): pair."""

from helpers.cpu_pair import pair  # noqa: F401
from helpers.nvme_tier import arena, arena_pages, nvme_dir, tiers  # noqa: F401
