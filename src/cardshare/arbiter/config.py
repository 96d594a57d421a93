"""The arbiter's configuration: a JSON file, validated at start with messages that name
the key, the bad value and the fix."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cardshare.arbiter.plans import LlmPlan


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ContainerRef:
    project: str
    service: str

    @property
    def client_name(self) -> str:
        """How the recorder names the container's DRM client (compose project/service)."""
        return f"{self.project}/{self.service}"


@dataclass(frozen=True)
class YieldingTenant:
    name: str  # as the recorder names the client (project/service)
    url: str
    ack_seconds: float = 30.0


@dataclass(frozen=True)
class Config:
    data_dir: Path
    vllm_url: str
    served_model_name: str
    comfyui_url: str
    card_current_json: Path
    token_file: Path
    # vLLM's own API key (its first line), sent as a bearer token with the one-token
    # completion; None: vLLM takes no key
    vllm_api_key_file: Path | None = None
    llm_container: ContainerRef = ContainerRef("vllm", "vllm")
    image_container: ContainerRef = ContainerRef("comfyui", "comfyui")
    docker_socket: str = "/var/run/docker.sock"
    proxy_url: str | None = None
    # the fleet view the patient proxy serves (which box serves, each box's mode): the status
    # page links to it; "": no link
    fleet_view_url: str = ""
    # this box's name in the proxy's boxes (a fleet): its in-flight requests and last request
    # times are read from its own entry of /proxy/state, the held requests fleet-wide; "": the
    # proxy's totals (one box)
    proxy_box: str = ""
    card_scan_argv: tuple[str, ...] = ()
    card_data_max_age_seconds: float = 120.0
    # the card the arbiter trades (its PCI address, as drm-pdev and sysfs print it); None:
    # every card of the card data (a host with one GPU)
    card_pdev: str | None = None
    # the LLM pool the arbiter trades as one owner (vLLM's tensor-parallel cards, by PCI
    # address): a swap waits for every pool card's release, and only the pool cards' clients
    # are on the card; empty: card_pdev alone (see pool)
    pool_pdevs: tuple[str, ...] = ()
    # the pool card ComfyUI runs on; None: the pool's first (see image_pdev)
    image_card_pdev: str | None = None
    # the card that takes Plex's and the campaign's transcodes, by PCI address (not a pool
    # card): the status page draws it after the pool; None: not named
    transcode_pdev: str | None = None
    llm_client_names: tuple[str, ...] = ()
    image_client_names: tuple[str, ...] = ()
    # tenants that stay on the card through every swap (the retrieval tier): never a reason
    # to hold a swap; their memory is planned as a reservation of the card
    resident_client_names: tuple[str, ...] = ()
    # work that steps aside when asked (a re-encode campaign): shown by kind, never a veto
    # of its own accord once it can be paused (no such tenant pauses yet: they are reported)
    yielding_client_names: tuple[str, ...] = ()
    # vLLM's ladder of plans, the full plan first (from the vllm role); empty: one plan, the
    # llm_container, started whatever the card holds
    llm_plans: tuple[LlmPlan, ...] = ()
    # the card's size when the driver does not report it (the recorder's vram_total_bytes)
    card_vram_bytes: int | None = None
    # kept free beside a plan's reservation when choosing it (the driver's own needs)
    vram_headroom_bytes: int = 0
    # after a series of starts gave up for want of VRAM: more free memory than this, or
    # other holders, starts a new series
    vram_retry_margin_bytes: int = 512 * 1024 * 1024
    # a smaller plan serving: go back to a larger one when it fits, at an idle moment
    restore_full_plan: bool = True
    # a policy, off by default (the veto stands): swap to image while a foreign client (Plex)
    # is on the card when the next job's measured peak, everyone's measured VRAM, the reserve
    # for new foreign work (Plex's next transcodes) and the headroom fit the card
    image_beside_foreign: bool = False
    foreign_reserve_bytes: int = 0
    # yielding tenants the arbiter can ask to step aside: name -> (base URL, seconds its ack
    # may take); their names are yielding clients too
    yielding_tenants: tuple[YieldingTenant, ...] = ()
    # how long a pause lasts unless renewed (a lease: a tenant never stays paused for an
    # arbiter that went away)
    yield_lease_seconds: float = 900.0
    # vLLM's weights (paths in the arbiter's container) read into the page cache while the
    # last image job runs, while MemAvailable stays above what is left plus the margin
    prewarm_paths: tuple[str, ...] = ()
    # the recorder's history directory (the status page's charts); None: no history
    history_dir: Path | None = None
    # the recorder's own current.json (its timer's scans), read beside card_current_json
    # (the arbiter's scans): the newer of the two is the card; None: the arbiter's only
    recorder_current_json: Path | None = None
    # clients whose busy video engines are transcodes (the status page's hours per day)
    transcode_client_names: tuple[str, ...] = ()
    prewarm_margin_bytes: int = 4 * 1024**3
    idle_seconds: float = 60.0
    max_image_seconds: float = 900.0
    poll_interval_seconds: float = 2.0
    stop_timeout_seconds: int = 30
    llm_release_timeout_seconds: float = 120.0
    image_ready_timeout_seconds: float = 300.0
    image_release_timeout_seconds: float = 120.0
    llm_ready_timeout_seconds: float = 600.0
    job_timeout_seconds: float = 1800.0
    http_timeout_seconds: float = 10.0
    llm_retry_backoff_seconds: float = 10.0
    llm_retry_backoff_max_seconds: float = 300.0
    job_max_attempts: int = 3
    handback_on_waiting_agent: bool = True
    listen_host: str = "127.0.0.1"
    listen_port: int = 8090
    max_payload_bytes: int = 32 * 1024 * 1024
    swap_history: int = 20
    # supervision: the engine's heartbeat older than this fails the healthcheck (longer than
    # the longest single wait on an edge: a Docker stop of stop_timeout_seconds plus its
    # own 30 s timeout)
    heartbeat_stale_seconds: float = 180.0
    engine_backoff_max_seconds: float = 60.0
    # a job on which the arbiter itself failed this many times is failed (a poison job)
    job_max_errors: int = 3
    # ComfyUI polls in a row that get no answer while its container runs: then it hangs
    comfyui_unanswered_polls: int = 3
    # restarts of ComfyUI one job may cause (it died or hung under it) before it is failed:
    # a fault that outlives restarts ends the job instead of restarting without end
    job_max_restarts: int = 3
    # restarts of ComfyUI in any hour: one more is not made, the card goes back to vLLM and
    # no swap to image starts until the oldest of them is an hour old (the jobs stay queued)
    comfyui_max_restarts_per_hour: int = 12
    # swaps to image after ComfyUI failed to come up: base, 2x, 4x ... capped
    image_retry_backoff_seconds: float = 60.0
    image_retry_backoff_max_seconds: float = 3600.0
    # free space the data directory must keep: below it, jobs are paused and refused
    min_free_bytes: int = 64 * 1024 * 1024
    # slow clients: a request head must arrive within this, a body (up to max_payload_bytes)
    # within that, and an idle kept-alive connection is closed after the third
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 60.0
    keepalive_timeout_seconds: float = 75.0

    @property
    def plans(self) -> tuple[LlmPlan, ...]:
        return self.llm_plans or (LlmPlan(self.llm_container.service),)

    def plan_container(self, index: int) -> ContainerRef:
        plan = self.plans[index]
        return ContainerRef(plan.project or self.llm_container.project, plan.service)

    @property
    def pool(self) -> tuple[str, ...]:
        """The cards the arbiter trades: pool_pdevs, else card_pdev alone, else none named
        (every card of a one-GPU host)."""
        return self.pool_pdevs or ((self.card_pdev,) if self.card_pdev else ())

    @property
    def image_pdev(self) -> str | None:
        """ComfyUI's card: the one named, else the pool's first (None: the one card)."""
        return self.image_card_pdev or (self.pool[0] if self.pool else None)

    @property
    def yielding_names(self) -> tuple[str, ...]:
        names = list(self.yielding_client_names)
        names += [t.name for t in self.yielding_tenants if t.name not in names]
        return tuple(names)

    @property
    def llm_names(self) -> tuple[str, ...]:
        return self.llm_client_names or tuple(
            self.plan_container(i).client_name for i in range(len(self.plans))
        )

    @property
    def image_names(self) -> tuple[str, ...]:
        return self.image_client_names or (self.image_container.client_name,)


