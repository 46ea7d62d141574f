"""Moving bytes between client staging buffers and tiers, off the request loop."""
