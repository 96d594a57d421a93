"""The fault-injection rig: a fake Docker Engine (whose containers are a fake vLLM and a fake
ComfyUI, real processes), the card file it keeps, and the real arbiter
(``python -m cardshare.arbiter --config FILE``), all on 127.0.0.1 and a unix socket, plus
the checks every scenario ends with: consistent ``llm``, no job lost, none executed twice,
the alerts raised, the time back to ``llm``.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultkit import FaultFile, Settings, set_parent_death_signal
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOKEN = "fault-injection-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "fake-model"
SERVICES = ("docker", "vllm", "comfyui", "card")

# a FLUX-like API-format graph; the arbiter rewrites the save nodes' filename_prefix
WORKFLOW: dict[str, Any] = {
    "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "flux.safetensors"}},
    "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a card", "clip": ["4", 1]}},
    "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    "3": {
        "class_type": "KSampler",
        "inputs": {"model": ["4", 0], "positive": ["6", 0], "latent_image": ["5", 0], "seed": 1},
    },
    "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
    "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
}
WORKFLOW_INPUT: dict[str, Any] = {
    **WORKFLOW,
    "10": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
}
WORKFLOW_TWO_SAVES: dict[str, Any] = {
    **WORKFLOW,
    "12": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "B"}},
}
# an animation saved through SaveAnimatedWEBP: <prefix>_00001_.webp
WORKFLOW_WEBP: dict[str, Any] = {
    **{k: v for k, v in WORKFLOW.items() if k != "9"},
    "9": {
        "class_type": "SaveAnimatedWEBP",
        "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI", "fps": 6.0},
    },
}
INPUT_PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nfake input").decode()

# short timings: every wait of the arbiter is bounded by a second or a few
CONFIG: dict[str, Any] = {
    "poll_interval_seconds": 0.05,
    "idle_seconds": 0.2,
    "http_timeout_seconds": 0.5,
    "stop_timeout_seconds": 1,
    "llm_release_timeout_seconds": 1.5,
    "image_release_timeout_seconds": 1.5,
    "image_ready_timeout_seconds": 3.0,
    "llm_ready_timeout_seconds": 3.0,
    "job_timeout_seconds": 4.0,  # a hung prompt is given up quickly
    "llm_retry_backoff_seconds": 0.2,
    "llm_retry_backoff_max_seconds": 1.0,
    "image_retry_backoff_seconds": 0.3,
    "image_retry_backoff_max_seconds": 1.0,
    "engine_backoff_max_seconds": 0.5,
    "heartbeat_stale_seconds": 60.0,
    "card_data_max_age_seconds": 1.0,
    "max_image_seconds": 30.0,
    "min_free_bytes": 1 << 20,
    "job_max_attempts": 3,
    "job_max_errors": 3,
    "comfyui_unanswered_polls": 3,
    # a shared rig runs case after case, each restarting ComfyUI: the hour's bound is tried by
    # its own test (test_faults_persistent.py)
    "comfyui_max_restarts_per_hour": 100_000,
}
SETTINGS: dict[str, Any] = {
    "card_interval": 0.05,
    "comfyui_job_seconds": 0.1,
    "vllm_release_seconds": 0.05,
    "comfyui_release_seconds": 0.05,
}
HANG_SECONDS = 1.5  # three times the arbiter's http_timeout_seconds


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A free port below the ephemeral range (so that no client connection takes it before
    its fake binds it), never the same twice in this process (rigs run side by side)."""
    with _PORTS_LOCK:
        while True:
            port = random.randint(20000, 32000)
            if port in _PORTS_GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _PORTS_GIVEN.add(port)
            return port


