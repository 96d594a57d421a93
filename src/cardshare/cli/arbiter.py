"""The arbiter's commands: its API (``roles/arbiter/docs/api.md``), over HTTP with the standard
library.

``cardshare status``
    the arbiter's mode, phase, queue, engine, hold, card view, alerts and last swaps.
``cardshare job submit WORKFLOW.json [--image FILE]... [--wait [--timeout S]]``
    a ComfyUI API-format workflow with its input images (named by their file names); prints
    the job id, or with ``--wait`` polls until the job ends (non-zero unless it is done).
``cardshare job show ID`` / ``cardshare job cancel ID``
    a job's state, reason, attempts and outputs; cancel a queued or running job.
``cardshare job outputs ID --to DIR``
    write the done job's images as ``DIR/<id>-<n>.png`` (each atomically).

They talk to ``--arbiter URL`` (else ``$CARDSHARE_ARBITER_URL``, else
``http://127.0.0.1:8090``) with the token of ``--token-file`` (default
``/etc/cardshare/arbiter/token``, readable by root only); ``--json`` prints the API's own
documents.  ``urllib`` is imported only by these verbs: the timer's ``scan`` stays light.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from cardshare.cli.common import UsageError, arbiter_url, gib, positive_float

DEFAULT_ARBITER_URL = "http://127.0.0.1:8090"
DEFAULT_TOKEN_FILE = "/etc/cardshare/arbiter/token"
ARBITER_URL_ENV = "CARDSHARE_ARBITER_URL"
REQUEST_TIMEOUT_SECONDS = 30.0
# while --wait polls: first interval, growth, longest interval; how long the arbiter may be
# unreachable (a restart resumes its jobs from its database) before waiting gives up
POLL_FIRST_SECONDS = 0.2
POLL_GROWTH = 1.5
POLL_MAX_SECONDS = 2.0
WAIT_UNREACHABLE_SECONDS = 60.0
FINAL_STATES = frozenset({"done", "failed", "cancelled"})
_SAFE_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class ArbiterError(Exception):
    """A runtime error of the arbiter verbs, one line that names the fix (exit 1)."""


class Unreachable(ArbiterError):
    """No HTTP answer at all: refused, unknown host, timed out, connection broken."""


def resolve_arbiter_url(given: str | None, environ: dict[str, str] | None = None) -> str:
    """``--arbiter``, else ``$CARDSHARE_ARBITER_URL``, else the role's default address."""
    if given is not None:
        return given
    env = os.environ if environ is None else environ
    value = env.get(ARBITER_URL_ENV, "")
    if not value:
        return DEFAULT_ARBITER_URL
    try:
        return arbiter_url(value)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{ARBITER_URL_ENV}: {exc}") from None


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace removed)."""
    fix = "pass --token-file PATH"
    try:
        token = path.read_text(encoding="utf-8").strip()
    except PermissionError:
        raise ArbiterError(
            f"cannot read the arbiter's token {path}: permission denied; run as root "
            f"(sudo cardshare ...) or {fix}"
        ) from None
    except FileNotFoundError:
        raise ArbiterError(
            f"cannot read the arbiter's token {path}: no such file; apply the arbiter role "
            f"to this host (it creates the token) or {fix}"
        ) from None
    except (OSError, UnicodeError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ArbiterError(f"cannot read the arbiter's token {path}: {detail}; {fix}") from None
    if not token:
        raise ArbiterError(f"the arbiter's token file {path} is empty; {fix}")
    return token


@dataclass(frozen=True)
class Reply:
    """One HTTP answer of the arbiter, whatever its status."""

    method: str
    path: str
    status: int
    body: bytes
    retry_after: str | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeError):
            raise ArbiterError(
                f"the answer to {self.method} {self.path} is not JSON "
                f"({self.body[:60]!r}): is this address the arbiter's API?"
            ) from None

    def error_text(self) -> str:
        """The ``{"error": ...}`` message, else the body's text, on one line."""
        try:
            doc = json.loads(self.body)
        except (ValueError, UnicodeError):
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            text = doc["error"]
        else:
            text = self.body.decode("utf-8", "replace")
        text = " ".join(text.split())
        if not text:
            return "(no body)"
        if len(text) > 300:
            return text[:300] + "..."
        # aiohttp's own answers (413) end with a full stop; the caller may add a fix
        return text if text.endswith("..") else text.removesuffix(".")


