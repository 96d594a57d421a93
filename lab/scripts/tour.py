"""The end of `make demo`: show, on the lab host, that the box works.

Runs on the lab host (python3, standard library only; `docker exec -i HOST python3 - <
lab/scripts/tour.py`). Prints what each service answers and exits non-zero when one does
not: vLLM's computed flags in the engine's view, a completion through the patient proxy,
an image job traded through the arbiter (vLLM stopped, ComfyUI started, the photo made,
the card handed back), an embedding and a rerank through the retrieval tier (resident on the
card through the swap), who the recorder saw on the card, and a few lines of the Prometheus
textfile it writes for node_exporter (when recorder_textfile_path is set), the arbiter's
status page, and the re-encode campaign taking a 4K clip dropped into the library (made by
ffmpeg in the campaign's container; the lab's encoder is the software one, SIMULATION).
"""

import base64
import json
import shlex
import subprocess
import sys
import time
import urllib.request
import zlib

ARBITER = "http://127.0.0.1:8090"
RETRIEVAL = "http://127.0.0.1:8100"
PROXY = "http://127.0.0.1:8080"
RECORDER_UNIT = "cardshare-recorder.service"
CAMPAIGN = "http://127.0.0.1:8097"
CAMPAIGN_CONTAINER = "campaign-encoder-1"
# a library of the lab inventory's transcode_campaign_libraries
TOUR_CLIP = "/srv/media/Films/A Tour Remux (2026).mkv"
# made beside the library, on its filesystem, then moved in
TOUR_STAGING = "/srv/media/.tour-remux.mkv"
# the textfile's metrics the tour shows: VRAM and busy share per client
TEXTFILE_SHOWN = ("cardshare_client_vram_bytes", "cardshare_client_engine_busy_ratio")
with open("/etc/cardshare/arbiter/token", encoding="utf-8") as _fh:
    TOKEN = _fh.read().strip()


def call(method, url, body=None, token=False, timeout=120):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + TOKEN
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw


def png():
    def chunk(kind, data):
        return (
            len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
        )

    raw = b"".join(b"\x00" + bytes((x * 7 + y) % 256 for x in range(24)) for y in range(8))
    head = (8).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", head)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def textfile_path():
    """The Prometheus textfile the recorder's unit writes (its --textfile), or None."""
    unit = subprocess.check_output(["systemctl", "cat", RECORDER_UNIT]).decode()
    for line in unit.splitlines():
        if line.startswith("ExecStart="):
            argv = shlex.split(line[len("ExecStart=") :])
            if "--textfile" in argv:
                return argv[argv.index("--textfile") + 1]
    return None


def metric_of(line):
    """The metric a textfile line is about: a sample's name, or the one a # HELP/# TYPE names."""
    if line.startswith("#"):
        parts = line.split()
        return parts[2] if len(parts) > 2 else ""
    return line.split("{", 1)[0].split(" ", 1)[0]


def show_textfile():
    path = textfile_path()
    if path is None:
        print("the recorder writes no Prometheus textfile (recorder_textfile_path is null)")
        return
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        sys.exit(f"the recorder's unit names the textfile {path}, which cannot be read: {exc}")
    samples = [line for line in lines if line and not line.startswith("#")]
    print(f"the Prometheus textfile for node_exporter: {path} ({len(samples)} samples), a few:")
    for name in TEXTFILE_SHOWN:
        shown = [line for line in lines if line.startswith("# HELP ") and metric_of(line) == name]
        shown += [line for line in samples if metric_of(line) == name][:3]
        print("  " + "\n  ".join(shown))


def retrieval_started():
    return (
        subprocess.check_output(
            ["docker", "inspect", "-f", "{{.State.StartedAt}}", "retrieval-ovms-1"]
        )
        .decode()
        .strip()
    )


def show_retrieval(started_before_swap):
    """An embedding and a rerank through the retrieval tier, which no swap touches."""
    with open("/var/lib/cardshare/retrieval/tier.json", encoding="utf-8") as fh:
        tier = json.load(fh)
    started = retrieval_started()
    if started != started_before_swap:
        sys.exit(f"the retrieval tier restarted in the swap: {started_before_swap} -> {started}")
    vector = call(
        "POST",
        f"{RETRIEVAL}/v3/embeddings",
        {"model": tier["embedding_model"], "input": "a shared inference box"},
    )["data"][0]["embedding"]
    print(
        f"the retrieval tier ({tier['revision']} on the {tier['device']}, up since {started}, "
        "untouched by the swap): "
        f"an embedding of {len(vector)} numbers from {tier['embedding_model']}"
    )
    documents = [
        "The arbiter hands the whole card to ComfyUI when vLLM has been idle.",
        "Sourdough needs a long cold proof.",
        "Arctic terns migrate farther than any other bird.",
    ]
    ranked = call(
        "POST",
        f"{RETRIEVAL}/v3/rerank",
        {
            "model": tier["rerank_model"],
            "query": "who gets the card when the LLM is idle?",
            "documents": documents,
        },
    )["results"]
    print(f"a rerank by {tier['rerank_model']}, best first:")
    for item in ranked:
        print(f"  {item['relevance_score']:.4f}  {documents[item['index']]}")
    if ranked[0]["index"] != 0:
        sys.exit(f"the rerank did not put the relevant document first: {ranked}")


