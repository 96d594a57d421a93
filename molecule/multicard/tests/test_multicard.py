"""The write-up's second machine on the lab host: two B70s as vLLM's TP=2 pool, an A380 for
Plex and the re-encode campaign, ComfyUI on the pool's first card, the arbiter trading the pool
as one owner."""

import base64
import json
import shlex
import zlib
from pathlib import Path

from labtest import wait_for

B70_A, B70_B, A380 = "0000:03:00.0", "0000:04:00.0", "0000:07:00.0"
POOL = [B70_A, B70_B]
ROOT = "/srv/cardshare-sim"
ARBITER = "http://127.0.0.1:8090"
TOKEN_FILE = "/etc/cardshare/arbiter/token"
CAMPAIGN = "campaign-encoder-1"
CAMPAIGN_URL = "http://127.0.0.1:8097"
# the example image job the arbiter role ships (FLUX.1 Kontext: a render made a photograph)
WORKFLOW = json.loads(
    (Path(__file__).parents[3] / "roles/arbiter/files/examples/flux_kontext_photo.json").read_text()
)


def _png() -> str:
    """A 1x1 grey PNG, base64: the render the workflow loads."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return len(data).to_bytes(4, "big") + kind + data + crc.to_bytes(4, "big")

    header = (1).to_bytes(4, "big") * 2 + bytes([8, 0, 0, 0, 0])
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
    png += chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


_HTTP = r"""
import json, sys, urllib.error, urllib.request
method, url, body, token = sys.argv[1:5]
headers = {"Content-Type": "application/json"}
if token:
    headers["Authorization"] = "Bearer " + open(token).read().strip()
req = urllib.request.Request(url, data=body.encode() or None, method=method, headers=headers)
try:
    resp = urllib.request.urlopen(req, timeout=60)
    status, raw = resp.status, resp.read()
except urllib.error.HTTPError as exc:
    status, raw = exc.code, exc.read()
print(json.dumps({"status": status, "body": raw.decode()}))
"""


def http(host, method, url, body=None, token=False):
    args = [method, url, json.dumps(body) if body is not None else "", TOKEN_FILE if token else ""]
    answer = json.loads(host.check_output("python3 -c " + shlex.join([_HTTP, *args])))
    return answer["status"], json.loads(answer["body"]) if answer["body"][:1] in "{[" else None


def status(host):
    return http(host, "GET", f"{ARBITER}/v1/status")[1]


def computed(host):
    return json.loads(host.file("/root/multicard.json").content_string)


def inspect(host, name):
    return json.loads(host.check_output(f"docker inspect {name}"))[0]


def devices(host, name):
    found = inspect(host, name)["HostConfig"]["Devices"]
    return [(d["PathOnHost"], d["PathInContainer"]) for d in found]


def by_path(pdev):
    return f"/dev/dri/by-path/pci-{pdev}-render"


def scan(host):
    """A fresh scan by the arbiter's own scanner: each card's client names."""
    host.check_output(
        "docker exec arbiter-arbiter-1 python3 -m cardshare scan --root /srv/cardshare-sim "
        "--data-dir /var/lib/cardshare/arbiter/card --podman-socket= --quiet"
    )
    snap = json.loads(host.file("/var/lib/cardshare/arbiter/card/current.json").content_string)
    cards = snap["cards"].items()
    return {pdev: sorted(c["name"] for c in card["clients"]) for pdev, card in cards}


def campaign_card(host):
    """The card whose node the campaign's encoder opens: the device its config names (vainfo's
    --device and ffmpeg's -vaapi_device), found by its device number in the container among
    the host's cards' render nodes by PCI path."""
    read = "from pathlib import Path; from cardshare.campaign.config import load_config; "
    read += "print(load_config(Path('/etc/cardshare-campaign/campaign.json')).device)"
    device = host.check_output(f"docker exec {CAMPAIGN} python3 -c {shlex.quote(read)}")
    number = host.check_output(f"docker exec {CAMPAIGN} stat -L -c %t:%T {device}")
    cards = {host.check_output(f"stat -L -c %t:%T {ROOT + by_path(p)}"): p for p in [*POOL, A380]}
    assert len(cards) == 3, cards
    print(f"the campaign's encoder opens {device}: {number}, on the host {cards}")
    return cards.get(number)


# SIMULATION: the lab's campaign encodes with the software encoder, which never opens the card;
# this is the DRM client a VAAPI encode of the campaign's container holds while it runs (its
# video engine busy, its frames in VRAM), on the card the campaign's node is, until SIGTERM.
ENCODE_UNIT = "lab-campaign-vaapi-encode"
_ENCODE = r"""
import signal, sys
from pathlib import Path
sys.path.insert(0, "/opt/cardshare-sim")
from simcard import SimClient
root, container, card = sys.argv[1:4]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
argv = ["ffmpeg", "-vaapi_device", "/dev/dri/renderD128", "-i", "clip.mkv", "-c:v", "hevc_vaapi"]
client = SimClient("ffmpeg", argv, root=Path(root), container_id=container, choice=card)
if not client.register(vram=512 * 1024 * 1024):
    sys.exit("no simulated card under " + root)