@dataclass(frozen=True)
class Arbiter:
    """The arbiter's API at ``url``; ``token`` is sent as ``Authorization: Bearer``."""

    url: str
    token: str | None
    token_file: Path
    timeout: float = REQUEST_TIMEOUT_SECONDS

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> Reply:
        import http.client
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.url + path, data=body, method=method)
        req.add_header("Accept", "application/json")
        if self.token is not None:
            req.add_header("Authorization", f"Bearer {self.token}")
        if content_type is not None:
            req.add_header("Content-Type", content_type)
        # no proxy from the environment: the token goes to the arbiter and nowhere else
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=self.timeout) as resp:
                return Reply(method, path, resp.status, resp.read(), resp.headers["Retry-After"])
        except urllib.error.HTTPError as exc:
            with exc:
                data = exc.read()
            return Reply(method, path, exc.code, data, exc.headers.get("Retry-After"))
        except urllib.error.URLError as exc:
            raise Unreachable(self._unreachable(exc.reason)) from None
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(self._unreachable(exc)) from None

    def _unreachable(self, reason: object) -> str:
        where = f"cannot reach the arbiter at {self.url}"
        hint = (
            "is it running? check `docker compose -p arbiter ps` on the host, or give its "
            f"address with --arbiter URL or {ARBITER_URL_ENV}"
        )
        if isinstance(reason, ConnectionRefusedError):
            return f"{where}: connection refused; {hint}"
        if isinstance(reason, TimeoutError):
            return f"{where}: no answer within {self.timeout:g} s; {hint}"
        if isinstance(reason, OSError) and reason.strerror:
            return f"{where}: {reason.strerror}; {hint}"
        return f"{where}: {reason or type(reason).__name__}; {hint}"

    def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str | None = None,
        expect: tuple[int, ...] = (200,),
    ) -> Reply:
        reply = self.request(method, path, body, content_type)
        if reply.status not in expect:
            raise ArbiterError(self.refusal(reply))
        return reply

    def refusal(self, reply: Reply) -> str:
        """One line for an answer the verb did not expect, with the body and the fix."""
        text = f"the arbiter answered {reply.status} to {reply.method} {reply.path}: "
        text += reply.error_text()
        if reply.status == 401:
            text += (
                f"; the token in {self.token_file} is not the arbiter's: pass --token-file "
                "with the file the arbiter reads (the role's arbiter_token_file)"
            )
        elif reply.status == 413:
            text += "; the workflow and its images exceed the arbiter's max_payload_bytes"
        elif reply.status == 503 and reply.retry_after:
            text += f"; retry after {reply.retry_after} s"
        return text

    def job(self, job_id: str) -> dict[str, Any]:
        doc = self.call("GET", job_path(job_id)).json()
        if not isinstance(doc, dict) or not isinstance(doc.get("state"), str):
            raise ArbiterError(f"the arbiter's answer for job {job_id} has no state: {doc!r:.80}")
        return doc


def job_path(job_id: str) -> str:
    from urllib.parse import quote

    return f"/v1/jobs/{quote(job_id, safe='')}"


def _arbiter(args: argparse.Namespace, token_needed: bool = True) -> Arbiter:
    url = resolve_arbiter_url(args.arbiter)
    path = args.token_file if args.token_file is not None else Path(DEFAULT_TOKEN_FILE)
    token: str | None = None
    if token_needed or args.token_file is not None:
        token = read_token(path)
    else:
        # status without --token-file: the token when it can be read, else the open view
        try:
            token = read_token(path)
        except ArbiterError:
            token = None
    return Arbiter(url, token, path)


# -- submission -------------------------------------------------------------------------------

