"""Storage tiers. Tiers never import the server; the server drives them from its loop."""
