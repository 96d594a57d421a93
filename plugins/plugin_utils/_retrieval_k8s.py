# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The retrieval tier on Kubernetes: its manifests, and the guard on its device claim
(pure functions, no I/O; the ``retrieval`` role's ``kubernetes`` entry point renders them).

From seed ``000`` ("Retrieval on the idle iGPUs"), on Kubernetes 1.34 or newer with Intel's
DRA driver (``resource.k8s.io/v1``):

* The claim is a ``ResourceClaimTemplate`` asking for exactly one device of a
  ``DeviceClass``, and nothing about its memory. An integrated GPU shares the host's memory
  and its ``ResourceSlice`` publishes ``memory: "0"``: a claim that filters on memory, as a
  ``capacity`` request or as a CEL selector, never matches, and the pod sits ``Pending``
  with no event. :func:`claim_problems` refuses both spellings: a ``capacity`` block that asks
  for memory and a CEL expression that reads a device's memory (the attribute, not the word:
  a toleration's key that says "memory" filters on nothing).
* A node with an iGPU and a card publishes both in one slice, and a claim for one device takes
  either: :func:`bus_id_selector` pins it by PCI address (the iGPU is ``0000:00:02.0``).
* The server runs as uid and gid 5000; where render nodes are ``0660 root:render`` it needs the
  node's render group as a supplemental group (``fsGroup`` does not change a device node).
* The pod references the template twice: ``spec.resourceClaims`` allocates, the container's
  ``resources.claims`` grants use. Either alone is a bug.
* An init container seeds the model volume from the model image (busybox) by the marker
  rule: a revision marker written last, so an interrupted seed runs again and a new revision
  replaces the tree; a per-file copy with a bare ``sync`` after each file, which bounds the
  dirty pages charged to the container's cgroup to one file (busybox's ``sync`` takes no
  file operand). It holds no claim: copying files needs no device.
* Startup waits on one model's readiness (the first boot compiles for the iGPU: minutes),
  readiness asks the other model, liveness the server; a ClusterIP Service only.
* While the tier starts, :func:`k8s_pod_verdict` says where the server's pod is and
  :func:`k8s_reply_states` what ``/v1/config`` says inside it, so that a model the server
  refuses fails the run at once, with the server's reason, instead of at a timeout.