_CONTENT_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}


def input_name_problem(name: str) -> str | None:
    """Why the arbiter would refuse ``name`` as an input's name (its check_input_name)."""
    if name in ("", ".", ".."):
        return "it is not a file name"
    if "\\" in name or "/" in name:
        return "it holds a path separator"
    if any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in name):
        return "it holds a control character"
    if len(name.encode("utf-8")) > 200:
        return "it is longer than 200 bytes"
    return None


def _disposition(field: str, filename: str) -> str:
    from urllib.parse import quote

    if filename.isascii() and '"' not in filename and filename.isprintable():
        return f'form-data; name="{field}"; filename="{filename}"'
    # RFC 7578/5987: any other name travels percent-encoded as UTF-8
    return f"form-data; name=\"{field}\"; filename*=UTF-8''{quote(filename, safe='')}"


def encode_multipart(
    workflow: dict[str, Any], images: Sequence[tuple[str, bytes]], boundary: str
) -> tuple[bytes, str]:
    """The ``multipart/form-data`` body of ``POST /v1/jobs``: a ``workflow`` part (JSON),
    then one part per image, named by its file name; returns (body, content type)."""
    parts: list[bytes] = []
    heads = [('form-data; name="workflow"', "application/json")]
    datas = [json.dumps(workflow).encode("utf-8")]
    for name, data in images:
        heads.append((_disposition("image", name), _content_type(name)))
        datas.append(data)
    for (disposition, ctype), data in zip(heads, datas, strict=True):
        head = (
            f"--{boundary}\r\nContent-Disposition: {disposition}\r\nContent-Type: {ctype}\r\n\r\n"
        )
        parts += [head.encode("utf-8"), data, b"\r\n"]
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _content_type(name: str) -> str:
    return _CONTENT_TYPES.get(Path(name).suffix.lower(), "application/octet-stream")


