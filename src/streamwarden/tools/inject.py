"""Adding the streamwarden sidecar to Kubernetes pods, by annotation.

The one rewrite behind ``streamwarden inject`` (manifests in, manifests out)
and ``streamwarden webhook`` (a pod in, a JSON patch out): sans-I/O, plain
dicts as PyYAML or ``json`` read them. A pod template annotated
``streamwarden.io/inject: enabled`` (or any, with ``all_pods``) gets the
sidecar as the Helm chart's named templates render it: a native sidecar (an
init container with ``restartPolicy: Always``, started before the app and
stopped after it) or a regular container, its two ports, probes on the admin
port, a non-root read-only security context, resource requests, a preStop
pause, and a grace period that outlasts the pause plus ``drain_timeout``. In
``egress`` mode the app's provider base-URL variables point at the sidecar.
Nothing else changes, and key order is kept (new keys come last). A template
it will not touch gets ``streamwarden.io/inject-skipped: <why>``; one that
already has the sidecar is left exactly as it is, so injecting twice equals
injecting once.

Divergences from the chart, on purpose: the preStop pause is always
``exec: sleep`` (the ``sleep`` action needs Kubernetes 1.30, native sidecars
only 1.29, and the rewrite cannot see the cluster's version); and the
listeners, upstream and ``drain_timeout`` are flags of ``streamwarden run``,
so that they win over any ConfigMap (the probes and the grace period are
computed from them and must be right).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from streamwarden import __version__
from streamwarden.config import parse_duration

__all__ = [
    "ANNOTATION_PREFIX",
    "DEFAULT_BASE_URL_ENV",
    "DEFAULT_IMAGE",
    "SIDECAR_NAME",
    "SKIPPED",
    "BaseUrlEnv",
    "InjectOptions",
    "ManifestError",
    "Outcome",
    "inject_documents",
    "inject_object",
    "json_patch",
    "parse_base_url_env",
    "pod_patch",
]

ANNOTATION_PREFIX = "streamwarden.io/"
#: ``enabled`` asks for the sidecar; ``disabled`` refuses it even with ``--all``.
INJECT = ANNOTATION_PREFIX + "inject"
#: Why a pod template was not injected (written by the rewrite, never read).
SKIPPED = ANNOTATION_PREFIX + "inject-skipped"
MODE = ANNOTATION_PREFIX + "mode"
UPSTREAM = ANNOTATION_PREFIX + "upstream"
UPSTREAM_PORT = ANNOTATION_PREFIX + "upstream-port"
CONFIG = ANNOTATION_PREFIX + "config"
LISTEN_PORT = ANNOTATION_PREFIX + "listen-port"
ADMIN_PORT = ANNOTATION_PREFIX + "admin-port"
DRAIN_TIMEOUT = ANNOTATION_PREFIX + "drain-timeout"
BASE_URL_ENV = ANNOTATION_PREFIX + "base-url-env"
IMAGE = ANNOTATION_PREFIX + "image"

SIDECAR_NAME = "streamwarden"
CONFIG_VOLUME = "streamwarden-config"
TMP_VOLUME = "streamwarden-tmp"
CONFIG_DIR = "/etc/streamwarden"
DEFAULT_IMAGE = f"ghcr.io/streamwarden/streamwarden:{__version__}"
DEFAULT_LISTEN_PORT = 8080
DEFAULT_ADMIN_PORT = 9090
DEFAULT_DRAIN_TIMEOUT = "25s"
#: Kubernetes' own default when a pod spec names none.
KUBERNETES_DEFAULT_GRACE = 30
#: The sidecar's preStop pause: endpoints and load balancers stop sending new
#: connections before SIGTERM closes its listener (the chart's default).
PRE_STOP_SECONDS = 5
#: After the drain, a moment to write the ``shutting_down`` events and exit.
EXIT_MARGIN_SECONDS = 5

# The chart's values.yaml defaults, kept the same (tests/tools/test_inject.py
# compares the injected container with the chart's rendering).
RESOURCES: dict[str, Any] = {
    # No CPU limit on purpose: CFS throttling delays every token in flight.
    "requests": {"cpu": "50m", "memory": "64Mi"},
    "limits": {"memory": "256Mi"},
}
SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
PROBE_TIMINGS: dict[str, tuple[str, dict[str, int]]] = {
    # Until it answers; a native sidecar holds the app's start until then.
    "startupProbe": ("/healthz", {"periodSeconds": 1, "timeoutSeconds": 2, "failureThreshold": 30}),
    # 503 while draining: the pod leaves the Service's endpoints.
    "readinessProbe": ("/readyz", {"periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 2}),
    "livenessProbe": (
        "/healthz",
        {"periodSeconds": 10, "timeoutSeconds": 2, "failureThreshold": 3},
    ),
}

#: Where each kind keeps its pod template.
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}

Mode = Literal["front", "egress"]


class ManifestError(ValueError):
    """A document that is not a Kubernetes object of the shape its kind requires."""


@dataclass(frozen=True, slots=True)
class BaseUrlEnv:
    """An app variable pointed at the sidecar in egress mode, with the path its SDK expects."""

    #: The variable's name, e.g. ``OPENAI_BASE_URL``.
    name: str
    #: Appended to ``http://127.0.0.1:<port>``: the OpenAI SDK wants ``/v1``, Anthropic's none.
    path: str = ""


#: The OpenAI SDK's base URL includes /v1; the Anthropic SDK adds /v1 itself.
DEFAULT_BASE_URL_ENV = (BaseUrlEnv("OPENAI_BASE_URL", "/v1"), BaseUrlEnv("ANTHROPIC_BASE_URL"))

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_base_url_env(text: str) -> tuple[BaseUrlEnv, ...]:
    """``OPENAI_BASE_URL=/v1,ANTHROPIC_BASE_URL`` as variables; ``ValueError`` names a bad one."""
    found: list[BaseUrlEnv] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, path = item.partition("=")
        if not _ENV_NAME.match(name) or (path and not path.startswith("/")):
            raise ValueError(f"{item!r} is not NAME or NAME=/path")
        found.append(BaseUrlEnv(name, path))
    if not found:
        raise ValueError("no variable named")
    return tuple(found)


@dataclass(frozen=True, slots=True)
class InjectOptions:
    """What the command line (or the webhook's) decides for every pod."""

    #: Inject every pod template not annotated ``streamwarden.io/inject: disabled``.
    all_pods: bool = False
    #: A native sidecar (Kubernetes >= 1.29); else a regular container next to the app.
    native: bool = True
    #: The sidecar's image, unless a pod's ``streamwarden.io/image`` names another.
    image: str = DEFAULT_IMAGE
    #: Egress mode's variables, unless a pod's ``streamwarden.io/base-url-env`` names others.
    base_url_env: tuple[BaseUrlEnv, ...] = DEFAULT_BASE_URL_ENV


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one pod template."""

    #: ``deployment/chat-api``, ``cronjob/nightly``; a pod without a name: ``pod``.
    where: str
    #: ``injected``; ``skipped`` (the template now carries the reason);
    #: ``untouched`` (not asked for, or already injected: nothing written).
    status: Literal["injected", "skipped", "untouched"]
    #: Why it was skipped or left untouched ("" when injected).
    reason: str = ""

    def line(self) -> str:
        """One line for a person: ``deployment/chat-api: skipped: hostNetwork ...``."""
        return f"{self.where}: {self.status}" + (f": {self.reason}" if self.reason else "")


class _Skip(Exception):
    """A candidate the rewrite will not touch; the message is the reason."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """The sidecar decided for one pod from its annotations and the options."""

    mode: Mode
    upstream: str
    listen_port: int
    admin_port: int
    drain_timeout: str
    drain_seconds: int
    config_map: str | None
    image: str
    base_url_env: tuple[BaseUrlEnv, ...] = field(default=())


# -- documents and objects -------------------------------------------------------


def inject_documents(
    documents: Sequence[Any], options: InjectOptions
) -> tuple[list[Any], list[Outcome]]:
    """Every document rewritten (copies); ``None`` documents (empty ``---``) are dropped."""
    results: list[Any] = []
    outcomes: list[Outcome] = []
    for index, document in enumerate(documents):
        if document is None:
            continue
        try:
            result, found = inject_object(document, options)
        except ManifestError as exc:
            raise ManifestError(f"document {index + 1}: {exc}") from None
        results.append(result)
        outcomes.extend(found)
    return results, outcomes


def inject_object(obj: Any, options: InjectOptions) -> tuple[dict[str, Any], list[Outcome]]:
    """One object rewritten (a copy); kinds without a pod template come back unchanged."""
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise ManifestError("not a Kubernetes object (a mapping with apiVersion and kind)")
    if not isinstance(obj.get("apiVersion"), str):
        raise ManifestError(f"{obj['kind']}: no apiVersion")
    result = copy.deepcopy(obj)
    return result, list(_inject_in_place(result, options))


def _inject_in_place(obj: dict[str, Any], options: InjectOptions) -> Iterator[Outcome]:
    kind: str = obj["kind"]
    if kind == "List" or (kind.endswith("List") and "items" in obj):
        items = obj.get("items")
        if not isinstance(items, list):
            raise ManifestError(f"{kind}: items is not a list")
        for index, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("kind"), str):
                raise ManifestError(f"{kind}: item {index + 1} is not a Kubernetes object")
            yield from _inject_in_place(item, options)
        return
    path = TEMPLATE_PATHS.get(kind)
    if path is None:
        return  # a Service, a ConfigMap...: no pod to inject into
    where = _where(obj)
    template: Any = obj
    for key in path:
        template = template.get(key) if isinstance(template, dict) else None
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        raise ManifestError(f"{where}: no pod template at {'.'.join(path) or 'spec'}")
    yield _inject_template(template, where, options)


def _where(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    kind = str(obj["kind"]).lower()
    if not name and isinstance(metadata, dict) and metadata.get("generateName"):
        name = f"{metadata['generateName']}*"
    return f"{kind}/{name}" if name else kind


# -- one pod template ------------------------------------------------------------


def _inject_template(template: dict[str, Any], where: str, options: InjectOptions) -> Outcome:
    """Rewrite ``template`` (a pod or a pod template: metadata + spec) in place."""
    spec: dict[str, Any] = template["spec"]
    _check_shape(spec, where)
    containers: list[dict[str, Any]] = spec["containers"]
    init_containers: list[dict[str, Any]] = spec.get("initContainers") or []
    metadata = template.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ManifestError(f"{where}: metadata is not a mapping")
    annotations = metadata.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise ManifestError(f"{where}: metadata.annotations is not a mapping")

    if any(c["name"] == SIDECAR_NAME for c in [*containers, *init_containers]):
        return Outcome(where, "untouched", "already injected")
    asked = str(annotations.get(INJECT, "")).strip()
    if asked == "disabled":
        return Outcome(where, "untouched", f"{INJECT}: disabled")
    if asked != "enabled" and not options.all_pods:
        if asked:
            reason = f"{INJECT}: {asked!r} is neither enabled nor disabled"
            _annotate(template, SKIPPED, reason)
            return Outcome(where, "skipped", reason)
        return Outcome(where, "untouched", f"not annotated {INJECT}: enabled")
    try:
        plan = _plan(annotations, spec, options)
        _check_pod(spec, plan, options)
    except _Skip as exc:
        _annotate(template, SKIPPED, str(exc))
        return Outcome(where, "skipped", str(exc))
    _add_sidecar(spec, plan, options)
    if SKIPPED in annotations:
        # A template skipped before and fixed since: the old reason is no longer true.
        del template["metadata"]["annotations"][SKIPPED]
    return Outcome(where, "injected")


def _check_shape(spec: Mapping[str, Any], where: str) -> None:
    """The parts of a pod spec the rewrite reads or extends have the types Kubernetes gives."""
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise ManifestError(f"{where}: spec.containers is not a non-empty list")
    for key in ("initContainers", "volumes"):
        if not isinstance(spec.get(key) or [], list):
            raise ManifestError(f"{where}: spec.{key} is not a list")
    for container in [*containers, *(spec.get("initContainers") or [])]:
        if not isinstance(container, dict) or not isinstance(container.get("name"), str):
            raise ManifestError(f"{where}: a container without a name")
        for key in ("ports", "env"):
            if not isinstance(container.get(key) or [], list):
                raise ManifestError(
                    f"{where}: {key} of container {container['name']} is not a list"
                )
        if not isinstance(container.get("lifecycle") or {}, dict):
            raise ManifestError(
                f"{where}: lifecycle of container {container['name']} is not a mapping"
            )


def _annotate(template: dict[str, Any], key: str, value: str) -> None:
    metadata = template.get("metadata")
    if not isinstance(metadata, dict):
        metadata = template["metadata"] = {}
    if not isinstance(metadata.get("annotations"), dict):
        metadata["annotations"] = {}
    metadata["annotations"][key] = value


def _port(annotations: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = annotations.get(key)
    if value is None:
        return default
    text = str(value).strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _Skip(f"{key}: {value!r} is not a port (1-65535)")
    return int(text)


def _plan(annotations: Mapping[str, Any], spec: Mapping[str, Any], options: InjectOptions) -> _Plan:
    mode = str(annotations.get(MODE, "front")).strip()
    if mode not in ("front", "egress"):
        raise _Skip(f"{MODE}: {mode!r} is neither front nor egress")
    listen_port = _port(annotations, LISTEN_PORT, DEFAULT_LISTEN_PORT)
    admin_port = _port(annotations, ADMIN_PORT, DEFAULT_ADMIN_PORT)
    assert listen_port is not None and admin_port is not None
    if listen_port == admin_port:
        raise _Skip(f"{LISTEN_PORT} and {ADMIN_PORT} are the same port {listen_port}")
    drain_timeout = str(annotations.get(DRAIN_TIMEOUT, DEFAULT_DRAIN_TIMEOUT)).strip()
    try:
        drain_seconds = math.ceil(parse_duration(drain_timeout))
    except ValueError:
        raise _Skip(f"{DRAIN_TIMEOUT}: {drain_timeout!r} is not a duration (25s, 2m)") from None
    upstream = str(annotations.get(UPSTREAM, "")).strip()
    if upstream and not re.match(r"^(https?://[^/\s]+/?|unix:/\S+)$", upstream):
        raise _Skip(f"{UPSTREAM}: {upstream!r} is not http(s)://host:port or unix:/path.sock")
    if mode == "egress" and not upstream:
        raise _Skip(f"{MODE}: egress needs {UPSTREAM}, the provider (https://api.openai.com)")
    if mode == "front" and not upstream:
        port = _port(annotations, UPSTREAM_PORT, None) or _first_container_port(spec)
        if port is None:
            raise _Skip(f"front mode needs {UPSTREAM_PORT}: the app's container has no port")
        if port in (listen_port, admin_port):
            raise _Skip(f"the app's port {port} is also a port of the sidecar; set {LISTEN_PORT}")
        upstream = f"http://127.0.0.1:{port}"
    config_map = annotations.get(CONFIG)
    if config_map is not None and not re.match(
        r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", str(config_map)
    ):
        raise _Skip(f"{CONFIG}: {config_map!r} is not a ConfigMap name")
    base_url_env = options.base_url_env
    if BASE_URL_ENV in annotations:
        try:
            base_url_env = parse_base_url_env(str(annotations[BASE_URL_ENV]))
        except ValueError as exc:
            raise _Skip(f"{BASE_URL_ENV}: {exc}") from None
    return _Plan(
        mode=mode,  # type: ignore[arg-type]  # checked above
        upstream=upstream.rstrip("/"),
        listen_port=listen_port,
        admin_port=admin_port,
        drain_timeout=drain_timeout,
        drain_seconds=drain_seconds,
        config_map=None if config_map is None else str(config_map),
        image=str(annotations.get(IMAGE) or options.image),
        base_url_env=base_url_env if mode == "egress" else (),
    )


def _first_container_port(spec: Mapping[str, Any]) -> int | None:
    for port in spec["containers"][0].get("ports") or []:
        if isinstance(port, dict) and isinstance(port.get("containerPort"), int):
            return int(port["containerPort"])
    return None


def _check_pod(spec: Mapping[str, Any], plan: _Plan, options: InjectOptions) -> None:
    """The pods the sidecar cannot join safely, each with the reason."""
    if spec.get("hostNetwork") is True:
        raise _Skip("hostNetwork: the sidecar's ports would be taken on the node itself")
    if not options.native and spec.get("restartPolicy") in ("Never", "OnFailure"):
        raise _Skip(
            "a regular sidecar container never exits, so the pod would never complete; "
            "inject a native sidecar (without --no-native)"
        )
    ours = {plan.listen_port, plan.admin_port}
    for container in [*spec["containers"], *(spec.get("initContainers") or [])]:
        for port in container.get("ports") or []:
            if isinstance(port, dict) and port.get("containerPort") in ours:
                raise _Skip(
                    f"container {container['name']} already uses port {port['containerPort']}; "
                    f"set {LISTEN_PORT} / {ADMIN_PORT}"
                )
    for volume in spec.get("volumes") or []:
        if isinstance(volume, dict) and volume.get("name") in (CONFIG_VOLUME, TMP_VOLUME):
            raise _Skip(f"the pod already has a volume named {volume['name']}")


# -- the sidecar -----------------------------------------------------------------


def _sidecar(plan: _Plan, native: bool) -> dict[str, Any]:
    host = "127.0.0.1" if plan.mode == "egress" else "0.0.0.0"  # the Service's way in
    args = [
        "run",
        "--config",
        f"{CONFIG_DIR}/config.yaml",
        "--listen",
        f"{host}:{plan.listen_port}",
        "--admin-listen",
        f"0.0.0.0:{plan.admin_port}",  # the kubelet probes it from outside
        "--upstream",
        plan.upstream,
        "--set",
        f"drain_timeout={plan.drain_timeout}",
    ]
    if plan.mode == "egress":
        # A provider routes by its own Host name, never the app's 127.0.0.1.
        args += ["--set", "preserve_host=false"]
    container: dict[str, Any] = {"name": SIDECAR_NAME, "image": plan.image}
    container["imagePullPolicy"] = "IfNotPresent"
    if native:
        container["restartPolicy"] = "Always"
    container["command"] = ["streamwarden"]
    container["args"] = args
    container["ports"] = [
        {"name": "sw-proxy", "containerPort": plan.listen_port, "protocol": "TCP"},
        {"name": "sw-admin", "containerPort": plan.admin_port, "protocol": "TCP"},
    ]
    for probe, (path, timings) in PROBE_TIMINGS.items():
        container[probe] = {"httpGet": {"path": path, "port": plan.admin_port}, **timings}
    container["lifecycle"] = {
        "preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}},
    }
    container["resources"] = copy.deepcopy(RESOURCES)
    container["securityContext"] = copy.deepcopy(SECURITY_CONTEXT)
    mounts: list[dict[str, Any]] = []
    if plan.config_map is not None:
        mounts.append({"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True})
    mounts.append({"name": TMP_VOLUME, "mountPath": "/tmp"})  # an emptyDir
    container["volumeMounts"] = mounts
    return container


def _pre_stop_seconds(container: Mapping[str, Any]) -> int:
    """The seconds of a container's preStop pause (``sleep`` action or ``exec: sleep N``)."""
    lifecycle = container.get("lifecycle")
    handler = lifecycle.get("preStop") if isinstance(lifecycle, dict) else None
    if not isinstance(handler, dict):
        return 0
    sleep = handler.get("sleep")
    if isinstance(sleep, dict) and isinstance(sleep.get("seconds"), int):
        return int(sleep["seconds"])
    action = handler.get("exec")
    command = action.get("command") if isinstance(action, dict) else None
    if isinstance(command, list) and len(command) == 2 and command[0] == "sleep":
        text = str(command[1])
        return int(text) if text.isdigit() else 0
    return 0


def _add_sidecar(spec: dict[str, Any], plan: _Plan, options: InjectOptions) -> None:
    apps: list[dict[str, Any]] = spec["containers"]
    sidecar = _sidecar(plan, options.native)
    for app in apps:
        for variable in plan.base_url_env:
            _set_env(app, variable.name, f"http://127.0.0.1:{plan.listen_port}{variable.path}")
    if options.native:
        # First: up before any init container or app that calls through it.
        spec["initContainers"] = [sidecar, *(spec.get("initContainers") or [])]
    else:
        apps.append(sidecar)
    volumes = spec["volumes"] = spec.get("volumes") or []
    if plan.config_map is not None:
        volumes.append({"name": CONFIG_VOLUME, "configMap": {"name": plan.config_map}})
    volumes.append({"name": TMP_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}})
    # A native sidecar stops only after the apps have, so their pauses come first.
    app_pause = max((_pre_stop_seconds(app) for app in apps), default=0) if options.native else 0
    needed = plan.drain_seconds + PRE_STOP_SECONDS + app_pause + EXIT_MARGIN_SECONDS
    grace = spec.get("terminationGracePeriodSeconds")
    if (grace if isinstance(grace, int) else KUBERNETES_DEFAULT_GRACE) < needed:
        spec["terminationGracePeriodSeconds"] = needed