* A CPU control arm (same image, the export's ``cpu/`` tree, no claim) for a benchmark, and
  a negative control (the server's pod spec without the claim, listing ``/dev/dri``): a
  device that shows up without the claim was injected by something else (CDI discovery),
  and the claim would prove nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    RetrievalError,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_ovms import (
    retrieval_servable_states,
)

OVMS_UID = 5000  # the user of OpenVINO Model Server's images (seed 000: "OVMS's uid 5000")
MODELS_MOUNT = "/models"
MARKER = ".cardshare-seed"
CLAIM_NAME = "gpu"
CONTAINER_PORT = 8000

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")  # as the main entry point
_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PATH = re.compile(r"^/[A-Za-z0-9._/-]*[A-Za-z0-9._-]$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_IMAGE = re.compile(
    r"^[^:@\s]+(:[0-9]+)?/?[^:@\s]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*|@sha256:[0-9a-f]{64})$"
)
# a CEL reference to a device's memory: device.capacity["<domain>"].memory (or
# ["memory"]), and the same under device.attributes; a selector reading it never matches an
# integrated GPU, whose slice publishes memory "0"
_CEL_MEMORY = re.compile(
    r"""device\s*\.\s*(?P<map>capacity|attributes)\s*\[\s*(?P<q>["'])[^"']*(?P=q)\s*\]"""
    r"""\s*(?:\.\s*memory\b|\[\s*(?P<q2>["'])memory(?P=q2)\s*\])"""
)
# the standard attribute of a device's PCI address (Intel's DRA driver from gpu-v0.11.0) and
# the driver's own, older one (deprecated there, to be removed at 1.0)
STANDARD_DOMAIN = "resource.kubernetes.io"
INTEL_DOMAIN = "gpu.intel.com"
# an Intel iGPU is always PCI device 2, function 0 of the host bridge's bus 0
IGPU_BUS_ID = "0000:00:02.0"
_BUS_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
BUS_ID_CHOICES = ("auto", "any")


def _walk(value: object, path: str) -> Iterator[tuple[str, str | None, object]]:
    """Every (path, key, value) under ``value``: dict keys and list items, depth first."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            sub = f"{path}.{key}"
            yield sub, str(key), item
            yield from _walk(item, sub)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            sub = f"{path}[{index}]"
            yield sub, None, item
            yield from _walk(item, sub)


def _memory_request(value: object) -> bool:
    """Whether a ``capacity`` block asks for memory (``requests.memory`` or any ``memory``
    key under it): a request for another capacity (``millicores``) is no filter on memory."""
    return any(key is not None and key.lower() == "memory" for _p, key, _v in _walk(value, ""))


def claim_problems(value: object, variable: str = "retrieval_k8s_claim_request") -> list[str]:
    """What in a device request (or a whole claim template) filters on memory: a ``capacity``
    block that asks for memory, or a CEL expression (``cel.expression``) that reads a device's
    memory (``device.capacity["gpu.intel.com"].memory``, the same under
    ``device.attributes``). The word alone is no finding: a toleration key or a model name
    that says "memory" filters on nothing. Each problem names where it is and what it says."""
    problems: list[str] = []
    for path, key, item in _walk(value, variable):
        if key is not None and key.lower() == "capacity" and _memory_request(item):
            problems.append(
                f"{path} asks for memory ({item!r}): an integrated GPU publishes memory "
                '"0", so the claim can never be satisfied and the pod stays Pending with no '
                "event. Remove it: the claim asks for one device, not for its memory."
            )
        elif key == "expression" and isinstance(item, str) and _CEL_MEMORY.search(item):
            problems.append(
                f"{path} is {item!r}, which selects on the device's memory: an integrated GPU "
                'publishes memory "0", so no device matches and the pod stays Pending with no '
                "event. Remove the selector (retrieval_k8s_pci_bus_id pins a device)."
            )
    return problems


def bus_id_selector(device: object, bus_id: object) -> dict[str, Any] | None:
    """The CEL selector that pins the claim's device by its PCI address, or None.

    ``bus_id`` (``retrieval_k8s_pci_bus_id``): ``auto`` pins the iGPU for ``device`` igpu
    (``0000:00:02.0``, where every Intel iGPU sits) and keeps the claim off it for ``card``
    (a node with both publishes both in one slice, and the claim would take either); ``any``
    adds no selector; an address (``0000:03:00.0``) pins that device. The expression reads the
    standard ``resource.kubernetes.io/pciBusID`` where the driver publishes it, else the
    driver's own ``pciAddress``.
    """
    if bus_id == "any":
        return None
    if bus_id == "auto":
        if device not in ("igpu", "card"):
            raise RetrievalError(
                f"retrieval_device is {device!r}: on Kubernetes the tier claims igpu or card"
            )
        operator, address = ("==" if device == "igpu" else "!="), IGPU_BUS_ID
    elif isinstance(bus_id, str) and _BUS_ID.match(bus_id.lower()):
        operator, address = "==", bus_id.lower()
    else:
        raise RetrievalError(
            f"retrieval_k8s_pci_bus_id is {bus_id!r}: give auto (the iGPU for igpu, any other "
            f"device for card), any (no pin), or a PCI address such as {IGPU_BUS_ID} "
            "(kubectl get resourceslices -o yaml lists each device's pciBusID)."
        )
    read = (
        f'("pciBusID" in device.attributes["{STANDARD_DOMAIN}"] ? '
        f'device.attributes["{STANDARD_DOMAIN}"].pciBusID : '
        f'device.attributes["{INTEL_DOMAIN}"].pciAddress)'
    )
    return {"cel": {"expression": f'{read} {operator} "{address}"'}}


def _need(value: object, pattern: re.Pattern[str], variable: str, example: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise RetrievalError(f"{variable} is {value!r}: give {example}.")
    return value


def _quantity(value: object, variable: str, example: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return str(value)
    if isinstance(value, str) and _QUANTITY.match(value) and float(re.sub(r"\D+$", "", value)):
        return value
    raise RetrievalError(f"{variable} is {value!r}: give a size such as {example}.")


def seed_script(src: str, revision: str, marker: str = MARKER, dest: str = MODELS_MOUNT) -> str:
    """The init container's script (busybox ``sh``): nothing to do when the marker holds
    ``revision``; else empty the volume, copy the tree file by file with a bare ``sync``
    after each, and write the marker last (flushed, then renamed)."""
    return f"""\
set -eu
set -o pipefail
src='{src}'
dest='{dest}'
revision='{revision}'
marker="$dest/{marker}"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$revision" ]; then
  echo "the model volume holds revision $revision"
  exit 0
fi
rm -f "$marker"
for entry in "$dest"/* "$dest"/.[!.]* "$dest"/..?*; do
  if [ -e "$entry" ]; then rm -rf "$entry"; fi
done
cd "$src"
find . -type d | while IFS= read -r dir; do mkdir -p "$dest/$dir"; done
find . -type f | while IFS= read -r file; do
  cp "$file" "$dest/$file"
  sync
done
printf '%s\\n' "$revision" > "$marker.tmp"
sync
mv "$marker.tmp" "$marker"
sync
echo "seeded revision $revision from $src"
"""


def _labels(p: Mapping[str, Any], component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": p["name"],
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "cardshare",
        "app.kubernetes.io/managed-by": "cardshare.gpuhost",
    }


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _server(p: Mapping[str, Any], claim: bool) -> dict[str, Any]:
    """OVMS: the role's command line, the REST port, the model volume read-only, the
    computed memory cap, one model on startup, the other on readiness, the server on
    liveness; the claim's use when ``claim``."""
    limit = str(p["memory_limit_bytes"])
    resources: dict[str, Any] = {"limits": {"memory": limit}, "requests": {"memory": limit}}
    if claim:
        resources["claims"] = [{"name": CLAIM_NAME}]
    return {
        "name": "ovms",
        "image": p["image"],
        "args": [str(a) for a in p["command"]],
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}],
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}],
        "resources": resources,
        "startupProbe": _probe(
            f"/v2/models/{p['embedding_model']}/ready", 10, max(1, -(-p["startup_seconds"] // 10))
        ),
        "readinessProbe": _probe(f"/v2/models/{p['rerank_model']}/ready", 10, 3),
        "livenessProbe": _probe("/v2/health/live", 20, 3),
        "securityContext": _container_security(),
    }


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_security(render_gid: int | None = None) -> dict[str, Any]:
    """OVMS's user and group; with ``render_gid`` the node's render group as a supplemental
    group, so the server can open a render node that is ``0660 root:render``. ``fsGroup``
    does not do that: the kubelet applies it to volumes, while a device node the runtime
    creates from the claim's CDI spec keeps the host node's owner, group and mode."""
    security: dict[str, Any] = {
        "runAsUser": OVMS_UID,
        "runAsGroup": OVMS_UID,
        "fsGroup": OVMS_UID,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if render_gid is not None:
        security["supplementalGroups"] = [render_gid]
    return security


def _seeder(p: Mapping[str, Any], tree: str) -> dict[str, Any]:
    """The init container: the model image's shell copies ``tree`` into the volume. No
    claim: it needs no device, and holding one would keep it from other claimants."""
    limit = p["seed_memory_limit"]
    return {
        "name": "seed-models",
        "image": p["model_image"],
        "command": ["sh", "-c", seed_script(f"{p['model_image_path']}/{tree}", p["revision"])],
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT}],
        "resources": {"limits": {"memory": limit}, "requests": {"memory": limit}},
        "securityContext": _container_security(),
    }


def _checked(params: Mapping[str, Any]) -> dict[str, Any]:
    p = dict(params)
    _need(p.get("name"), _DNS_LABEL, "retrieval_k8s_name", "a DNS label such as 'ovms-retrieval'")
    _need(
        p.get("namespace"), _DNS_LABEL, "retrieval_k8s_namespace", "a namespace such as 'retrieval'"
    )
    _need(
        p.get("device_class"),
        _DNS_SUBDOMAIN,
        "retrieval_k8s_device_class",
        "the DeviceClass of Intel's DRA driver, such as 'gpu.intel.com'",
    )
    _need(
        p.get("image"),
        _IMAGE,
        "retrieval_image",
        "a pinned image such as 'openvino/model_server:2026.2.1-gpu'",
    )
    _need(
        p.get("model_image"),
        _IMAGE,
        "retrieval_k8s_model_image",
        "the pinned model image holding the export (gpu/ and cpu/ trees), such as "
        "'registry.example/ovms-retrieval-models:2026.2.1-r3'",
    )
    if isinstance(p.get("model_image"), str) and re.search(r":latest$", p["model_image"]):
        raise RetrievalError(
            f"retrieval_k8s_model_image is {p['model_image']!r}: 'latest' moves; pin a tag or a "
            "digest (the seed marker holds the revision, not the tag)."
        )
    _need(
        p.get("model_image_path"),
        _PATH,
        "retrieval_k8s_model_image_path",
        "an absolute path such as '/models-src'",
    )
    _need(
        p.get("revision"),
        _REVISION,
        "retrieval_repository_revision",
        "the export's revision such as '2026.2.1-r3'",
    )
    for key in ("embedding_model", "rerank_model"):
        _need(
            p.get(key),
            _MODEL,
            f"retrieval_{key}",
            "the servable's name in the export's config.json",
        )
    p["seed_memory_limit"] = _quantity(
        p.get("seed_memory_limit"), "retrieval_k8s_seed_memory_limit", "'2Gi'"
    )
    p["storage_size"] = _quantity(p.get("storage_size"), "retrieval_k8s_storage_size", "'8Gi'")
    limit = p.get("memory_limit_bytes")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise RetrievalError(
            f"the memory plan's memory_limit_bytes is {limit!r}: a positive number of bytes"
        )
    seconds = p.get("startup_seconds", 600)
    if not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < 10:
        raise RetrievalError(
            f"retrieval_k8s_startup_seconds is {seconds!r}: give at least 10 (the first boot "
            "compiles the models for the GPU: allow minutes, such as 600)."
        )
    p["startup_seconds"] = seconds
    command = p.get("command")
    if not isinstance(command, Sequence) or isinstance(command, str) or not command:
        raise RetrievalError(f"the server's command is {command!r}: a list of arguments")
    extra = p.get("claim_request") or {}
    if not isinstance(extra, Mapping):
        raise RetrievalError(
            f"retrieval_k8s_claim_request is {extra!r}: a mapping of fields of the device "
            "request's 'exactly' block (such as tolerations), or {}."
        )
    problems = claim_problems(extra)
    if problems:
        raise RetrievalError(" ".join(problems))
    for key in ("deviceClassName", "allocationMode", "count"):
        if key in extra:
            raise RetrievalError(
                f"retrieval_k8s_claim_request.{key} is {extra[key]!r}: the role sets it (exactly "
                "one device of retrieval_k8s_device_class); remove it."
            )
    selectors = extra.get("selectors", [])
    if not isinstance(selectors, list):
        raise RetrievalError(
            f"retrieval_k8s_claim_request.selectors is {selectors!r}: a list of selectors "
            "such as [{cel: {expression: ...}}]."
        )
    pin = bus_id_selector(p.get("device", "igpu"), p.get("pci_bus_id", "auto"))
    p["claim_request"] = {**extra, **({"selectors": [*selectors, pin]} if pin else {})}
    gid = p.get("render_gid")
    if gid is not None and (
        not isinstance(gid, int) or isinstance(gid, bool) or not 0 < gid < 2**31
    ):
        raise RetrievalError(
            f"retrieval_k8s_render_gid is {gid!r}: give the numeric id of the group owning the "
            "node's /dev/dri/renderD* (stat -c %g /dev/dri/renderD128 on the node), or null."
        )
    node = p.get("node_name")
    if node is not None:
        _need(node, _DNS_SUBDOMAIN, "the node's name", "a node name")
    storage_class = p.get("storage_class")
    if storage_class is not None:
        _need(
            storage_class,
            _DNS_SUBDOMAIN,
            "retrieval_k8s_storage_class",
            "a StorageClass name, or null",
        )
    return p


def k8s_manifests(params: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The tier's manifests by file: ``retrieval`` (the namespace, the claim template, the
    model volume, the Deployment, the Service), ``cpu_arm`` (the control arm's pod) and
    ``negative_control`` (the server's pod spec without the claim, listing /dev/dri).

    ``params``: name, namespace, device_class, claim_request (more fields of the request's
    ``exactly`` block), device and pci_bus_id (the pin, :func:`bus_id_selector`), render_gid
    (the node's render group, a supplemental group of the server and the negative control;
    None for none), image, command, model_image, model_image_path, revision,
    embedding_model, rerank_model, memory_limit_bytes (the shared memory plan's),
    seed_memory_limit, storage_size, storage_class, startup_seconds, node_name (for the
    pods that must run beside the server: None renders them unpinned)."""
    p = _checked(params)
    name, namespace = p["name"], p["namespace"]
    meta = {"namespace": namespace}
    template_name = f"{name}-{CLAIM_NAME}"
    server_labels = _labels(p, "server")
    claim_template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name, **meta, "labels": server_labels},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": CLAIM_NAME,
                            "exactly": {
                                **p["claim_request"],
                                "deviceClassName": p["device_class"],
                                "allocationMode": "ExactCount",
                                "count": 1,
                            },
                        }
                    ]
                }
            }
        },
    }
    volume_claim: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{name}-models", **meta, "labels": server_labels},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": p["storage_size"]}},
        },
    }
    if p.get("storage_class") is not None:
        volume_claim["spec"]["storageClassName"] = p["storage_class"]
    pod_spec = {
        "securityContext": _pod_security(p.get("render_gid")),
        "resourceClaims": [{"name": CLAIM_NAME, "resourceClaimTemplateName": template_name}],
        "initContainers": [_seeder(p, "gpu")],
        "containers": [_server(p, claim=True)],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": f"{name}-models"}}],
        "terminationGracePeriodSeconds": 30,
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            **meta,
            "labels": server_labels,
            "annotations": {"cardshare.io/revision": p["revision"]},
        },
        "spec": {
            "replicas": 1,
            # one device and one RWO volume: a surge pod would wait for both forever
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": server_labels},
            "template": {
                "metadata": {
                    "labels": server_labels,
                    "annotations": {"cardshare.io/revision": p["revision"]},
                },
                "spec": pod_spec,
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, **meta, "labels": server_labels},
        "spec": {
            "type": "ClusterIP",
            "selector": server_labels,
            "ports": [
                {"name": "http", "port": CONTAINER_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    namespace_doc = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": namespace, "labels": {"app.kubernetes.io/part-of": "cardshare"}},
    }
    pinned = {"nodeName": p["node_name"]} if p.get("node_name") else {}
    cpu_arm = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-cpu-arm", **meta, "labels": _labels(p, "cpu-arm")},
        "spec": {
            **pinned,
            "restartPolicy": "Never",
            "securityContext": _pod_security(),
            "initContainers": [_seeder(p, "cpu")],
            "containers": [_server(p, claim=False)],
            "volumes": [{"name": "models", "emptyDir": {"sizeLimit": p["storage_size"]}}],
        },
    }
    control_container = {
        "name": "ovms",
        "image": p["image"],
        "command": ["sh", "-c", "ls -ln /dev/dri"],
        "resources": {"limits": {"memory": "64Mi"}, "requests": {"memory": "64Mi"}},
        "securityContext": _container_security(),
    }
    negative_control = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-negative-control",
            **meta,
            "labels": _labels(p, "negative-control"),
        },
        "spec": {
            **pinned,
            "restartPolicy": "Never",
            "securityContext": _pod_security(p.get("render_gid")),
            "containers": [control_container],
        },
    }
    return {
        "retrieval": [namespace_doc, claim_template, volume_claim, deployment, service],
        "cpu_arm": [cpu_arm],
        "negative_control": [negative_control],
    }


# --------------------------------------------------------------------------- the wait

# container waiting reasons no wait ends by itself: the kubelet backs off and retries the
# same thing (an image it cannot pull, a config it cannot build, a process that keeps dying)
_STUCK = frozenset(
    {
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CrashLoopBackOff",
        "RunContainerError",
    }
)


def _container_text(status: Mapping[str, Any]) -> str:
    state = status.get("state") or {}
    last = (status.get("lastState") or {}).get("terminated") or {}
    for kind in ("waiting", "terminated", "running"):
        if kind in state:
            detail = state[kind] or {}
            words = [kind, str(detail.get("reason", ""))]
            if detail.get("exitCode") is not None:
                words.append(f"exit {detail['exitCode']}")
            if detail.get("message"):
                words.append(str(detail["message"]).strip()[:300])
            text = " ".join(w for w in words if w)
            if last:
                text += (
                    f"; last ended {last.get('reason', '')} exit {last.get('exitCode', '?')}"
                    + (f": {str(last['message']).strip()[:300]}" if last.get("message") else "")
                )
            return f"{status.get('name', '?')}: {text} (restarts {status.get('restartCount', 0)})"
    return f"{status.get('name', '?')}: no state yet"


def k8s_pod_verdict(pods: object, container: str = "ovms") -> dict[str, Any]:
    """Where the server's pod is, from ``k8s_info``'s ``resources``: ``state`` is ``waiting``
    (no pod yet, still scheduled or pulled or seeded, or an old pod still going), ``started``
    (the server's container runs), ``ready`` (the pod is Ready) or ``failed`` (the pod
    failed, or a container is stuck where the kubelet only backs off: an image it cannot pull,
    a crash loop, a config it cannot build); ``pod`` and ``node`` name it, ``text`` says why
    in the kubelet's words (a Pending pod's scheduling condition included: a claim no device
    satisfies reads ``cannot allocate all claims`` there)."""
    if not isinstance(pods, list):
        raise RetrievalError(f"the server's pods: expected k8s_info's resources, got {pods!r}")
    live = [
        p
        for p in pods
        if isinstance(p, Mapping) and not p.get("metadata", {}).get("deletionTimestamp")
    ]
    verdict: dict[str, Any] = {"state": "waiting", "pod": None, "node": None, "text": ""}
    if not live:
        going = len(pods)
        verdict["text"] = "no pod of the server yet" + (
            f" ({going} old one(s) still terminating)" if going else ""
        )
        return verdict
    if len(live) > 1:
        names = ", ".join(str(p.get("metadata", {}).get("name")) for p in live)
        verdict["text"] = f"{len(live)} pods of the server ({names}): a rollout is under way"
        return verdict
    pod = live[0]
    status = pod.get("status") or {}
    verdict["pod"] = pod.get("metadata", {}).get("name")
    verdict["node"] = (pod.get("spec") or {}).get("nodeName")
    phase = status.get("phase", "Pending")
    conditions = {
        c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, Mapping)
    }
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    texts = [_container_text(c) for c in statuses if isinstance(c, Mapping)]
    scheduled = conditions.get("PodScheduled", {})
    head = f"pod {verdict['pod']} {phase}"
    if scheduled.get("status") == "False":
        head += f", not scheduled ({scheduled.get('reason', '')}: {scheduled.get('message', '')})"
    verdict["text"] = "; ".join([head, *texts])
    stuck = [
        c
        for c in statuses
        if isinstance(c, Mapping)
        and ((c.get("state") or {}).get("waiting") or {}).get("reason") in _STUCK
    ]
    if phase == "Failed" or stuck:
        verdict["state"] = "failed"
    elif conditions.get("Ready", {}).get("status") == "True":
        verdict["state"] = "ready"
    elif any(
        isinstance(c, Mapping)
        and c.get("name") == container
        and "running" in (c.get("state") or {})
        for c in status.get("containerStatuses") or []
    ):
        verdict["state"] = "started"
    return verdict


_STATUS_LINE = re.compile(r"^HTTP/1\.[01] (\d{3})[^\r\n]*\r?\n")


def k8s_reply_states(reply: object, models: object) -> dict[str, Any]:
    """The servables' states from a raw HTTP answer to ``GET /v1/config`` read inside the pod
    (``k8s_exec``'s stdout), with ``settled``: true when every model is served or one has
    failed for good (waiting longer changes nothing). No answer yet (the REST port opens after
    the models load), another status or a body that is not JSON is unsettled, with the reason
    in ``text``."""
    if not isinstance(models, list):
        raise RetrievalError(f"models: expected a list of servable names, got {models!r}")
    text = reply if isinstance(reply, str) else ""
    unsettled = {
        "available": [],
        "unavailable": list(models),
        "failed": [],
        "servables": {},
        "settled": False,
    }
    match = _STATUS_LINE.match(text)
    if match is None:
        return {**unsettled, "text": f"/v1/config did not answer yet ({text.strip()[:200]!r})"}
    if match.group(1) != "200":
        return {**unsettled, "text": f"/v1/config answered {text.strip()[:300]!r}"}
    body = re.split(r"\r?\n\r?\n", text, maxsplit=1)[1] if re.search(r"\r?\n\r?\n", text) else ""
    try:
        states = retrieval_servable_states(body, models)
    except RetrievalError as err:
        return {**unsettled, "text": str(err)}
    settled = not states["unavailable"] or bool(states["failed"])
    return {**states, "settled": settled}
