"""The proxy's event loop: uvloop's where installed, else asyncio's (and on request)."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from types import ModuleType

import pytest

from cardshare.proxy import __main__ as entry


def test_asyncio_when_asked() -> None:
    factory, name = entry.loop_factory(use_uvloop=False)
    assert (factory, name) == (asyncio.new_event_loop, "asyncio")


def test_uvloop_when_installed() -> None:
    factory, name = entry.loop_factory()
    if importlib.util.find_spec("uvloop") is None:
        assert name == "asyncio"
        return
    import uvloop

    assert name == f"uvloop {uvloop.__version__}"
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def test_asyncio_when_uvloop_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def without_uvloop(name: str, package: str | None = None) -> ModuleType:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", without_uvloop)
    assert entry.loop_factory()[1] == "asyncio"