class Http:
    """A tiny blocking client (no keep-alive), tolerant of a dead server."""

    def __init__(self, port: int) -> None:
        self.port = port

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        auth: bool = False,
        timeout: float = 5.0,
    ) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = dict(AUTH) if auth else {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw


class DockerControl:
    """The fake Docker's control API (never faulted)."""

    def __init__(self, sock: str) -> None:
        self.sock = sock

    def call(self, method: str, path: str) -> Any:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        try:
            s.connect(self.sock)
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        finally:
            s.close()
        return json.loads(data.split(b"\r\n\r\n", 1)[1])

    def containers(self) -> dict[str, Any]:
        return dict(self.call("GET", "/_fake/containers"))

    def crash(self, service: str, respawn: bool = False, oom: bool = False) -> bool:
        query = f"name={service}&signal=9&respawn={int(respawn)}&oom={int(oom)}"
        return bool(self.call("POST", f"/_fake/crash?{query}")["crashed"])


@dataclass
class Sample:
    t: float
    phase: str
    queue: int
    alerts: tuple[str, ...]
    faults: dict[str, int]


@dataclass
class Monitor:
    """Polls /v1/status in a thread: phases and alerts seen, with times."""

    http: Http
    interval: float = 0.1
    samples: list[Sample] = field(default_factory=list)
    on_sample: Callable[[Sample], None] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, doc = self.http.request("GET", "/v1/status", timeout=2.0)
            except OSError:
                status, doc = 0, None
            if status == 200 and isinstance(doc, dict):
                alerts = tuple(a["name"] for a in doc["alerts"])
                faults = {str(k): int(v) for k, v in doc["engine"]["faults"].items()}
                sample = Sample(time.time(), doc["phase"], doc["queue_length"], alerts, faults)
                self.samples.append(sample)
                if self.on_sample is not None:
                    self.on_sample(sample)
            self._stop.wait(self.interval)

    def phases(self, since: float = 0.0) -> list[str]:
        out: list[str] = []
        for s in list(self.samples):
            if s.t >= since and (not out or out[-1] != s.phase):
                out.append(s.phase)
        return out

    def alerts(self, since: float = 0.0) -> set[str]:
        """Alerts seen raised since ``since``, or counted by engine.faults meanwhile (a
        restarted arbiter starts counting from 0)."""
        names: set[str] = set()
        before: dict[str, int] = {}
        for s in list(self.samples):
            if s.t < since:
                before = s.faults
                continue
            names.update(s.alerts)
            for name, n in s.faults.items():
                if n > before.get(name, 0):
                    names.add(name)
            before = s.faults
        names.discard("engine_error_steps")
        return names


@dataclass
class Verdict:
    jobs: int
    done: int
    failed: int
    cancelled: int
    lost: list[str]
    duplicates: dict[str, int]
    unexpected_failures: dict[str, str]
    wrong_outputs: list[str]
    executions: int
    failures: dict[str, str]


class Rig:
    """One world: fake Docker (with vLLM and ComfyUI as its containers) and the arbiter."""

    def __init__(
        self,
        tmp_path: Path,
        config: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
        wrapper: list[str] | None = None,
    ) -> None:
        self.root = tmp_path / "run"
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "faults").mkdir(exist_ok=True)
        self.sockdir = Path(tempfile.mkdtemp(prefix="csf-", dir="/tmp"))
        self.docker_sock = str(self.sockdir / "docker.sock")
        self.data_dir = self.root / "data"
        self.card_file = self.root / "card" / "current.json"
        self.card_file.parent.mkdir(exist_ok=True)
        self.executions = self.root / "executions.jsonl"
        self.ports = {"vllm": free_port(), "comfyui": free_port(), "arbiter": free_port()}
        self.config = {**CONFIG, **(config or {})}
        self.settings_path = self.root / "settings.json"
        Settings.update(self.settings_path, **{**SETTINGS, **(settings or {})})
        self.wrapper = wrapper or []
        self.api = Http(self.ports["arbiter"])
        self.docker = DockerControl(self.docker_sock)
        self.monitor = Monitor(self.api)
        self.faults = {s: FaultFile(self.root / "faults", s) for s in SERVICES}
        self.docker_proc: subprocess.Popen[bytes] | None = None
        self.arbiter: subprocess.Popen[bytes] | None = None
        self.arbiter_runs = 0
        self.arbiter_exits: list[int] = []
        self.kills: list[str] = []  # the phase each SIGKILL hit
        self.jobs: dict[str, float] = {}  # acknowledged job id -> submitted at
        self.cancelled: set[str] = set()
        self._log_offset = 0
        self._log_records: list[dict[str, Any]] = []

    # -- processes ------------------------------------------------------------------------

    def start(self, arbiter: bool = True) -> Rig:
        py = sys.executable
        containers = [
            {
                "name": "vllm-vllm-1",
                "project": "vllm",
                "service": "vllm",
                "image": "intel/llm-scaler-vllm:0.14.0-b8.3.1",
                "argv": [py, str(HERE / "fake_services.py"), "vllm", "--port",
                         str(self.ports["vllm"]), "--run-dir", str(self.root), "--model", MODEL],
                "card_name": "vllm/vllm",
                "vram_bytes": 27 * 2**30,
                "engines": {"ccs": 0.3},
                "autostart": True,
            },
            {
                "name": "comfyui-comfyui-1",
                "project": "comfyui",
                "service": "comfyui",
                "image": "comfyui/comfyui:0.8",
                "argv": [py, str(HERE / "fake_services.py"), "comfyui", "--port",
                         str(self.ports["comfyui"]), "--run-dir", str(self.root)],
                "card_name": "comfyui/comfyui",
                "vram_bytes": 20 * 2**30,
                "vram_file": str(self.root / "comfyui-vram"),  # less after /free
                "engines": {"ccs": 0.9, "rcs": 0.2},
                "autostart": False,
            },
        ]  # fmt: skip
        spec = {
            "socket": self.docker_sock,
            "run_dir": str(self.root),
            "card_file": str(self.card_file),
            "containers": containers,
        }
        (self.root / "docker-spec.json").write_text(json.dumps(spec, indent=1))
        with open(self.root / "logs-docker.log", "ab") as log:
            self.docker_proc = subprocess.Popen(
                [py, str(HERE / "fake_docker.py"), str(self.root / "docker-spec.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its containers share its group: killed together
            )
        self.wait(lambda: os.path.exists(self.docker_sock), 10, "the fake Docker's socket")
        self.wait(self.vllm_healthy, 10, "the fake vLLM")
        token = self.root / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        doc = {
            "data_dir": str(self.data_dir),
            "vllm_url": f"http://127.0.0.1:{self.ports['vllm']}",
            "served_model_name": MODEL,
            "comfyui_url": f"http://127.0.0.1:{self.ports['comfyui']}",
            "card_current_json": str(self.card_file),
            "token_file": str(token),
            "docker_socket": self.docker_sock,
            "listen_host": "127.0.0.1",
            "listen_port": self.ports["arbiter"],
            **self.config,
        }
        (self.root / "arbiter.json").write_text(json.dumps(doc, indent=1))
        if arbiter:
            self.start_arbiter()
        self.monitor.start()
        return self

    def start_arbiter(self, wait: bool = True) -> None:
        self.arbiter_runs += 1
        argv = [
            sys.executable,
            "-m",
            "cardshare.arbiter",
            "--config",
            str(self.root / "arbiter.json"),
        ]
        # the package of this checkout, whatever the virtualenv's editable install points at
        path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
        with open(self.root / f"arbiter-{self.arbiter_runs}.log", "ab") as log:
            self.arbiter = subprocess.Popen(
                [*self.wrapper, *argv],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": path},
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=set_parent_death_signal,
            )
        if wait:
            self.wait(self.arbiter_up, 20, "the arbiter's API")

    def kill_arbiter(self) -> str:
        """SIGKILL the arbiter; the phase it was last seen in."""
        assert self.arbiter is not None
        phase = self.monitor.samples[-1].phase if self.monitor.samples else "?"
        self.arbiter.send_signal(signal.SIGKILL)
        self.arbiter.wait()
        self.kills.append(phase)
        return phase

    def arbiter_up(self) -> bool:
        assert self.arbiter is not None
        if self.arbiter.poll() is not None:
            raise AssertionError(
                f"the arbiter exited with {self.arbiter.returncode}:\n{self.arbiter_log()}"
            )
        try:
            return self.api.request("GET", "/v1/mode", timeout=1.0)[0] == 200
        except OSError:
            return False

    def vllm_healthy(self) -> bool:
        try:
            return Http(self.ports["vllm"]).request("GET", "/health", timeout=1.0)[0] == 200
        except OSError:
            return False

    def close(self) -> None:
        self.monitor.stop()
        if self.arbiter is not None and self.arbiter.poll() is None:
            self.arbiter.terminate()
            try:
                self.arbiter.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.arbiter.kill()
                self.arbiter.wait()
        if self.docker_proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.docker_proc.pid, signal.SIGKILL)
            self.docker_proc.wait()
        shutil.rmtree(self.sockdir, ignore_errors=True)

    def arbiter_log(self, lines: int = 60) -> str:
        """The end of the arbiter's log, without the access lines of the API."""
        path = self.root / f"arbiter-{self.arbiter_runs}.log"
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        kept = [line for line in text if ' HTTP/1.1" ' not in line]
        return f"{path}:\n" + "\n".join(kept[-lines:])

    # -- driving --------------------------------------------------------------------------

    def settings(self, **values: Any) -> None:
        Settings.update(self.settings_path, **values)

    def current_settings(self) -> dict[str, Any]:
        return dict(json.loads(self.settings_path.read_text()))

    def restore_settings(self, doc: dict[str, Any]) -> None:
        """Exactly ``doc`` again (keys a scenario added are dropped)."""
        tmp = self.settings_path.with_name(".settings.restore")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.settings_path)

    def reusable(self) -> bool:
        """Alive, at rest in a consistent llm, no fault armed: the next scenario may use it."""
        try:
            return (
                self.arbiter is not None
                and self.arbiter.poll() is None
                and self.docker_proc is not None
                and self.docker_proc.poll() is None
                and not any(f.active() for f in self.faults.values())
                and self.consistent_llm()
            )
        except (OSError, AssertionError, ValueError, KeyError):
            return False

    def fault(
        self, service: str, route: str, kind: str, remaining: int | None = 1, **kw: Any
    ) -> str:
        if kind == "hang":
            kw.setdefault("seconds", HANG_SECONDS)
        return self.faults[service].add(route, kind, remaining, **kw)

    def clear(self, service: str, rule_id: str | None = None) -> None:
        self.faults[service].clear(rule_id)

    def hits(self, service: str, rule_id: str | None = None) -> int:
        return self.faults[service].hits(rule_id)

    def submit(
        self, n: int = 1, workflow: dict[str, Any] | None = None, inputs: bool = False
    ) -> list[str]:
        ids = []
        for _ in range(n):
            body: dict[str, Any] = {
                "workflow": workflow or (WORKFLOW_INPUT if inputs else WORKFLOW)
            }
            if inputs or workflow is WORKFLOW_INPUT:
                body["inputs"] = {"in.png": INPUT_PNG}
            status, doc = self.api.request("POST", "/v1/jobs", body, auth=True)
            assert status == 201, (status, doc)
            self.jobs[doc["id"]] = time.time()
            ids.append(doc["id"])
        return ids

    def status(self) -> dict[str, Any]:
        status, doc = self.api.request("GET", "/v1/status", auth=True)
        assert status == 200, (status, doc)
        return dict(doc)

    def metrics(self) -> str:
        status, body = self.api.request("GET", "/metrics")
        assert status == 200
        return body.decode() if isinstance(body, bytes) else str(body)

    def metric_samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """/metrics read with prometheus_client's parser: value by (sample name, labels).
        An exposition the parser refuses fails the test (``ValueError``)."""
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(self.metrics())
            for s in family.samples
        }

    def alerts_up(self) -> set[str]:
        """The alerts /metrics says are raised now (``cardshare_arbiter_alert`` 1)."""
        return {
            dict(labels)["name"]
            for (name, labels), value in self.metric_samples().items()
            if name == "cardshare_arbiter_alert" and value == 1
        }

    def job(self, job_id: str) -> dict[str, Any] | None:
        status, doc = self.api.request("GET", f"/v1/jobs/{job_id}", auth=True)
        if status == 404:
            return None
        assert status == 200, (status, doc)
        return dict(doc)

    @staticmethod
    def wait(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> float:
        start = time.time()
        while True:
            try:
                if predicate():
                    return time.time() - start
            except OSError:
                pass
            if time.time() - start > timeout:
                raise AssertionError(f"not reached within {timeout:g} s: {what}")
            time.sleep(every)

    def wait_phase(self, phases: Iterable[str], timeout: float = 15.0) -> str:
        wanted = set(phases)
        seen: list[str] = []

        def hit() -> bool:
            phase = self.status()["phase"]
            seen.append(phase)
            return phase in wanted

        self.wait(hit, timeout, f"phase in {sorted(wanted)} (last {seen[-1:]})", every=0.01)
        return seen[-1]

    def kill_in_phase(self, phase: str, timeout: float = 20.0) -> str:
        """SIGKILL the arbiter as soon as /v1/status shows ``phase``."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                status, doc = self.api.request("GET", "/v1/status", timeout=1.0)
            except OSError:
                status, doc = 0, None
            if status == 200 and doc["phase"] == phase:
                assert self.arbiter is not None
                self.arbiter.send_signal(signal.SIGKILL)
                self.arbiter.wait()
                self.kills.append(phase)
                return phase
            time.sleep(0.005)
        raise AssertionError(
            f"phase {phase} not seen within {timeout:g} s: {self.monitor.phases()}"
        )

    # -- the checks -----------------------------------------------------------------------

    def consistent_llm(self) -> bool:
        """serve_llm, nothing queued, vLLM up and answering, ComfyUI stopped, engine healthy."""
        assert self.arbiter is not None
        if self.arbiter.poll() is not None:
            raise AssertionError(
                f"the arbiter exited with {self.arbiter.returncode}:\n{self.arbiter_log()}"
            )
        mode = self.api.request("GET", "/v1/mode")[1]
        if mode.get("mode") != "llm":  # the cheap question first
            return False
        st = self.status()
        if st["phase"] != "serve_llm" or st["queue_length"] != 0 or st["mode"] != "llm":
            return False
        if not st["engine"]["healthy"]:
            return False
        if st["decision"]["reasons"] == ["not evaluated yet"]:
            return False  # a new arbiter whose resume is not behind it yet
        c = self.docker.containers()
        if not c["vllm"]["running"] or c["comfyui"]["running"]:
            return False
        return self.vllm_healthy()

    def wait_llm(self, timeout: float = 30.0) -> float:
        """Wait for a consistent llm; its time."""
        try:
            self.wait(self.consistent_llm, timeout, "a consistent llm", every=0.05)
        except AssertionError as exc:
            st = self.status()
            raise AssertionError(
                f"{exc}; phase {st['phase']}, queue {st['queue_length']}, alerts "
                f"{st['alerts']}, containers {self.docker.containers()}, phases "
                f"{self.monitor.phases()[-30:]}\n{self.arbiter_log()}"
            ) from None
        return time.time()

    def first_hit(self, service: str, rule_id: str) -> float | None:
        hit = self.faults[service]._read().get("first_hit", {}).get(rule_id)
        return None if hit is None else float(hit)

    def executions_log(self) -> list[dict[str, Any]]:
        """ComfyUI's executions so far (read incrementally: the file only grows)."""
        with contextlib.suppress(FileNotFoundError), open(self.executions, "rb") as fh:
            fh.seek(self._log_offset)
            data = fh.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            self._log_offset += end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self._log_records.append(json.loads(line))
        return list(self._log_records)

    def executing(self) -> bool:
        """ComfyUI has started one of the acknowledged jobs."""
        prefixes = {f"cardshare/{j}/s0" for j in self.jobs}
        return any(
            r.get("event") == "start" and prefixes & set(r.get("prefixes", []))
            for r in self.executions_log()
        )

    def saved_by_job(self) -> Counter[str]:
        """Completed executions (every save node written) per job id, from the log."""
        counts: Counter[str] = Counter()
        for rec in self.executions_log():
            if rec.get("event") != "saved":
                continue
            for prefix in rec.get("prefixes", []):
                m = re.fullmatch(r"cardshare/([0-9a-f]+)/s0", prefix)
                if m:
                    counts[m.group(1)] += 1
        return counts

    def verdict(self, may_fail: str | None = None) -> Verdict:
        """Every acknowledged job: ended, done with its own output, or failed with a reason
        (matching ``may_fail`` when failures are allowed); none executed twice."""
        saved = self.saved_by_job()
        lost: list[str] = []
        unexpected: dict[str, str] = {}
        failures: dict[str, str] = {}
        wrong: list[str] = []
        counts: Counter[str] = Counter()
        for job_id in self.jobs:
            doc = self.job(job_id)
            if doc is None:
                lost.append(job_id)
                continue
            counts[doc["state"]] += 1
            if doc["state"] == "done":
                if saved[job_id] < 1 or not self._output_is_own(job_id, doc):
                    wrong.append(job_id)
            elif doc["state"] == "failed":
                failures[job_id] = doc["reason"]
                if not doc["reason"] or may_fail is None or not re.search(may_fail, doc["reason"]):
                    unexpected[job_id] = doc["reason"]
            elif doc["state"] == "cancelled" and job_id in self.cancelled:
                pass
            else:
                lost.append(job_id)
        return Verdict(
            jobs=len(self.jobs),
            done=counts["done"],
            failed=counts["failed"],
            cancelled=counts["cancelled"],
            lost=lost,
            duplicates={j: n for j, n in saved.items() if n > 1 and j in self.jobs},
            unexpected_failures=unexpected,
            wrong_outputs=wrong,
            executions=sum(1 for r in self.executions_log() if r.get("event") == "start"),
            failures=failures,
        )

    def _output_is_own(self, job_id: str, doc: dict[str, Any]) -> bool:
        if not doc["outputs"]:
            return False
        conn = http.client.HTTPConnection("127.0.0.1", self.ports["arbiter"], timeout=5)
        try:
            conn.request("GET", doc["outputs"][0], headers=AUTH)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        return resp.status == 200 and f"cardshare/{job_id}/s0".encode() in data

    def alerts_raised(self, since: float = 0.0) -> set[str]:
        """Alerts raised since ``since``: seen in /v1/status alerts, counted in its
        engine.faults, or 1 in /metrics now."""
        names = self.monitor.alerts(since)
        with contextlib.suppress(OSError, AssertionError):
            names |= self.alerts_up()
        return names
