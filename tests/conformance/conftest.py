"""The conformance lane: the project's code against real upstream vLLM on the CPU.

Run by ``make conformance`` (tools/conformance.sh), which makes the vLLM virtualenv and the
tiny model and passes them as ``CONFORMANCE_VLLM_BIN`` and ``CONFORMANCE_MODEL``. The default
unit run never collects these tests (pyproject's testpaths is tests/unit) and each module
carries the ``conformance`` marker.

vLLM runs as a real server process (``vllm serve``), one at a time: the machine has two cores.
Its environment differs from the role's container only where the CPU needs it:
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; without it vLLM's CPU backend sizes the KV cache from
``--gpu-memory-utilization`` of the host's memory, 14 GiB here) and a ``HOME`` of its own under
.cache/conformance (vLLM's compile cache lives there, so a second run starts faster, and the
user's home is left as found).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "conformance"
SERVED_NAME = "Qwen2.5-7B-Instruct"
# The catalog entry's directory under the model root (vllm_model_catalog's path): the tiny
# model is linked there, so the role's own model path points at it.
MODEL_ENTRY_PATH = "Qwen2.5-7B-Instruct"
# vLLM's start on two shared cores: about 45 s of imports before the engine, a minute or two
# of torch.compile on a cold compile cache.
START_TIMEOUT = 600.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "conformance: against real vLLM on the CPU (make conformance; minutes)"
    )


def _required_env(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        pytest.fail(f"{name} is not set: run the conformance lane with `make conformance`")
    return value


@pytest.fixture(scope="session")
def vllm_bin() -> Path:
    path = Path(_required_env("CONFORMANCE_VLLM_BIN"))
    if not (path / "vllm").exists():
        pytest.fail(f"CONFORMANCE_VLLM_BIN={path} has no vllm: run `make conformance`")
    return path


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model root (vllm_model_dir) whose catalog entry directory is the tiny model."""
    model = Path(_required_env("CONFORMANCE_MODEL"))
    if not (model / "config.json").exists():
        pytest.fail(f"CONFORMANCE_MODEL={model} has no config.json: run `make conformance`")
    root = tmp_path_factory.mktemp("models")
    (root / MODEL_ENTRY_PATH).symlink_to(model, target_is_directory=True)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """vLLM's environment; a None in ``extra`` unsets the variable (an empty
    VLLM_CPU_KVCACHE_SPACE is not "unset" to vLLM 0.32: its worker fails on int(''))."""
    home = CACHE / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # the role's own environment (Intel's examples)
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@dataclass
class VllmServer:
    """``vllm serve`` as a process of its own session; stdout and stderr in one log file."""

    bin_dir: Path
    args: Sequence[str]
    log_path: Path
    env_extra: dict[str, str | None] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_seconds: float | None = None

    @property
    def port(self) -> int:
        return int(self.args[list(self.args).index("--port") + 1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child holds it
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [str(self.bin_dir / "vllm"), "serve", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=vllm_env(self.env_extra),
            start_new_session=True,
        )
        log.close()
        return self

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return None

    def wait_ready(self, timeout: float = START_TIMEOUT) -> bool:
        """True once /health answers 200; False when the process exited first."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health() == 200:
                self.ready_seconds = time.monotonic() - self.started_at
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(1.0)
        raise AssertionError(f"vLLM neither answered nor exited in {timeout:.0f}s: {self.log_path}")

    def wait_exit(self, timeout: float = START_TIMEOUT) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> None:
        """SIGTERM to the whole session, SIGKILL after 30 s: vLLM's worker processes too (a
        killed engine core leaves its worker running, reparented to init)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def serve(vllm_bin: Path) -> Iterator[object]:
    """Start ``vllm serve ARGS`` (one at a time); every server is stopped at the end."""
    servers: list[VllmServer] = []

    def start(
        args: Sequence[str], log_name: str, env: dict[str, str | None] | None = None
    ) -> VllmServer:
        for s in servers:  # one vLLM at a time: two cores
            s.stop()
        server = VllmServer(vllm_bin, list(args), CACHE / "logs" / log_name, env or {})
        servers.append(server.start())
        return server

    yield start
    for s in servers:
        s.stop()


def tiny_args(model_root: Path, port: int, *more: str, max_model_len: int = 32768) -> list[str]:
    """The role's native-window rung (the ladder's last) for the tiny model, plus ``more``."""
    return [
        str(model_root / MODEL_ENTRY_PATH),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--gpu-memory-utilization",
        "0.61",
        "--max-model-len",
        str(max_model_len),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        *more,
    ]


def run_playbook(
    inventory: str, playbook: str, extra: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """``ansible-playbook`` of the development virtualenv on ``playbook`` with ``extra`` vars."""
    bindir = Path(sys.executable).parent
    return subprocess.run(
        [str(bindir / "ansible-playbook"), "-i", inventory, playbook, "-e", json.dumps(extra)],
        cwd=REPO,
        env={**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until the proxy ``proc`` listens on ``port`` (30 s); its log if it exits first."""
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the proxy did not listen"
            time.sleep(0.2)