# a PCI address as sysfs and DRM fdinfo's drm-pdev print it: domain:bus:device.function
_PDEV_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_REQUIRED_STR = ("vllm_url", "served_model_name", "comfyui_url")
_REQUIRED_PATH = ("data_dir", "card_current_json", "token_file")
_POSITIVE_FLOAT = (
    "card_data_max_age_seconds",
    "idle_seconds",
    "max_image_seconds",
    "poll_interval_seconds",
    "llm_release_timeout_seconds",
    "image_ready_timeout_seconds",
    "image_release_timeout_seconds",
    "llm_ready_timeout_seconds",
    "job_timeout_seconds",
    "http_timeout_seconds",
    "llm_retry_backoff_seconds",
    "llm_retry_backoff_max_seconds",
    "heartbeat_stale_seconds",
    "engine_backoff_max_seconds",
    "image_retry_backoff_seconds",
    "image_retry_backoff_max_seconds",
    "header_timeout_seconds",
    "body_timeout_seconds",
    "keepalive_timeout_seconds",
    "yield_lease_seconds",
)
_POSITIVE_INT = (
    "stop_timeout_seconds",
    "job_max_attempts",
    "max_payload_bytes",
    "swap_history",
    "job_max_errors",
    "comfyui_unanswered_polls",
    "job_max_restarts",
    "comfyui_max_restarts_per_hour",
    "min_free_bytes",
)
_KNOWN = (
    set(_REQUIRED_STR)
    | set(_REQUIRED_PATH)
    | set(_POSITIVE_FLOAT)
    | set(_POSITIVE_INT)
    | {
        "llm_container",
        "image_container",
        "docker_socket",
        "proxy_url",
        "fleet_view_url",
        "proxy_box",
        "card_scan_argv",
        "vllm_api_key_file",
        "llm_client_names",
        "image_client_names",
        "resident_client_names",
        "yielding_client_names",
        "llm_plans",
        "card_vram_bytes",
        "vram_headroom_bytes",
        "vram_retry_margin_bytes",
        "restore_full_plan",
        "image_beside_foreign",
        "foreign_reserve_bytes",
        "yielding_tenants",
        "prewarm_paths",
        "prewarm_margin_bytes",
        "history_dir",
        "recorder_current_json",
        "card_pdev",
        "pool_pdevs",
        "image_card_pdev",
        "transcode_pdev",
        "transcode_client_names",
        "handback_on_waiting_agent",
        "listen_host",
        "listen_port",
    }
)


