"""The daemon's request loop: one ROUTER socket, sessions, op handlers."""
