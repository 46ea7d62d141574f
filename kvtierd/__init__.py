"""kvtierd: a node-local tiered KV-cache store for LLM inference engines."""

__version__ = "0.1.0"