def main():
    args = json.loads(
        subprocess.check_output(["docker", "inspect", "-f", "{{json .Args}}", "vllm-vllm-1"])
    )
    mem = (
        subprocess.check_output(
            ["docker", "inspect", "-f", "{{.HostConfig.Memory}}", "vllm-vllm-1"]
        )
        .decode()
        .strip()
    )
    flags = {
        a: args[i + 1]
        for i, a in enumerate(args[:-1])
        if a
        in ("--gpu-memory-utilization", "--max-model-len", "--hf-overrides", "--tool-call-parser")
    }
    print("vLLM, as the engine runs it:")
    for k, v in flags.items():
        print(f"  {k} {v}")
    print(f"  memory cap {int(mem) / 2**30:g} GiB")

    model = call("GET", f"{PROXY}/v1/models")["data"][0]["id"]
    reply = call(
        "POST",
        f"{PROXY}/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6},
    )
    print(f"a completion through the patient proxy: {reply['choices'][0]['message']['content']!r}")

    retrieval_before = retrieval_started()
    with open("/var/tmp/cardshare-tour-workflow.json") as fh:
        workflow = json.load(fh)
    job = call(
        "POST",
        f"{ARBITER}/v1/jobs",
        {"workflow": workflow, "inputs": {"render.png": base64.b64encode(png()).decode()}},
        token=True,
    )
    print(f"an image job queued: {job['id']}; the arbiter swaps when vLLM has been idle")
    seen, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        st = call("GET", f"{ARBITER}/v1/status")
        state = call("GET", f"{ARBITER}/v1/jobs/{job['id']}", token=True)["state"]
        step = f"{st['mode']}/{st['phase']} job {state}"
        if not seen or seen[-1] != step:
            seen.append(step)
            print(f"  {step}")
        if state in ("done", "failed") and st["mode"] == "llm":
            break
        time.sleep(0.5)
    doc = call("GET", f"{ARBITER}/v1/jobs/{job['id']}", token=True)
    if doc["state"] != "done":
        sys.exit(f"the image job did not finish: {doc}")
    photo = call("GET", ARBITER + doc["outputs"][0], token=True)
    swap = call("GET", f"{ARBITER}/v1/status")["swaps"][:2]
    print(f"the photo: {len(photo)} bytes of PNG; the card is back with vLLM")
    for s in reversed(swap):
        phases = ", ".join(f"{p['phase']} {p['seconds']:.1f}s" for p in s["phases"])
        print(f"  swap {s['direction']}: {s['total_seconds']:.1f}s ({phases})")

    show_retrieval(retrieval_before)

    out = subprocess.check_output(
        ["cardshare", "clients", "--data-dir", "/var/lib/cardshare/recorder"]
    ).decode()
    print("who the recorder saw on the card at its last scan:")
    print("  " + out.strip().replace("\n", "\n  "))
    show_textfile()
    show_status_page()
    show_campaign()


def show_status_page():
    page = call("GET", ARBITER + "/")
    if b'data-chart="vram-day"' not in page:
        sys.exit("the arbiter's status page has no VRAM chart")
    doc = call("GET", ARBITER + "/v1/overview")
    history = doc["history"] or {}
    print(
        f"the status page: {ARBITER}/ on the lab host ({len(page)} bytes; mode {doc['mode']}, "
        f"{len(doc['tenants'])} tenants, {history.get('scans', 0)} recorder scans charted; "
        f"the same as JSON at /v1/overview). To open it from a browser or a phone, set "
        f"arbiter_listen_address to the box's LAN address."
    )


def show_campaign():
    """A 4K remux-like clip into the library; the campaign encodes, verifies and replaces it."""
    if call("GET", f"{CAMPAIGN}/v1/status")["counts"].get("done", 0) == 0:
        subprocess.run(
            ["docker", "exec", CAMPAIGN_CONTAINER, "ffmpeg", "-v", "error", "-y",
             "-f", "lavfi", "-i", "testsrc2=size=3840x2160:rate=24:duration=2",
             "-f", "lavfi", "-i", "sine=f=440:d=2",
             "-c:v", "libx264", "-preset", "ultrafast", "-qp", "6", "-c:a", "flac",
             "-metadata:s:a:0", "language=eng", TOUR_STAGING],
            check=True,
        )  # fmt: skip
        # into the library whole, as a download client moves a finished file
        subprocess.run(["mv", TOUR_STAGING, TOUR_CLIP], check=True)
        print(f"a 4K clip dropped into the library: {TOUR_CLIP}")
    deadline = time.monotonic() + 300
    while call("GET", f"{CAMPAIGN}/v1/status")["counts"].get("done", 0) == 0:
        if time.monotonic() > deadline:
            sys.exit("the campaign did not re-encode the clip:\n" + campaign_status())
        time.sleep(2)
    print("the re-encode campaign, as `cardshare campaign status` tells it:")
    print("  " + campaign_status().strip().replace("\n", "\n  "))


def campaign_status():
    return subprocess.run(
        ["cardshare", "campaign", "status"], capture_output=True, text=True, check=False
    ).stdout


if __name__ == "__main__":
    main()
