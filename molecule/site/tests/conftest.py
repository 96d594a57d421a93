"""Fixtures of the site scenario's tests: the lab host's address on the project's bridge
network, and the arbiter's and the proxy's base URLs there."""

from __future__ import annotations

import subprocess

import pytest

HOST = "cardshare-molecule-site"


@pytest.fixture(scope="module")
def address() -> str:
    out = subprocess.run(
        [
            "docker",
            "inspect",
            "-f",
            "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
            HOST,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert out, f"{HOST} has no address on a bridge network"
    return out


@pytest.fixture(scope="module")
def arbiter(address: str) -> str:
    return f"http://{address}:8090"


@pytest.fixture(scope="module")
def proxy(address: str) -> str:
    return f"http://{address}:8080"