client.set_busy({"vcs": 1.0})
signal.sigwait({signal.SIGTERM})
client.close()
"""


def test_xe_driver_publishes_the_pool_and_the_transcode_card(host):
    jobs = computed(host)["jobs"]
    assert jobs == {"llm": POOL, "transcode": A380}


def test_vllm_runs_tp2_on_exactly_the_pool_s_render_nodes(host):
    container = inspect(host, "vllm-vllm-1")
    cmd = container["Config"]["Cmd"]
    at = cmd.index("--tensor-parallel-size")
    assert cmd[at + 1] == "2"
    assert devices(host, "vllm-vllm-1") == [(ROOT + by_path(p), by_path(p)) for p in POOL]


def test_the_utilisation_is_the_tightest_pool_card_s(host):
    plan = computed(host)["vllm_plan"]
    shares = {card["pdev"]: card["gpu_memory_utilization"] for card in plan["pool"]}
    print("per-card shares:", shares, "plan:", plan["gpu_memory_utilization"])
    # the retrieval reservation is named on the second B70; Plex's (no pdev) is on the A380
    assert shares[B70_B] < shares[B70_A]
    assert plan["tightest_pdev"] == B70_B
    assert plan["gpu_memory_utilization"] == shares[B70_B]
    cmd = inspect(host, "vllm-vllm-1")["Config"]["Cmd"]
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == f"{shares[B70_B]:.2f}"
    # every smaller plan carries the pool's size too
    for rung in plan["ladder"]:
        assert rung["args"][rung["args"].index("--tensor-parallel-size") + 1] == "2"


def test_vllm_s_ranks_hold_memory_on_both_pool_cards_and_nothing_on_the_a380(host):
    cards = wait_for("vLLM on both pool cards", lambda: (c := scan(host)) and
                     all("vllm/vllm" in c.get(p, []) for p in POOL) and c, 30)  # fmt: skip
    assert "vllm/vllm" not in cards.get(A380, [])


def test_plex_and_comfyui_each_have_their_card_s_node_alone(host):
    assert devices(host, "plex-plex-1") == [(ROOT + by_path(A380), "/dev/dri/renderD128")]
    assert devices(host, "comfyui-comfyui-1") == [(ROOT + by_path(B70_A), by_path(B70_A))]


def test_the_campaign_has_the_a380_s_node_alone_and_its_encoder_opens_it(host):
    assert devices(host, CAMPAIGN) == [(ROOT + by_path(A380), "/dev/dri/renderD128")]
    assert host.check_output(f"docker exec {CAMPAIGN} ls /dev/dri").split() == ["renderD128"]
    assert campaign_card(host) == A380


def test_the_campaign_re_encodes_the_library(host):
    def done():
        counts = http(host, "GET", f"{CAMPAIGN_URL}/v1/status")[1]["counts"]
        return counts if counts.get("done", 0) >= 1 else None

    wait_for("the clip re-encoded", done, 180, step=2)


def test_a380_transcodes_and_encode_leave_the_plan_and_a_swap_waits_for_both_pool_cards(host):
    # the arbiter's card data: its scan of the pool (the recorder's, or its own before a swap)
    before = wait_for("the arbiter's card data", lambda: (s := status(host))["card"] and s, 60)
    assert before["mode"] == "llm", before
    assert [c["pdev"] for c in before["card"]["pool"]] == POOL
    print("plan before the transcode:", before["llm_plan"])

    # two hardware transcodes on the A380 (the Plex stand-in's lab switch)
    code, _ = http(
        host, "POST", "http://127.0.0.1:32400/:/cardshare-sim/transcode?state=on&count=2"
    )
    assert code == 200
    try:
        # and a campaign encode on the card its encoder's node is (SIMULATION: _ENCODE)
        encode = [ROOT, inspect(host, CAMPAIGN)["Id"], campaign_card(host)]
        host.check_output(
            f"systemd-run --unit {ENCODE_UNIT} --collect /usr/bin/python3 -c "
            + shlex.join([_ENCODE, *encode])
        )

        def transcodes():
            cards = scan(host)
            # the recorder names clients by container: both transcoders are plex/plex, the
            # encode campaign/encoder
            seen = {"plex/plex", "campaign/encoder"} <= set(cards.get(A380, []))
            return cards if seen else None

        cards = wait_for(
            "Plex's transcodes and the campaign's encode on the A380",
            transcodes,
            30,
            explain=lambda: host.run(f"journalctl -u {ENCODE_UNIT} --no-pager").stdout,
        )
        assert all(t not in n for t in ("plex", "campaign") for p in POOL for n in cards.get(p, []))
        # one pool card's rank slow to exit: its memory stays 6 s past the other's
        host.check_output(f"mkdir -p {ROOT}/lab && echo '{B70_B} 6' > {ROOT}/lab/vllm-hold-card")
        since = host.check_output("date -u +%Y-%m-%dT%H:%M:%SZ")
        code, job = http(
            host,
            "POST",
            f"{ARBITER}/v1/jobs",
            {"workflow": WORKFLOW, "inputs": {"render.png": _png()}},
            token=True,
        )
        assert code == 201, job

        def done():
            doc = http(host, "GET", f"{ARBITER}/v1/jobs/{job['id']}", token=True)[1]
            return doc if doc["state"] in ("done", "failed") else None

        final = wait_for("the image job", done, 150, step=2, explain=lambda: status(host))
        assert final["state"] == "done", final
        after = wait_for("llm mode again", lambda: (s := status(host))["mode"] == "llm" and
                         s["queue_length"] == 0 and s, 120, step=2)  # fmt: skip
    finally:
        http(host, "POST", "http://127.0.0.1:32400/:/cardshare-sim/transcode?state=off")
        host.run(f"systemctl stop {ENCODE_UNIT}")
    print("plan after the swap, the transcodes and the encode running:", after["llm_plan"])
    # vLLM measured the pool again before its start, Plex and the campaign on the A380 beside
    # it: the full plan
    assert after["llm_plan"]["index"] == 0 == before["llm_plan"]["index"]
    reason = after["llm_plan"]["reason"].lower()
    assert "plex" not in reason and "campaign" not in reason
    # the swap waited on the held card, and named it
    logs = host.check_output(f"docker logs --since {since} arbiter-arbiter-1 2>&1")
    waits = [line for line in logs.splitlines() if "waiting for the release" in line]
    print("\n".join(waits))
    assert any(f"on pool card {B70_B}" in line and B70_A not in line for line in waits), logs
    assert computed(host)["vllm_plan"]["tensor_parallel_size"] == 2
