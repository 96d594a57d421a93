"""Fixtures for module tests; the helpers live in ``gpuhost_sim``."""

from __future__ import annotations

from gpuhost_sim import run_module, sim

__all__ = ["run_module", "sim"]