def _err(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"config key {key!r} has value {value!r}: {fix}")


def _url(raw: dict[str, Any], key: str) -> str:
    value = raw[key]
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise _err(key, value, "set it to an http:// or https:// base URL")
    return value.rstrip("/")


def _container(raw: dict[str, Any], key: str, default: ContainerRef) -> ContainerRef:
    value = raw.get(key)
    if value is None:
        return default
    if (
        not isinstance(value, dict)
        or set(value) != {"project", "service"}
        or not all(isinstance(v, str) and v for v in value.values())
    ):
        raise _err(key, value, 'set it to {"project": "<compose project>", "service": "<service>"}')
    return ContainerRef(value["project"], value["service"])


def _str_list(raw: dict[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _err(key, value, "set it to a list of non-empty strings")
    return tuple(value)


_PLAN_KEYS = {"service", "gpu_memory_utilization", "max_model_len", "reservation_bytes"}
_PLAN_OPTIONAL = {"project"}


def _whole(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _plans(raw: dict[str, Any], llm: ContainerRef) -> tuple[LlmPlan, ...]:
    value = raw.get("llm_plans", [])
    example = (
        'set it to the vllm role\'s ladder: [{"service": "vllm", "gpu_memory_utilization": '
        '0.85, "max_model_len": 65536, "reservation_bytes": 29205777285}, ...], the full plan '
        "first"
    )
    if not isinstance(value, list):
        raise _err("llm_plans", value, example)
    plans: list[LlmPlan] = []
    for i, item in enumerate(value):
        key = f"llm_plans[{i}]"
        if not isinstance(item, dict) or not _PLAN_KEYS <= set(item) <= _PLAN_KEYS | _PLAN_OPTIONAL:
            raise _err(
                key,
                item,
                f"give the keys {sorted(_PLAN_KEYS)} and optionally {sorted(_PLAN_OPTIONAL)}",
            )
        project = item.get("project")
        if project is not None and (not isinstance(project, str) or not project):
            raise _err(f"{key}.project", project, "set it to the plan's compose project")
        service, util = item["service"], item["gpu_memory_utilization"]
        if not isinstance(service, str) or not service:
            raise _err(f"{key}.service", service, "set it to the plan's compose service")
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise _err(f"{key}.gpu_memory_utilization", util, "set it to a share in (0, 1]")
        if not _whole(item["max_model_len"], 1):
            raise _err(f"{key}.max_model_len", item["max_model_len"], "set it to tokens (> 0)")
        if not _whole(item["reservation_bytes"], 1):
            raise _err(
                f"{key}.reservation_bytes", item["reservation_bytes"], "set it to bytes (> 0)"
            )
        plans.append(
            LlmPlan(service, float(util), item["max_model_len"], item["reservation_bytes"], project)
        )
    if plans and (plans[0].service != llm.service or plans[0].project not in (None, llm.project)):
        raise _err(
            "llm_plans[0].service",
            plans[0].service,
            f"the full plan runs in llm_container's service {llm.service!r}: put it first",
        )
    for i in range(1, len(plans)):
        if plans[i].reservation_bytes >= plans[i - 1].reservation_bytes:
            raise _err(
                f"llm_plans[{i}].reservation_bytes",
                plans[i].reservation_bytes,
                "each plan must ask less of the card than the one before it",
            )
    services = [f"{p.project or llm.project}/{p.service}" for p in plans]
    if len(set(services)) != len(services):
        raise _err("llm_plans", services, "give each plan its own compose service")
    return tuple(plans)


def _yielding_tenants(raw: dict[str, Any]) -> tuple[YieldingTenant, ...]:
    value = raw.get("yielding_tenants", [])
    example = (
        'give a list of {"name": "<project/service>", "url": "http://127.0.0.1:8097", '
        '"ack_seconds": 10}'
    )
    if not isinstance(value, list):
        raise _err("yielding_tenants", value, example)
    tenants = []
    for i, item in enumerate(value):
        key = f"yielding_tenants[{i}]"
        if not isinstance(item, dict) or not {"name", "url"} <= set(item) <= {
            "name",
            "url",
            "ack_seconds",
        }:
            raise _err(key, item, example)
        if not isinstance(item["name"], str) or "/" not in item["name"]:
            raise _err(f"{key}.name", item["name"], "set it to the client's project/service")
        url = item["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise _err(f"{key}.url", url, "set it to an http:// or https:// base URL")
        ack = item.get("ack_seconds", 30.0)
        if isinstance(ack, bool) or not isinstance(ack, int | float) or not 0 < ack <= 300:
            raise _err(f"{key}.ack_seconds", ack, "set it to seconds in (0, 300]")
        tenants.append(YieldingTenant(item["name"], url.rstrip("/"), float(ack)))
    return tuple(tenants)


def _pool(raw: dict[str, Any], card: str | None) -> dict[str, Any]:
    """pool_pdevs, image_card_pdev and transcode_pdev, checked against each other and
    card_pdev."""
    out: dict[str, Any] = {}
    value = raw.get("pool_pdevs")
    pool: tuple[str, ...] = (card,) if card else ()
    if value is not None:
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, str) and _PDEV_RE.fullmatch(v) for v in value)
            or len(set(value)) != len(value)
        ):
            raise _err(
                "pool_pdevs",
                value,
                "set it to the LLM pool's cards, each PCI address once as sysfs prints it "
                "(such as ['0000:03:00.0', '0000:04:00.0']), or leave it out for card_pdev alone",
            )
        if card is not None and card not in value:
            raise _err(
                "card_pdev",
                card,
                f"name one of pool_pdevs {value} (the pool's first), or leave card_pdev out",
            )
        pool = out["pool_pdevs"] = tuple(value)
    image = raw.get("image_card_pdev")
    if image is not None:
        if not pool:
            raise _err(
                "image_card_pdev",
                image,
                "leave it out on a host whose cards are not named (ComfyUI shares the one "
                "card), or set card_pdev or pool_pdevs",
            )
        if not isinstance(image, str) or image not in pool:
            raise _err(
                "image_card_pdev",
                image,
                f"name one of the pool's cards {list(pool)}, or leave it out for the first",
            )
        out["image_card_pdev"] = image
    transcode = raw.get("transcode_pdev")
    if transcode is not None:
        if not isinstance(transcode, str) or not _PDEV_RE.fullmatch(transcode):
            raise _err(
                "transcode_pdev",
                transcode,
                "set it to the transcode card's PCI address as sysfs prints it (such as "
                "'0000:07:00.0'), or leave it out",
            )
        if transcode in pool:
            raise _err(
                "transcode_pdev",
                transcode,
                f"name a card outside the LLM pool {list(pool)} (a card takes one job), or "
                "leave it out when transcodes share the pool's card",
            )
        out["transcode_pdev"] = transcode
    return out


def parse_config(raw: Any) -> Config:
    """Validate a decoded JSON document and build a :class:`Config`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise _err(unknown[0], raw[unknown[0]], "remove it (unknown key; check its spelling)")
    for key in (*_REQUIRED_STR, *_REQUIRED_PATH):
        if key not in raw:
            raise ConfigError(f"config key {key!r} is missing: set it")
    for key in _REQUIRED_PATH:
        if not isinstance(raw[key], str) or not raw[key]:
            raise _err(key, raw[key], "set it to a path")
    if not isinstance(raw["served_model_name"], str) or not raw["served_model_name"]:
        raise _err("served_model_name", raw["served_model_name"], "set it to vLLM's model name")
    kwargs: dict[str, Any] = {
        "data_dir": Path(raw["data_dir"]),
        "card_current_json": Path(raw["card_current_json"]),
        "token_file": Path(raw["token_file"]),
        "vllm_url": _url(raw, "vllm_url"),
        "comfyui_url": _url(raw, "comfyui_url"),
        "served_model_name": raw["served_model_name"],
        "llm_container": _container(raw, "llm_container", ContainerRef("vllm", "vllm")),
        "image_container": _container(raw, "image_container", ContainerRef("comfyui", "comfyui")),
        "card_scan_argv": _str_list(raw, "card_scan_argv"),
        "llm_client_names": _str_list(raw, "llm_client_names"),
        "image_client_names": _str_list(raw, "image_client_names"),
        "resident_client_names": _str_list(raw, "resident_client_names"),
        "yielding_client_names": _str_list(raw, "yielding_client_names"),
        "prewarm_paths": _str_list(raw, "prewarm_paths"),
        "transcode_client_names": _str_list(raw, "transcode_client_names"),
    }
    history = raw.get("history_dir")
    if history is not None:
        if not isinstance(history, str) or not history.startswith("/"):
            raise _err(
                "history_dir", history, "set it to the recorder's history directory (absolute)"
            )
        kwargs["history_dir"] = Path(history)
    key_file = raw.get("vllm_api_key_file")
    if key_file is not None:
        if not isinstance(key_file, str) or not key_file.startswith("/"):
            raise _err(
                "vllm_api_key_file",
                key_file,
                "set it to the absolute path of vLLM's key file (the key on its first line), "
                "or leave it out when vLLM takes no key",
            )
        kwargs["vllm_api_key_file"] = Path(key_file)
    recorder_json = raw.get("recorder_current_json")
    if recorder_json is not None:
        if not isinstance(recorder_json, str) or not recorder_json.startswith("/"):
            raise _err(
                "recorder_current_json",
                recorder_json,
                "set it to the recorder's current.json (absolute), or leave it out",
            )
        kwargs["recorder_current_json"] = Path(recorder_json)
    pdev = raw.get("card_pdev")
    if pdev is not None:
        if not isinstance(pdev, str) or not _PDEV_RE.fullmatch(pdev):
            raise _err(
                "card_pdev",
                pdev,
                "set it to the card's PCI address as sysfs prints it (such as '0000:03:00.0'), "
                "or leave it out on a host with one GPU",
            )
        kwargs["card_pdev"] = pdev
    kwargs.update(_pool(raw, pdev))
    for path in kwargs["prewarm_paths"]:
        if not path.startswith("/"):
            raise _err("prewarm_paths", list(kwargs["prewarm_paths"]), "give absolute paths")
    kwargs["llm_plans"] = _plans(raw, kwargs["llm_container"])
    kwargs["yielding_tenants"] = _yielding_tenants(raw)
    for key, minimum in (
        ("card_vram_bytes", 1),
        ("vram_headroom_bytes", 0),
        ("vram_retry_margin_bytes", 1),
        ("foreign_reserve_bytes", 0),
        ("prewarm_margin_bytes", 0),
    ):
        if raw.get(key) is not None:
            if not _whole(raw[key], minimum):
                raise _err(key, raw[key], f"set it to a whole number of bytes >= {minimum}")
            kwargs[key] = raw[key]
    if raw.get("proxy_url") is not None:
        kwargs["proxy_url"] = _url(raw, "proxy_url")
    fleet = raw.get("fleet_view_url", "")
    if fleet != "":
        if not isinstance(fleet, str) or not fleet.startswith(("http://", "https://")):
            raise _err(
                "fleet_view_url",
                fleet,
                'set it to the fleet view\'s http:// or https:// URL, or "" for no link',
            )
        kwargs["fleet_view_url"] = fleet
    box = raw.get("proxy_box", "")
    if box != "":
        if not isinstance(box, str) or box.strip() != box or raw.get("proxy_url") is None:
            raise _err(
                "proxy_box",
                box,
                "set it to this box's name in the proxy's boxes (with proxy_url the fleet "
                'proxy\'s URL), or "" for a proxy of one box',
            )
        kwargs["proxy_box"] = box
    for key in ("docker_socket", "listen_host"):
        if key in raw:
            if not isinstance(raw[key], str) or not raw[key]:
                raise _err(key, raw[key], "set it to a non-empty string")
            kwargs[key] = raw[key]
    for key in _POSITIVE_FLOAT:
        if key in raw:
            value = raw[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)  # JSON's NaN and Infinity parse as floats
                or value <= 0
            ):
                raise _err(key, value, "set it to a finite number greater than 0")
            kwargs[key] = float(value)
    for key in _POSITIVE_INT:
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise _err(key, value, "set it to a whole number greater than 0")
            kwargs[key] = value
    if "listen_port" in raw:
        port = raw["listen_port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise _err("listen_port", port, "set it to a TCP port between 1 and 65535")
        kwargs["listen_port"] = port
    for key in ("handback_on_waiting_agent", "restore_full_plan", "image_beside_foreign"):
        if key in raw:
            if not isinstance(raw[key], bool):
                raise _err(key, raw[key], "use true or false")
            kwargs[key] = raw[key]
    config = Config(**kwargs)
    if config.llm_retry_backoff_max_seconds < config.llm_retry_backoff_seconds:
        raise _err(
            "llm_retry_backoff_max_seconds",
            raw.get("llm_retry_backoff_max_seconds"),
            "set it at least as large as llm_retry_backoff_seconds",
        )
    if config.image_retry_backoff_max_seconds < config.image_retry_backoff_seconds:
        raise _err(
            "image_retry_backoff_max_seconds",
            raw.get("image_retry_backoff_max_seconds"),
            "set it at least as large as image_retry_backoff_seconds",
        )
    return config


def load_config(path: Path) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
    return parse_config(raw)
