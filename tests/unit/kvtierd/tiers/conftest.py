"""Fixtures of the NvmeTier tests (tests/helpers/nvme_tier.py): arena, arena_pages, nvme_dir,
tiers."""

from helpers.nvme_tier import arena, arena_pages, nvme_dir, tiers  # noqa: F401
