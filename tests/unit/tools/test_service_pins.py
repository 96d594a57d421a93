"""The services' pins agree everywhere they are written: requirements-dev.txt (the tests' venv),
pyproject's `services` extra (a range the pins fall in), the lab's pybase image (the lab runs
the pinned versions, offline) and the arbiter's Dockerfile and role defaults (a real host)."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
PINNED = {"aiohttp": "AIOHTTP_VERSION", "prometheus-client": "PROMETHEUS_CLIENT_VERSION"}


def dev_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        name, sep, pin = line.partition("==")
        if sep and not line.startswith("#"):
            pins[name.strip().lower()] = pin.strip()
    return pins


def dockerfile_args(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG ([A-Z_]+)=(\S+)$", path.read_text(), re.MULTILINE))


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pins_agree(name: str) -> None:
    pin = dev_pins()[name]
    arg = PINNED[name]
    assert dockerfile_args(ROOT / "lab/images/pybase/Dockerfile")[arg] == pin
    assert dockerfile_args(ROOT / "roles/arbiter/files/Dockerfile")[arg] == pin
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["services"]
    (req,) = (Requirement(r) for r in extra if Requirement(r).name == name)
    assert req.specifier.contains(pin), f"{name}=={pin} is outside pyproject's {req}"
    assert version(name) == pin, f"the venv has {name} {version(name)}: run tools/venv.sh"


def test_role_default_is_the_aiohttp_pin() -> None:
    defaults = yaml.safe_load((ROOT / "roles/arbiter/defaults/main.yml").read_text())
    assert defaults["arbiter_aiohttp_version"] == dev_pins()["aiohttp"]


def test_pybase_carries_the_build_backend_pyproject_asks_for() -> None:
    """The lab builds the package with pybase's setuptools (no build isolation, no network)."""
    backend = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    (req,) = (Requirement(r) for r in backend if Requirement(r).name == "setuptools")
    pinned = dockerfile_args(ROOT / "lab/images/pybase/Dockerfile")["SETUPTOOLS_VERSION"]
    assert req.specifier.contains(pinned)