def _set_env(container: dict[str, Any], name: str, value: str) -> None:
    """Point one variable at the sidecar, in place if the container already sets it."""
    env = container["env"] = container.get("env") or []
    for index, item in enumerate(env):
        if isinstance(item, dict) and item.get("name") == name:
            env[index] = {"name": name, "value": value}
            return
    env.append({"name": name, "value": value})


# -- the webhook's view: one pod, one patch ----------------------------------------


def pod_patch(pod: Any, options: InjectOptions) -> tuple[list[dict[str, Any]], Outcome]:
    """The JSON patch (RFC 6902) that makes ``pod`` what :func:`inject_object` makes it."""
    if not isinstance(pod, dict) or pod.get("kind", "Pod") != "Pod":
        raise ManifestError("not a Pod")
    original = {**pod, "kind": "Pod", "apiVersion": pod.get("apiVersion", "v1")}
    result, outcomes = inject_object(original, options)
    return json_patch(original, result), outcomes[0]


def _pointer(path: str, key: str | int) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def json_patch(old: Any, new: Any, path: str = "") -> list[dict[str, Any]]:
    """The operations that turn ``old`` into ``new``: ``add`` (appending to a list that only
    grew at its end), ``replace`` and ``remove`` (only ever an old skip reason)."""
    if isinstance(old, dict) and isinstance(new, dict):
        ops: list[dict[str, Any]] = []
        for key in old:
            if key not in new:
                ops.append({"op": "remove", "path": _pointer(path, key)})
        for key, value in new.items():
            if key not in old:
                ops.append({"op": "add", "path": _pointer(path, key), "value": value})
            else:
                ops.extend(json_patch(old[key], value, _pointer(path, key)))
        return ops
    if isinstance(old, list) and isinstance(new, list):
        if len(old) == len(new):
            pairs = enumerate(zip(old, new, strict=True))
            return [op for i, (a, b) in pairs for op in json_patch(a, b, _pointer(path, i))]
        if new[: len(old)] == old:
            return [{"op": "add", "path": _pointer(path, "-"), "value": v} for v in new[len(old) :]]
    if old == new and type(old) is type(new):
        return []
    return [{"op": "replace", "path": path, "value": new}]
