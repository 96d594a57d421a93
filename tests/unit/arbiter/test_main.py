"""``python -m cardshare.arbiter``: the token file's mode, a damaged database, and an engine
loop that ends by itself (the process exits non-zero so the container restarts)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from cardshare.arbiter import __main__ as arbiter_main
from cardshare.arbiter.config import ConfigError, load_config
from cardshare.arbiter.engine import Engine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config_file(tmp_path: Path, token_mode: int = 0o600) -> Path:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(token_mode)
    path = tmp_path / "arbiter.json"
    path.write_text(
        json.dumps(
            {
                "data_dir": str(tmp_path / "data"),
                "vllm_url": "http://127.0.0.1:9",
                "served_model_name": "m",
                "comfyui_url": "http://127.0.0.1:9",
                "card_current_json": str(tmp_path / "current.json"),
                "token_file": str(token),
                "docker_socket": str(tmp_path / "no-docker.sock"),
                "listen_port": _free_port(),
            }
        )
    )
    return path


def test_world_readable_token_file_is_refused(tmp_path: Path) -> None:
    config = load_config(_config_file(tmp_path, token_mode=0o644))
    with pytest.raises(ConfigError) as info:
        arbiter_main.read_token(config)
    assert str(info.value) == (
        f"config key 'token_file' has value {str(tmp_path / 'token')!r}: the file has mode 0644, "
        f"readable by others than its owner; chmod 600 {tmp_path / 'token'}"
    )
    assert arbiter_main.main(["--config", str(_config_file(tmp_path, 0o640))]) == 2


def test_check_reads_the_config_only_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--check (what the role runs in the image before it touches the project): the config is
    parsed as the service would; the token file and the database are not there to read yet."""
    path = _config_file(tmp_path)
    (tmp_path / "token").unlink()
    assert arbiter_main.main(["--config", str(path), "--check"]) == 0
    assert capsys.readouterr().out == f"cardshare.arbiter: {path} is valid\n"
    assert not (tmp_path / "data").exists()
    config = json.loads(path.read_text())
    config["listen_port"] = 0
    path.write_text(json.dumps(config))
    assert arbiter_main.main(["--config", str(path), "--check"]) == 2
    assert capsys.readouterr().err.startswith("cardshare.arbiter: config key 'listen_port' has ")


def test_empty_database_stops_the_arbiter_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config_file(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / arbiter_main.DB_NAME).write_bytes(b"")
    assert arbiter_main.main(["--config", str(path)]) == 3
    err = capsys.readouterr().err
    assert "is empty (0 bytes): it is kept for inspection" in err
    assert (tmp_path / "data" / arbiter_main.DB_NAME).stat().st_size == 0


def test_engine_loop_that_ends_exits_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def dies(self: Engine, stop: Any) -> None:
        raise RuntimeError("the loop broke")

    monkeypatch.setattr(Engine, "run", dies)
    assert arbiter_main.main(["--config", str(_config_file(tmp_path))]) == 1
    assert "the engine's loop ended: RuntimeError: the loop broke" in caplog.text


def test_the_process_closes_slow_clients_and_stops_on_sigterm(tmp_path: Path) -> None:
    """The arbiter as a real process: a client that sends half a request head and stalls is
    disconnected after header_timeout_seconds while /v1/health still answers (no Docker
    here: the engine runs, alerts and backs off); SIGTERM ends it with status 0."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    path = _config_file(tmp_path)
    config = json.loads(path.read_text())
    config.update(header_timeout_seconds=0.5, poll_interval_seconds=0.1)
    path.write_text(json.dumps(config))
    src = Path(arbiter_main.__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cardshare.arbiter", "--config", str(path)],
        env={**os.environ, "PYTHONPATH": str(src)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{config['listen_port']}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{base}/v1/health", timeout=2) as resp:
                    assert json.load(resp)["healthy"] is True
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the arbiter did not come up"
                time.sleep(0.1)
        slow = socket.create_connection(("127.0.0.1", config["listen_port"]), timeout=5)
        slow.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        started = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the arbiter
        assert time.monotonic() - started < 3
        slow.close()
        with urllib.request.urlopen(f"{base}/v1/status", timeout=5) as resp:
            alerts = {a["name"] for a in json.load(resp)["alerts"]}
        assert "docker" in alerts
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err.decode()[-2000:]