def load_workflow(path: Path) -> dict[str, Any]:
    """A workflow file: JSON, and an object (the API format, not the UI's ``nodes`` list)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeError as exc:
        raise ArbiterError(f"{path} is not UTF-8 text: {exc}") from None
    try:
        workflow = json.loads(text)
    except ValueError as exc:
        raise ArbiterError(f"{path} is not JSON: {exc}") from None
    if not isinstance(workflow, dict):
        raise ArbiterError(
            f"{path} holds a JSON {type(workflow).__name__}, not a ComfyUI API-format workflow "
            "object"
        )
    if isinstance(workflow.get("nodes"), list):
        raise ArbiterError(
            f"{path} is a workflow in ComfyUI's UI format: export it in the API format "
            "(ComfyUI: Workflow > Export (API))"
        )
    return workflow


def load_images(paths: Sequence[Path]) -> list[tuple[str, bytes]]:
    """(file name, bytes) of each ``--image``; the workflow refers to each by its name."""
    images: list[tuple[str, bytes]] = []
    for path in paths:
        name = path.name
        problem = input_name_problem(name)
        if problem is not None:
            raise UsageError(f"--image {path}: {problem}; rename the file")
        if any(name == seen for seen, _ in images):
            raise UsageError(
                f"--image {path}: another image is named {name!r} too; the workflow names its "
                "inputs by file name, so rename one"
            )
        images.append((name, path.read_bytes()))
    return images


# -- output -----------------------------------------------------------------------------------


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _ago(ts: Any, now: float) -> str:
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        return ""
    return f" ({_duration(max(0.0, now - ts))} ago)"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def format_job(doc: dict[str, Any]) -> str:
    """A job document as text."""
    job_id = doc.get("id", "?")
    state = str(doc.get("state", "?"))
    if state == "running" and doc.get("cancel_requested"):
        state += " (cancel requested)"
    outputs = doc.get("outputs") or []
    lines = [
        f"job {job_id}: {state}",
        f"  reason:    {doc.get('reason') or '-'}",
        f"  attempts:  {doc.get('attempts', '?')}",
        f"  created:   {_when(doc.get('created'))}",
        f"  started:   {_when(doc.get('started'))}",
    ]
    finished = f"  finished:  {_when(doc.get('finished'))}"
    started, ended = doc.get("started"), doc.get("finished")
    if isinstance(started, int | float) and isinstance(ended, int | float):
        finished += f" (ran {_duration(max(0.0, ended - started))})"
    lines.append(finished)
    if outputs:
        lines.append(f"  outputs:   {len(outputs)} (cardshare job outputs {job_id} --to DIR)")
    else:
        lines.append("  outputs:   none")
    return "\n".join(lines) + "\n"


def format_status(doc: dict[str, Any], url: str, now: float, authorized: bool) -> str:
    """``GET /v1/status`` as text."""
    lines = [f"arbiter {url}"]
    lines.append(
        f"mode:      {doc.get('mode')} since {_when(doc.get('since'))}{_ago(doc.get('since'), now)}"
    )
    lines.append(
        f"phase:     {doc.get('phase')} since {_when(doc.get('phase_since'))}"
        f"{_ago(doc.get('phase_since'), now)}"
    )
    running = "none"
    if doc.get("job_running"):
        running = doc.get("current_job") or (
            "a job (its id needs the token: run as root or pass --token-file)"
            if not authorized
            else "a job (its id was not shown: the token was not accepted)"
        )
    lines.append(f"jobs:      {doc.get('queue_length', '?')} queued or running; running: {running}")
    engine = doc.get("engine") or {}
    health = "healthy" if engine.get("healthy") else "UNHEALTHY"
    lines.append(f"engine:    {health}: {engine.get('health', '?')}")
    faults = {k: v for k, v in (engine.get("faults") or {}).items() if v}
    lines.append("faults:    " + (", ".join(f"{k}={v}" for k, v in faults.items()) or "none"))
    hold = doc.get("hold")
    lines.append(
        "hold:      "
        + (
            "none"
            if not hold
            else f"swaps held by {hold.get('holder')} until {_when(hold.get('until'))}"
        )
    )
    decision = doc.get("decision") or {}
    reasons = "; ".join(decision.get("reasons") or [])
    lines.append(
        "to image:  "
        + ("go" if decision.get("go") else "not now")
        + (f": {reasons}" if reasons else "")
    )
    card = doc.get("card")
    if card is None:
        lines.append("card:      no card data yet")
    else:
        clients = ", ".join(
            f"{c.get('name')} {gib(c.get('vram_bytes'))}"
            + (f" ({' '.join(c['busy_engines'])} busy)" if c.get("busy_engines") else "")
            for c in card.get("clients") or []
        )
        age = card.get("age_seconds")
        seen = f"scanned {_duration(age)} ago" if isinstance(age, int | float) else "scanned ?"
        lines.append(f"card:      {seen}: {clients or 'no other clients'}")
    alerts = doc.get("alerts") or []
    lines.append("alerts:    " + ("none" if not alerts else str(len(alerts))))
    lines.extend(f"  {a.get('name')}: {a.get('message')}" for a in alerts)
    swaps = doc.get("swaps") or []
    lines.append("swaps:     " + ("none yet" if not swaps else f"last {min(3, len(swaps))}"))
    for s in swaps[:3]:
        total = s.get("total_seconds")
        took = f"took {_duration(total)}" if isinstance(total, int | float) else "in progress"
        ok = {True: "ok", False: "FAILED", None: ""}.get(s.get("ok"), "")
        lines.append(f"  {s.get('direction')} at {_when(s.get('started'))}: {took} {ok}".rstrip())
    return "\n".join(lines) + "\n"


def _dump(doc: Any, out: TextIO) -> None:
    out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write beside ``path``, flush to disk, rename over it: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- the verbs --------------------------------------------------------------------------------


def _cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    arbiter = _arbiter(args, token_needed=False)
    doc = arbiter.call("GET", "/v1/status").json()
    if not isinstance(doc, dict):
        raise ArbiterError(f"the arbiter's status is not an object: {doc!r:.80}")
    if args.json:
        _dump(doc, out)
    else:
        out.write(format_status(doc, arbiter.url, time.time(), arbiter.token is not None))
    return 0


def _cmd_job_submit(args: argparse.Namespace, out: TextIO) -> int:
    import secrets

    if args.timeout is not None and not args.wait:
        raise UsageError("--timeout applies to --wait: add --wait or drop --timeout")
    workflow = load_workflow(args.workflow)
    images = load_images(args.image)
    arbiter = _arbiter(args)
    body, ctype = encode_multipart(workflow, images, "cardshare-" + secrets.token_hex(16))
    doc = arbiter.call("POST", "/v1/jobs", body, ctype, expect=(201,)).json()
    job_id = doc.get("id") if isinstance(doc, dict) else None
    if not isinstance(job_id, str) or not job_id:
        raise ArbiterError(f"the arbiter accepted the job but named no id: {doc!r:.80}")
    if not args.wait:
        if args.json:
            _dump(doc, out)
        else:
            out.write(job_id + "\n")
        return 0
    final = wait_for_job(arbiter, job_id, args.timeout, sys.stderr)
    return _report_final(final, args.json, out)


def _report_final(doc: dict[str, Any], as_json: bool, out: TextIO) -> int:
    if as_json:
        _dump(doc, out)
    else:
        out.write(format_job(doc))
    if doc["state"] == "done":
        return 0
    reason = f": {doc['reason']}" if doc.get("reason") else ""
    print(f"cardshare: error: job {doc.get('id')} {doc['state']}{reason}", file=sys.stderr)
    return 1


def wait_for_job(
    arbiter: Arbiter,
    job_id: str,
    timeout: float | None,
    progress: TextIO,
    clock: Any = time.monotonic,
    sleep: Any = time.sleep,
) -> dict[str, Any]:
    """Poll the job until it is done, failed or cancelled; its state changes go to
    ``progress``.  Raises ArbiterError when ``timeout`` seconds pass first (the job stays
    queued) or the arbiter stays unreachable for WAIT_UNREACHABLE_SECONDS."""
    start = clock()
    delay = POLL_FIRST_SECONDS
    seen: tuple[Any, ...] = ()
    state = "submitted"
    down_since: float | None = None
    while True:
        try:
            doc = arbiter.job(job_id)
        except Unreachable as exc:
            now = clock()
            if down_since is None:
                down_since = now
                progress.write(f"job {job_id}: the arbiter does not answer, still waiting\n")
            if now - down_since > WAIT_UNREACHABLE_SECONDS:
                raise ArbiterError(f"{exc} (for {WAIT_UNREACHABLE_SECONDS:g} s)") from None
        else:
            down_since = None
            state = doc["state"]
            now_seen = (state, doc.get("attempts"), doc.get("cancel_requested"))
            if now_seen != seen:
                seen = now_seen
                extra = f", attempt {doc['attempts']}" if state == "running" else ""
                cancel = ", cancel requested" if doc.get("cancel_requested") else ""
                progress.write(f"job {job_id}: {state}{extra}{cancel}\n")
            if state in FINAL_STATES:
                return doc
        elapsed = clock() - start
        if timeout is not None and elapsed >= timeout:
            raise ArbiterError(
                f"job {job_id} is still {state} after {timeout:g} s; it stays on the arbiter: "
                f"`cardshare job show {job_id}`, or `cardshare job cancel {job_id}`"
            )
        pause = delay if timeout is None else min(delay, max(0.0, timeout - elapsed))
        sleep(pause)
        delay = min(delay * POLL_GROWTH, POLL_MAX_SECONDS)


def _cmd_job_show(args: argparse.Namespace, out: TextIO) -> int:
    doc = _arbiter(args).job(args.id)
    if args.json:
        _dump(doc, out)
    else:
        out.write(format_job(doc))
    return 0


def _cmd_job_outputs(args: argparse.Namespace, out: TextIO) -> int:
    arbiter = _arbiter(args)
    doc = arbiter.job(args.id)
    job_id = str(doc.get("id", args.id))
    if _SAFE_ID_RE.match(job_id) is None:
        raise ArbiterError(f"the arbiter named the job {job_id!r:.80}: not usable in a file name")
    if doc["state"] != "done":
        reason = f" ({doc['reason']})" if doc.get("reason") else ""
        hint = (
            f"; wait for it: `cardshare job show {job_id}`"
            if doc["state"] not in FINAL_STATES
            else ""
        )
        raise ArbiterError(
            f"job {job_id} is {doc['state']}{reason}: only a done job has outputs{hint}"
        )
    urls = doc.get("outputs") or []
    args.to.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for n, url in enumerate(urls):
        if not isinstance(url, str) or not url.startswith("/v1/jobs/"):
            raise ArbiterError(f"job {job_id}: output {n} has no API path: {url!r:.80}")
        data = arbiter.call("GET", url).body
        path = args.to / f"{job_id}-{n}.png"
        write_file_atomic(path, data)
        written.append(path)
        if not args.json:
            out.write(f"wrote {path} ({len(data)} bytes)\n")
    if args.json:
        _dump({"id": job_id, "files": [str(p) for p in written]}, out)
    elif not written:
        out.write(f"job {job_id} is done and saved no images\n")
    return 0


def _cmd_job_cancel(args: argparse.Namespace, out: TextIO) -> int:
    arbiter = _arbiter(args)
    reply = arbiter.call("DELETE", job_path(args.id), expect=(200, 202))
    doc = reply.json()
    if args.json:
        _dump(doc, out)
    elif reply.status == 202:
        out.write(
            f"job {args.id} is running: cancel requested; the arbiter interrupts its prompt and "
            f"ends it (`cardshare job show {args.id}`)\n"
        )
    else:
        out.write(f"job {args.id} cancelled (it was queued)\n")
    return 0


def _arbiter_options() -> argparse.ArgumentParser:
    """The parent of every arbiter command: its address, the token, ``--json``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--arbiter",
        metavar="URL",
        type=arbiter_url,
        help=f"the arbiter's API (default ${ARBITER_URL_ENV}, else {DEFAULT_ARBITER_URL})",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        type=Path,
        help=f"file of the arbiter's bearer token (default {DEFAULT_TOKEN_FILE}, root only)",
    )
    parser.add_argument("--json", action="store_true", help="print the API's JSON document")
    return parser


