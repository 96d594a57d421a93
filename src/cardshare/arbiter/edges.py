"""The arbiter's I/O edges: containers, vLLM, ComfyUI, the proxy.

Each edge is a small Protocol so the engine can be tested with fakes; the real
implementations speak HTTP (aiohttp) and the Docker Engine API.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal, Protocol

import aiohttp

from cardshare.arbiter.config import Config, ContainerRef
from cardshare.arbiter.resume import prompt_writes_under
from cardshare.docker_api import ContainerState, DockerClient, DockerError

Role = Literal["llm", "image"]


class Unavailable(Exception):
    """The service did not answer (refused, reset, timed out, 5xx)."""


class Rejected(Exception):
    """The service answered 4xx: the request itself is wrong."""

    def __init__(self, message: str, detail: Any = None, status: int = 400) -> None:
        super().__init__(message)
        self.detail = detail
        self.status = status


class Containers(Protocol):
    def use(self, role: Role, ref: ContainerRef) -> None:
        """From now on, the role is this container (vLLM's plans are one service each)."""
        ...

    async def state(self, role: Role) -> ContainerState: ...
    async def start(self, role: Role) -> None: ...
    async def stop(self, role: Role, timeout_seconds: int) -> None: ...
    async def restart(self, role: Role, timeout_seconds: int) -> None: ...

    async def logs_tail(self, role: Role, max_bytes: int, since: str = "") -> str:
        """The last ``max_bytes`` of the container's output, from a line's start, of its start
        at ``since`` (its inspect ``StartedAt``; empty: of all its starts)."""
        ...


class LlmApi(Protocol):
    async def metrics(self) -> str: ...
    async def health(self) -> int: ...
    async def one_token(self) -> None: ...


class ComfyApi(Protocol):
    async def ready(self) -> bool: ...
    async def upload_image(self, name: str, data: bytes) -> str: ...
    async def submit(self, workflow: dict[str, Any], prompt_id: str) -> str: ...
    async def history(self, prompt_id: str) -> dict[str, Any] | None: ...

    async def queued(self, prompt_id: str, subfolder: str) -> str | None:
        """The id under which the job's prompt is queued or running: the entry of
        ``prompt_id`` when its save nodes write under ``subfolder`` (the job's own), else any
        entry that does; None when no entry is the job's."""
        ...

    async def view(self, filename: str, subfolder: str, kind: str) -> bytes: ...
    async def saved(self, filename: str, subfolder: str) -> bytes | None: ...

    async def interrupt(self, prompt_id: str | None = None) -> None:
        """Interrupt the running prompt; with ``prompt_id`` only when that one runs (ComfyUI
        since 0.3.4x; an older one interrupts whatever runs)."""
        ...

    async def clear_queue(self) -> None: ...

    async def delete_queued(self, prompt_id: str) -> None:
        """Take a pending prompt out of ComfyUI's queue (nothing when it is not pending)."""
        ...

    async def free(self) -> None:
        """Ask ComfyUI to unload its models and free memory. It answers at once and frees
        later: the release is proven by the card data, never by this answer."""
        ...


class ProxyApi(Protocol):
    async def state(self) -> dict[str, Any]: ...


class YieldingApi(Protocol):
    """The yielding tenants' side of the card (a re-encode campaign): each serves
    ``POST /v1/pause`` and ``POST /v1/resume`` (see roles/arbiter/docs/api.md)."""

    async def pause(self, name: str, seconds: float, reason: str) -> int:
        """Ask the tenant to step aside for ``seconds`` (a lease); its answer is the ack,
        with the VRAM it still holds. Unavailable/Rejected when it does not ack in time."""
        ...

    async def resume(self, name: str) -> None: ...


# -- real implementations -------------------------------------------------------------


class DockerContainers:
    """Containers found by their compose labels, through the Engine API in a thread."""

    def __init__(self, client: DockerClient, refs: dict[Role, ContainerRef]) -> None:
        self.client = client
        self.refs = dict(refs)

    def use(self, role: Role, ref: ContainerRef) -> None:
        self.refs[role] = ref

    async def _id(self, role: Role) -> str:
        ref = self.refs[role]
        found = await asyncio.to_thread(
            self.client.find_compose_container, ref.project, ref.service
        )
        return found.id

    async def state(self, role: Role) -> ContainerState:
        return await asyncio.to_thread(self.client.inspect, await self._id(role))

    async def start(self, role: Role) -> None:
        await asyncio.to_thread(self.client.start, await self._id(role))

    async def stop(self, role: Role, timeout_seconds: int) -> None:
        await asyncio.to_thread(self.client.stop, await self._id(role), timeout_seconds)

    async def restart(self, role: Role, timeout_seconds: int) -> None:
        await asyncio.to_thread(self.client.restart, await self._id(role), timeout_seconds)

    async def logs_tail(self, role: Role, max_bytes: int, since: str = "") -> str:
        return await asyncio.to_thread(
            self.client.logs_window, await self._id(role), max_bytes, since
        )


# refused, reset, timed out (a hang), a broken or non-HTTP answer (garbage)
_NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def _json(body: bytes, what: str) -> Any:
    """A JSON answer, or Unavailable: a garbage answer is the service's fault, not ours."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise Unavailable(f"{what} answered no JSON: {body[:120]!r}") from exc


def _object(body: bytes, what: str) -> dict[str, Any]:
    doc = _json(body, what)
    if not isinstance(doc, dict):
        raise Unavailable(f"{what} answered a JSON {type(doc).__name__}, not an object")
    return doc


class _Http:
    def __init__(self, session: aiohttp.ClientSession, base: str, timeout: float) -> None:
        self.session = session
        self.base = base
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def request(
        self,
        method: str,
        path: str,
        *,
        ok: tuple[int, ...] = (200,),
        limit: int | None = None,
        **kwargs: Any,
    ) -> tuple[int, bytes]:
        """``limit``: an answer larger than this many bytes is read no further (Unavailable):
        a server's garbage never costs the arbiter more memory than that."""
        url = self.base + path
        try:
            async with self.session.request(method, url, timeout=self.timeout, **kwargs) as resp:
                status = resp.status
                if limit is None:
                    body = await resp.read()
                else:
                    body = await _bounded(resp, limit, f"{method} {url}")
        except _NET_ERRORS as exc:
            raise Unavailable(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        except (ValueError, TypeError) as exc:  # the request cannot be sent (e.g. CR/LF, NUL)
            raise Rejected(f"{method} {url} cannot be sent: {exc}", str(exc)) from exc
        if status in ok:
            return status, body
        text = body.decode("utf-8", "replace")[:500]
        if 400 <= status < 500:
            detail: Any = None
            try:
                detail = json.loads(body)
            except (ValueError, RecursionError):
                detail = text
            raise Rejected(f"{method} {url} answered {status}: {text}", detail, status)
        raise Unavailable(f"{method} {url} answered {status}: {text}")


async def _bounded(resp: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """The body, read in chunks, at most ``limit`` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        raise Unavailable(f"{what} answered {resp.content_length} bytes (more than {limit})")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise Unavailable(f"{what} answered more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# the largest answers read from ComfyUI's JSON routes: one prompt's history entry (its
# prompt and output list) is kilobytes; the queue lists every queued prompt whole
HISTORY_MAX_BYTES = 8 << 20
QUEUE_MAX_BYTES = 32 << 20


def read_key(path: Path) -> str:
    """The first line of a key file, stripped: Unavailable when there is none to send (the
    probe cannot pass without it, and a rewritten file is read again at the next probe)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise Unavailable(f"vLLM's key file {path} cannot be read: {exc}") from exc
    key = lines[0].strip() if lines else ""
    if not key or any(c.isspace() for c in key):
        raise Unavailable(f"vLLM's key file {path} has no key on its first line")
    return key


class HttpLlm:
    def __init__(self, session: aiohttp.ClientSession, config: Config) -> None:
        self.http = _Http(session, config.vllm_url, config.http_timeout_seconds)
        self.model = config.served_model_name
        self.key_file = config.vllm_api_key_file

    async def metrics(self) -> str:
        return (await self.http.request("GET", "/metrics"))[1].decode("utf-8", "replace")

    async def health(self) -> int:
        status, _ = await self.http.request("GET", "/health", ok=(200,))
        return status

    async def one_token(self) -> None:
        payload = {"model": self.model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        headers = {}
        if self.key_file is not None:  # vLLM guards /v1 with its key (/health, /metrics open)
            headers["Authorization"] = "Bearer " + read_key(self.key_file)
        try:
            _, body = await self.http.request(
                "POST", "/v1/completions", json=payload, headers=headers
            )
        except Rejected as exc:
            if exc.status != 401:
                raise
            # vLLM's refusal names no setting: say which one is missing or wrong
            if self.key_file is None:
                fix = (
                    "vLLM asks for its key and vllm_api_key_file is not set: set it to vLLM's"
                    " key file (the vllm role's vllm_api_key_file; the arbiter role's"
                    " arbiter_vllm_api_key_file)"
                )
            else:
                fix = (
                    f"vLLM refused the key of vllm_api_key_file {self.key_file}: it must hold"
                    " vLLM's key (the vllm role's vllm_api_key_file)"
                )
            raise Rejected(f"{exc}; {fix}", exc.detail, exc.status) from exc
        doc = _json(body, "POST /v1/completions")
        if not isinstance(doc, dict) or not doc.get("choices"):
            raise Unavailable(f"one-token completion answered without choices: {body[:200]!r}")


class HttpComfy:
    def __init__(self, session: aiohttp.ClientSession, config: Config) -> None:
        self.http = _Http(session, config.comfyui_url, config.http_timeout_seconds)
        self.client_id = "cardshare-arbiter"

    async def ready(self) -> bool:
        try:
            _, body = await self.http.request("GET", "/object_info")
        except (Unavailable, Rejected):
            return False
        try:
            doc = _json(body, "GET /object_info")
        except Unavailable:
            return False
        return isinstance(doc, dict) and bool(doc)

    async def upload_image(self, name: str, data: bytes) -> str:
        form = aiohttp.FormData()
        form.add_field("image", data, filename=name, content_type="image/png")
        form.add_field("overwrite", "true")
        _, body = await self.http.request("POST", "/upload/image", data=form)
        doc = _object(body, "POST /upload/image")
        stored = str(doc.get("name", name))
        sub = str(doc.get("subfolder", "") or "")
        return f"{sub}/{stored}" if sub else stored

    async def submit(self, workflow: dict[str, Any], prompt_id: str) -> str:
        payload = {"prompt": workflow, "client_id": self.client_id, "prompt_id": prompt_id}
        _, body = await self.http.request("POST", "/prompt", json=payload)
        doc = _object(body, "POST /prompt")
        return str(doc.get("prompt_id", prompt_id))

    async def history(self, prompt_id: str) -> dict[str, Any] | None:
        _, body = await self.http.request("GET", f"/history/{prompt_id}", limit=HISTORY_MAX_BYTES)
        entry = _object(body, "GET /history").get(prompt_id)
        return entry if isinstance(entry, dict) else None

    async def queued(self, prompt_id: str, subfolder: str) -> str | None:
        _, body = await self.http.request("GET", "/queue", limit=QUEUE_MAX_BYTES)
        doc = _object(body, "GET /queue")
        found: str | None = None
        for key in ("queue_running", "queue_pending"):
            items = doc.get(key)
            if not isinstance(items, list):
                raise Unavailable(f"GET /queue answered {key} {items!r:.80}, not a list")
            for item in items:
                if not isinstance(item, list) or len(item) < 3 or not isinstance(item[1], str):
                    continue
                if not prompt_writes_under(item[2], subfolder):
                    continue
                if item[1] == prompt_id:
                    return prompt_id
                found = found or item[1]
        return found

    async def view(self, filename: str, subfolder: str, kind: str) -> bytes:
        params = {"filename": filename, "subfolder": subfolder, "type": kind}
        return (await self.http.request("GET", "/view", params=params))[1]

    async def saved(self, filename: str, subfolder: str) -> bytes | None:
        """A file in ComfyUI's output directory, None when it does not exist (404)."""
        try:
            return await self.view(filename, subfolder, "output")
        except Rejected as exc:
            if exc.status == 404:
                return None
            raise

    async def interrupt(self, prompt_id: str | None = None) -> None:
        body = {"prompt_id": prompt_id} if prompt_id else {}
        await self.http.request("POST", "/interrupt", json=body)

    async def clear_queue(self) -> None:
        await self.http.request("POST", "/queue", json={"clear": True})

    async def delete_queued(self, prompt_id: str) -> None:
        await self.http.request("POST", "/queue", json={"delete": [prompt_id]})

    async def free(self) -> None:
        await self.http.request("POST", "/free", json={"unload_models": True, "free_memory": True})


class HttpProxy:
    def __init__(self, session: aiohttp.ClientSession, base: str, timeout: float) -> None:
        self.http = _Http(session, base, timeout)

    async def state(self) -> dict[str, Any]:
        return _object((await self.http.request("GET", "/proxy/state"))[1], "GET /proxy/state")


class HttpYielding:
    """The yielding tenants by name, each at its base URL; an ack must come within the
    tenant's own bound (its timeout here)."""

    def __init__(
        self, session: aiohttp.ClientSession, tenants: dict[str, tuple[str, float]]
    ) -> None:
        self.http = {
            name: _Http(session, url, ack_seconds) for name, (url, ack_seconds) in tenants.items()
        }

    async def pause(self, name: str, seconds: float, reason: str) -> int:
        body = {"holder": "cardshare-arbiter", "seconds": seconds, "reason": reason[:300]}
        _, raw = await self.http[name].request("POST", "/v1/pause", json=body)
        doc = _object(raw, f"POST /v1/pause of {name}")
        vram = doc.get("vram_bytes")
        if doc.get("paused") is not True or isinstance(vram, bool) or not isinstance(vram, int):
            raise Unavailable(
                f"POST /v1/pause of {name} answered {raw[:120]!r}: not an ack "
                '({"paused": true, "vram_bytes": N})'
            )
        return vram

    async def resume(self, name: str) -> None:
        await self.http[name].request("POST", "/v1/resume", json={"holder": "cardshare-arbiter"})


__all__ = [
    "ComfyApi",
    "ContainerState",
    "Containers",
    "DockerContainers",
    "DockerError",
    "HttpComfy",
    "HttpLlm",
    "HttpProxy",
    "HttpYielding",
    "LlmApi",
    "ProxyApi",
    "Rejected",
    "Role",
    "Unavailable",
    "YieldingApi",
]
