"""Runtimes: how a request reaches a loaded session (legacy: one session per model)."""