def add_parsers(sub: Any) -> None:
    shared = [_arbiter_options()]
    sub.add_parser("status", help="the arbiter: mode, queue, engine, alerts, swaps", parents=shared)
    job = sub.add_parser("job", help="image jobs on the arbiter: submit, show, outputs, cancel")
    verbs = job.add_subparsers(dest="job_command", required=True, metavar="VERB")
    submit = verbs.add_parser("submit", help="submit a ComfyUI API-format workflow", parents=shared)
    submit.add_argument("workflow", type=Path, metavar="WORKFLOW.json")
    submit.add_argument(
        "--image",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="an input image; the workflow names it by its file name (repeatable)",
    )
    submit.add_argument(
        "--wait",
        action="store_true",
        help="poll until the job ends; exit 1 unless it is done",
    )
    submit.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="with --wait: give up waiting after S seconds (the job stays queued)",
    )
    show = verbs.add_parser(
        "show", help="a job's state, reason, attempts and outputs", parents=shared
    )
    show.add_argument("id", metavar="ID")
    outputs = verbs.add_parser(
        "outputs", help="write a done job's images as DIR/<id>-<n>.png", parents=shared
    )
    outputs.add_argument("id", metavar="ID")
    outputs.add_argument("--to", type=Path, required=True, metavar="DIR")
    cancel = verbs.add_parser("cancel", help="cancel a queued or running job", parents=shared)
    cancel.add_argument("id", metavar="ID")


COMMANDS = {"status": _cmd_status}
JOB_COMMANDS = {
    "submit": _cmd_job_submit,
    "show": _cmd_job_show,
    "outputs": _cmd_job_outputs,
    "cancel": _cmd_job_cancel,
}
