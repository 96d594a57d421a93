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
  with no event. :func:`claim_problems` refuses both spellings, keys and the strings inside
  expressions alike.
* The pod references the template twice: ``spec.resourceClaims`` allocates, the container's
  ``resources.claims`` grants use. Either alone is a bug.
* An init container seeds the model volume from the model image (busybox) by the marker
  rule: a revision marker written last, so an interrupted seed runs again and a new revision
  replaces the tree; a per-file copy with a bare ``sync`` after each file, which bounds the
  dirty pages charged to the container's cgroup to one file (busybox's ``sync`` takes no
  file operand). It holds no claim: copying files needs no device.
* Startup waits on one model's readiness (the first boot compiles for the iGPU: minutes),
  readiness asks the other model, liveness the server; a ClusterIP Service only.
* A CPU control arm (same image, the export's ``cpu/`` tree, no claim) for a benchmark, and
  a negative control (the server's pod spec without the claim, listing ``/dev/dri``): a
  device that shows up without the claim was injected by something else (CDI discovery),
  and the claim would prove nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval import RetrievalError

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
# the words of a claim that filter on memory: a capacity request, or a CEL expression
# reading a device's capacity or a memory attribute
_MEMORY_WORDS = re.compile(r"capacity|memory", re.IGNORECASE)


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


def claim_problems(value: object, variable: str = "retrieval_k8s_claim_request") -> list[str]:
    """What in a device request (or a whole claim template) filters on memory: a key named
    ``capacity`` anywhere, or any string value (a CEL expression above all) that speaks of
    capacity or memory. Each problem names where it is and what it says."""
    problems: list[str] = []
    for path, key, item in _walk(value, variable):
        if key is not None and key.lower() == "capacity":
            problems.append(
                f"{path} asks for capacity ({item!r}): an integrated GPU publishes memory "
                '"0", so the claim can never be satisfied and the pod stays Pending with no '
                "event. Remove it: the claim asks for one device, not for its memory."
            )
        elif isinstance(item, str) and _MEMORY_WORDS.search(item):
            problems.append(
                f"{path} is {item!r}, which selects on the device's memory or capacity: an "
                'integrated GPU publishes memory "0", so no device matches and the pod stays '
                "Pending with no event. Remove the selector."
            )
    return problems


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


def _pod_security() -> dict[str, Any]:
    return {
        "runAsUser": OVMS_UID,
        "runAsGroup": OVMS_UID,
        "fsGroup": OVMS_UID,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


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
    p["claim_request"] = dict(extra)
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
    ``exactly`` block), image, command, model_image, model_image_path, revision,
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
        "securityContext": _pod_security(),
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
            "securityContext": _pod_security(),
            "containers": [control_container],
        },
    }
    return {
        "retrieval": [namespace_doc, claim_template, volume_claim, deployment, service],
        "cpu_arm": [cpu_arm],
        "negative_control": [negative_control],
    }
