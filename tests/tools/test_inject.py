"""``streamwarden inject``: the sidecar added to real manifests of every kind.

tests/inject/workloads.yaml holds one workload of each kind the rewrite
handles (Deployment, StatefulSet, DaemonSet, ReplicaSet, Job, CronJob, Pod,
a List) in front and egress mode, plus objects that are not pods. The
rewrite's output is validated strictly and offline against the Kubernetes
1.29 and 1.30 schemas (``kubernetes-validate``), injected again to show it
is idempotent, and compared with its input to show the app's containers
are unchanged but for the documented base-URL variables. The injected
container is compared with the one the Helm chart renders, field by field,
so the two ways to get the sidecar cannot drift apart. The command itself
runs as a process: manifests in, manifests out, exit 2 on bad input.
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from helm_tools import Pod, objects_of, render
from locations import REPO, TESTS
from streamwarden.cli import _parser, _settings_from
from streamwarden.config import parse_duration
from streamwarden.tools.inject import (
    SIDECAR_NAME,
    SKIPPED,
    InjectOptions,
    ManifestError,
    inject_documents,
    inject_object,
)
from streamwarden.tools.mock import MockServer
from waiting import wait_until

WORKLOADS = TESTS / "inject" / "workloads.yaml"
IMAGE_CONFIG = REPO / "configs" / "sidecar-in-front-of-app.yaml"
KUBE_VERSIONS = ["1.29.0", "1.30.0"]
BASE_URL_NAMES = {"OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"}
TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def workloads() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(WORKLOADS.read_text()) if doc]


def objects(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every object, with a List's items in place of the List."""
    for doc in docs:
        if doc["kind"] == "List":
            yield from doc["items"]
        else:
            yield doc


def template_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod template of a workload (the object itself for a Pod)."""
    if obj["kind"] == "Pod":
        return obj
    if obj["kind"] == "CronJob":
        template: dict[str, Any] = obj["spec"]["jobTemplate"]["spec"]["template"]
        return template
    if obj["kind"] in TEMPLATE_KINDS:
        template = obj["spec"]["template"]
        return template
    return None


def pods(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for obj in objects(docs):
        template = template_of(obj)
        if template is not None:
            found.append((f"{obj['kind'].lower()}/{obj['metadata']['name']}", template))
    return found


def sidecar_of(template: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The sidecar container, and whether it is native (an init container)."""
    spec = template["spec"]
    native = [c for c in spec.get("initContainers", []) if c["name"] == SIDECAR_NAME]
    regular = [c for c in spec["containers"] if c["name"] == SIDECAR_NAME]
    assert len(native) + len(regular) == 1, "exactly one sidecar"
    return (native or regular)[0], bool(native)


def annotations_of(template: dict[str, Any]) -> dict[str, str]:
    found: dict[str, str] = template.get("metadata", {}).get("annotations") or {}
    return found


def _kubernetes_validate() -> Any:
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install kubernetes-validate)",
    )


# -- valid Kubernetes, for every kind ------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "regular"])
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_kind_injected_is_valid_kubernetes(native: bool, kube_version: str) -> None:
    validator = _kubernetes_validate()
    injected, outcomes = inject_documents(workloads(), InjectOptions(native=native))
    statuses = {o.where: o.status for o in outcomes}
    expected = "injected" if native else "skipped"  # a Job cannot complete with a regular one
    assert statuses["job/batch-eval"] == statuses["cronjob/nightly-digest"] == expected
    assert sum(s == "injected" for s in statuses.values()) == (8 if native else 6)
    for obj in objects(injected):
        try:
            validator.validate(obj, kube_version, strict=True)
        except validator.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {kube_version}: {path}: {exc}")


def test_the_strict_schema_catches_a_wrong_sidecar_field() -> None:
    # The validation above can fail: a misspelt field in the sidecar is refused.
    validator = _kubernetes_validate()
    injected, _ = inject_documents(workloads(), InjectOptions())
    deployment = copy.deepcopy(injected[0])
    sidecar, _ = sidecar_of(deployment["spec"]["template"])
    sidecar["restartPolicies"] = "Always"
    with pytest.raises(validator.ValidationError):
        validator.validate(deployment, "1.30.0", strict=True)


# -- idempotent, and the app left alone ------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [InjectOptions(), InjectOptions(native=False), InjectOptions(all_pods=True)],
    ids=["native", "regular", "all"],
)
def test_injecting_twice_equals_injecting_once(options: InjectOptions) -> None:
    once, _ = inject_documents(workloads(), options)
    twice, outcomes = inject_documents(once, options)
    assert twice == once
    for outcome in outcomes:
        assert outcome.status != "injected", outcome.line()


def _env_without(container: dict[str, Any], names: set[str]) -> dict[str, Any]:
    stripped = copy.deepcopy(container)
    stripped["env"] = [e for e in stripped.get("env", []) if e["name"] not in names]
    if not stripped["env"]:
        del stripped["env"]
    return stripped


@pytest.mark.parametrize("native", [True, False], ids=["native", "regular"])
def test_the_apps_containers_are_unchanged_but_the_base_url_variables(native: bool) -> None:
    before = dict(pods(workloads()))
    after = dict(pods(inject_documents(workloads(), InjectOptions(native=native))[0]))
    for where, template in after.items():
        original = before[where]
        spec, original_spec = template["spec"], original["spec"]
        apps = [c for c in spec["containers"] if c["name"] != SIDECAR_NAME]
        inits = [c for c in spec.get("initContainers", []) if c["name"] != SIDECAR_NAME]
        assert inits == original_spec.get("initContainers", []), where
        egress = annotations_of(original).get("streamwarden.io/mode") == "egress"
        if not egress:
            assert apps == original_spec["containers"], where
            continue
        for app, old in zip(apps, original_spec["containers"], strict=True):
            assert _env_without(app, BASE_URL_NAMES) == _env_without(old, BASE_URL_NAMES), where
        # Every other key of the pod spec is the same, in the same order (new ones last).
        for key, value in original_spec.items():
            if key not in ("containers", "initContainers", "volumes"):
                assert spec[key] == value, (where, key)
        assert list(spec)[: len(original_spec)] == list(original_spec), where


def test_key_order_and_every_other_key_are_kept() -> None:
    before, after = workloads(), inject_documents(workloads(), InjectOptions())[0]

    def keys_in_order(old: Any, new: Any, path: str) -> None:
        if isinstance(old, dict):
            assert list(new)[: len(old)] == list(old), path
            for key in old:
                keys_in_order(old[key], new[key], f"{path}.{key}")
        elif isinstance(old, list) and len(old) == len(new):
            for index, (a, b) in enumerate(zip(old, new, strict=True)):
                keys_in_order(a, b, f"{path}[{index}]")

    for old, new in zip(before, after, strict=True):
        keys_in_order(old, new, old["kind"])
    # Objects without pods come back as they were.
    assert after[-1] == before[-1] and after[-1]["kind"] == "ConfigMap"
    assert after[-2]["items"][1] == before[-2]["items"][1]


# -- where the sidecar goes, and how it is set up --------------------------------------


def test_native_sidecar_is_the_first_init_container() -> None:
    injected = dict(pods(inject_documents(workloads(), InjectOptions())[0]))
    for where, template in injected.items():
        sidecar, native = sidecar_of(template)
        assert native, where
        assert template["spec"]["initContainers"][0] is sidecar, (
            "before any init container that may call through it"
        )
        assert sidecar["restartPolicy"] == "Always"


def test_no_native_puts_a_regular_container_after_the_apps() -> None:
    injected = dict(pods(inject_documents(workloads(), InjectOptions(native=False))[0]))
    for where, template in injected.items():
        if "inject-skipped" in str(annotations_of(template)):
            continue
        sidecar, native = sidecar_of(template)
        assert not native, where
        assert template["spec"]["containers"][-1] is sidecar
        assert "restartPolicy" not in sidecar


def _run_settings(sidecar: dict[str, Any]) -> Any:
    """The sidecar's arguments read by the real `streamwarden run` parser and config loader,
    with the image's own default config file in place of /etc/streamwarden/config.yaml."""
    args = [str(IMAGE_CONFIG) if a.endswith("config.yaml") else a for a in sidecar["args"]]
    assert sidecar["command"] == ["streamwarden"] and args[0] == "run"
    return _settings_from(_parser().parse_args(args))


def test_front_mode_the_sidecar_listens_for_the_service_and_calls_the_app() -> None:
    injected = dict(pods(inject_documents(workloads(), InjectOptions())[0]))
    cases = {
        "deployment/chat-api": ("0.0.0.0:8080", "0.0.0.0:9090", "http://127.0.0.1:8000"),
        "daemonset/node-agent": ("0.0.0.0:8080", "0.0.0.0:9090", "http://127.0.0.1:7000"),
        "replicaset/summarizer": ("0.0.0.0:18080", "0.0.0.0:19090", "http://127.0.0.1:8080"),
        "pod/playground": ("0.0.0.0:8080", "0.0.0.0:9090", "http://127.0.0.1:3000"),
    }
    for where, (listen, admin, upstream) in cases.items():
        sidecar, _ = sidecar_of(injected[where])
        settings = _run_settings(sidecar)
        assert (settings.listen, settings.admin_listen, settings.upstream) == (
            listen,
            admin,
            upstream,
        ), where
        ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
        assert ports == {
            "sw-proxy": int(listen.rpartition(":")[2]),
            "sw-admin": int(admin.rpartition(":")[2]),
        }
        for probe, path in [
            ("startupProbe", "/healthz"),
            ("readinessProbe", "/readyz"),
            ("livenessProbe", "/healthz"),
        ]:
            assert sidecar[probe]["httpGet"] == {"path": path, "port": ports["sw-admin"]}


def test_egress_mode_points_the_apps_base_urls_at_the_sidecar() -> None:
    original = dict(pods(workloads()))
    injected = dict(pods(inject_documents(workloads(), InjectOptions())[0]))

    agent = injected["statefulset/agent"]
    settings = _run_settings(sidecar_of(agent)[0])
    assert settings.upstream == "https://api.openai.com"
    assert settings.listen == "127.0.0.1:8080", "only the pod's own containers call it"
    assert settings.preserve_host is False, "the provider routes by its own Host"
    for app in agent["spec"]["containers"][:2]:
        env = {e["name"]: e for e in app["env"]}
        assert env["OPENAI_BASE_URL"] == {
            "name": "OPENAI_BASE_URL",
            "value": "http://127.0.0.1:8080/v1",
        }
        assert env["ANTHROPIC_BASE_URL"]["value"] == "http://127.0.0.1:8080"
    # A variable the app set is rewritten where it stood; the others stay put.
    before = [e["name"] for e in original["statefulset/agent"]["spec"]["containers"][0]["env"]]
    after = [e["name"] for e in agent["spec"]["containers"][0]["env"]]
    assert after == [*before, "ANTHROPIC_BASE_URL"]

    # streamwarden.io/base-url-env names the variables: only Anthropic's here.
    job = injected["job/batch-eval"]["spec"]["containers"][0]
    assert job["env"] == [{"name": "ANTHROPIC_BASE_URL", "value": "http://127.0.0.1:8080"}]
    # A variable read from a ConfigMap is replaced by the sidecar's address.
    digest = injected["cronjob/nightly-digest"]["spec"]["containers"][0]
    assert digest["env"][0] == {"name": "OPENAI_BASE_URL", "value": "http://127.0.0.1:8080/v1"}


def test_the_config_annotation_mounts_the_configmap() -> None:
    injected = dict(pods(inject_documents(workloads(), InjectOptions())[0]))
    template = injected["deployment/chat-api"]
    sidecar, _ = sidecar_of(template)
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    assert mounts["/etc/streamwarden"] == {
        "name": "streamwarden-config",
        "mountPath": "/etc/streamwarden",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["streamwarden-config"]["configMap"] == {"name": "chat-api-streamwarden"}
    # Without the annotation the image's own config is used, under the same flags.
    playground, _ = sidecar_of(injected["pod/playground"])
    assert [m["mountPath"] for m in playground["volumeMounts"]] == ["/tmp"]


def test_the_sidecar_is_locked_down() -> None:
    for where, template in pods(inject_documents(workloads(), InjectOptions())[0]):
        sidecar, _ = sidecar_of(template)
        context = sidecar["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] != 0, where
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert set(sidecar["resources"]["requests"]) == {"cpu", "memory"}
        assert "cpu" not in sidecar["resources"]["limits"], "CFS throttling delays tokens"


def test_the_grace_period_outlasts_the_pauses_and_the_drain() -> None:
    original = dict(pods(workloads()))
    for native in (True, False):
        injected = pods(inject_documents(workloads(), InjectOptions(native=native))[0])
        for where, template in injected:
            if SKIPPED in annotations_of(template):
                continue
            spec = template["spec"]
            sidecar, _ = sidecar_of(template)
            drain = parse_duration(_run_settings(sidecar).drain_timeout)
            pause = int(sidecar["lifecycle"]["preStop"]["exec"]["command"][1])
            grace = spec.get("terminationGracePeriodSeconds", 30)
            assert grace > drain + pause, where
            if native:
                # The apps stop first (their own preStop pause), then the sidecar drains.
                app_pause = max(
                    c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
                    for c in spec["containers"]
                )
                assert grace > app_pause + pause + drain, where
            # A longer grace period of the app's own is never shortened.
            assert grace >= original[where]["spec"].get("terminationGracePeriodSeconds", 0)
    chat_api = dict(pods(inject_documents(workloads(), InjectOptions())[0]))["deployment/chat-api"]
    # 60s drain + 5s sidecar pause + 10s app pause + 5s to exit; the app had 45.
    assert chat_api["spec"]["terminationGracePeriodSeconds"] == 80


# -- what it will not touch ----------------------------------------------------------


def _pod(annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "annotations": {"streamwarden.io/inject": "enabled"}},
        "spec": {
            "containers": [{"name": "app", "image": "app:1", "ports": [{"containerPort": 8000}]}],
            **spec,
        },
    }
    pod["metadata"]["annotations"].update(annotations or {})
    return pod


SKIPS: dict[str, tuple[dict[str, Any], InjectOptions, str]] = {
    "host-network": (_pod(hostNetwork=True), InjectOptions(), "hostNetwork"),
    "port-taken": (
        _pod(
            containers=[
                {"name": "app", "image": "a", "ports": [{"containerPort": 8000}]},
                {"name": "exporter", "image": "e", "ports": [{"containerPort": 9090}]},
            ]
        ),
        InjectOptions(),
        "container exporter already uses port 9090",
    ),
    "app-port-is-ours": (
        _pod({"streamwarden.io/upstream-port": "8080"}),
        InjectOptions(),
        "also a port of the sidecar",
    ),
    "volume-name-taken": (
        _pod(volumes=[{"name": "streamwarden-tmp", "emptyDir": {}}]),
        InjectOptions(),
        "volume named streamwarden-tmp",
    ),
    "unknown-mode": (_pod({"streamwarden.io/mode": "sideways"}), InjectOptions(), "'sideways'"),
    "egress-without-upstream": (
        _pod({"streamwarden.io/mode": "egress"}),
        InjectOptions(),
        "egress needs streamwarden.io/upstream",
    ),
    "no-app-port": (
        _pod(containers=[{"name": "app", "image": "a"}]),
        InjectOptions(),
        "needs streamwarden.io/upstream-port",
    ),
    "bad-port": (_pod({"streamwarden.io/admin-port": "http"}), InjectOptions(), "not a port"),
    "bad-drain": (
        _pod({"streamwarden.io/drain-timeout": "soon"}),
        InjectOptions(),
        "not a duration",
    ),
    "job-with-regular-sidecar": (
        _pod(restartPolicy="Never"),
        InjectOptions(native=False),
        "would never complete",
    ),
    "inject-misspelt": (_pod({"streamwarden.io/inject": "yes"}), InjectOptions(), "'yes'"),
}


@pytest.mark.parametrize("case", list(SKIPS))
def test_what_it_will_not_touch_gets_a_reason(case: str) -> None:
    pod, options, reason = SKIPS[case]
    result, [outcome] = inject_object(pod, options)
    assert outcome.status == "skipped"
    assert reason in outcome.reason
    assert result["metadata"]["annotations"][SKIPPED] == outcome.reason
    # Nothing else changed, and skipping again changes nothing.
    del result["metadata"]["annotations"][SKIPPED]
    assert result == pod
    again, _ = inject_object(inject_object(pod, options)[0], options)
    assert again == inject_object(pod, options)[0]


def test_a_template_fixed_since_loses_its_old_skip_reason() -> None:
    skipped, _ = inject_object(_pod(hostNetwork=True), InjectOptions())
    del skipped["spec"]["hostNetwork"]
    fixed, [outcome] = inject_object(skipped, InjectOptions())
    assert outcome.status == "injected"
    assert SKIPPED not in fixed["metadata"]["annotations"]


def test_only_annotated_templates_unless_all() -> None:
    plain = _pod()
    del plain["metadata"]["annotations"]
    result, [outcome] = inject_object(plain, InjectOptions())
    assert result == plain and outcome.status == "untouched"
    assert "not annotated" in outcome.reason
    result, [outcome] = inject_object(plain, InjectOptions(all_pods=True))
    assert outcome.status == "injected"
    sidecar_of(result)
    # disabled wins over --all, and writes nothing.
    refused = _pod({"streamwarden.io/inject": "disabled"})
    result, [outcome] = inject_object(refused, InjectOptions(all_pods=True))
    assert result == refused and outcome.status == "untouched"


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("just text", "not a Kubernetes object"),
        ({"kind": "Deployment", "metadata": {"name": "x"}}, "no apiVersion"),
        ({"apiVersion": "apps/v1", "kind": "Deployment", "spec": {}}, "no pod template"),
        ({"apiVersion": "v1", "kind": "Pod", "spec": {"containers": {}}}, "spec.containers"),
        ({"apiVersion": "v1", "kind": "List", "items": [3]}, "item 1"),
    ],
)
def test_a_document_that_is_no_kubernetes_object_is_an_error(document: Any, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        inject_documents([document], InjectOptions())


# -- the same sidecar as the chart's ---------------------------------------------------


def test_the_injected_sidecar_is_the_charts_sidecar() -> None:
    pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
    # The chart's pod, rendered for 1.29 (where its preStop is `exec: sleep`, as inject's).
    chart = objects_of(render(None, kube_version="1.29.0"))
    chart_pod = Pod(tuple(chart))
    deployment = next(o for o in chart if o["kind"] == "Deployment")
    config_map = chart_pod.spec["volumes"][0]["configMap"]["name"]

    # The same pod without the chart's sidecar, then injected.
    bare = copy.deepcopy(deployment)
    spec = bare["spec"]["template"]["spec"]
    del spec["initContainers"], spec["terminationGracePeriodSeconds"]
    spec["volumes"] = [v for v in spec["volumes"] if not v["name"].startswith("streamwarden-")]
    bare["spec"]["template"]["metadata"]["annotations"] = {
        "streamwarden.io/inject": "enabled",
        "streamwarden.io/config": config_map,
    }
    injected, [outcome] = inject_object(bare, InjectOptions())
    assert outcome.status == "injected", outcome.line()
    template = injected["spec"]["template"]
    sidecar, native = sidecar_of(template)
    assert native == chart_pod.native

    fields = [
        "name",
        "image",
        "imagePullPolicy",
        "restartPolicy",
        "command",
        "ports",
        "startupProbe",
        "readinessProbe",
        "livenessProbe",
        "lifecycle",
        "resources",
        "securityContext",
        "volumeMounts",
    ]
    for field in fields:
        assert sidecar.get(field) == chart_pod.sidecar.get(field), field
    assert sorted(sidecar) == sorted(chart_pod.sidecar)
    # The same listeners, upstream and drain as the chart's ConfigMap says.
    settings = _run_settings(sidecar)
    for key in ("listen", "admin_listen", "upstream", "drain_timeout"):
        assert getattr(settings, key) == yaml.safe_load(chart_pod.config_text)[key] or (
            parse_duration(getattr(settings, key)) == parse_duration(chart_pod.config_keys[key])
        ), key
    # The same volumes and the same grace period.
    chart_volumes = [v for v in chart_pod.spec["volumes"] if v["name"].startswith("streamwarden")]
    volumes = [v for v in template["spec"]["volumes"] if v["name"].startswith("streamwarden")]
    assert volumes == chart_volumes
    assert (
        template["spec"]["terminationGracePeriodSeconds"]
        == chart_pod.spec["terminationGracePeriodSeconds"]
    )


# -- the command --------------------------------------------------------------------


def _inject_command(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", "inject", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_the_command_rewrites_a_file_and_says_what_it_did() -> None:
    result = _inject_command(str(WORKLOADS))
    assert result.returncode == 0, result.stderr
    written = list(yaml.safe_load_all(result.stdout))
    expected = inject_documents(workloads(), InjectOptions())[0]
    assert written == expected
    # In the same key order, too (dict equality alone would not see it).
    assert yaml.safe_dump_all(written, sort_keys=False) == yaml.safe_dump_all(
        expected, sort_keys=False
    )
    assert result.stdout.startswith("---\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n")
    lines = result.stderr.splitlines()
    assert "streamwarden inject: deployment/chat-api: injected" in lines
    assert len(lines) == 8
    # From stdin, with the flags: a regular container.
    result = _inject_command("-", "--no-native", stdin=WORKLOADS.read_text())
    assert result.returncode == 0, result.stderr
    assert (
        list(yaml.safe_load_all(result.stdout))
        == (inject_documents(workloads(), InjectOptions(native=False))[0])
    )
    assert "job/batch-eval: skipped: a regular sidecar container never exits" in result.stderr


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        ((), "kind: [", "stdin: not YAML"),
        ((), "- a\n- b\n", "stdin: document 1: not a Kubernetes object"),
        (("/nonexistent/manifests.yaml",), None, "No such file"),
        (("--base-url-env", "9LIVES"), "", "--base-url-env: '9LIVES' is not NAME"),
        (("--native",), "", "unrecognized arguments: --native"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: tuple[str, ...], stdin: str, message: str) -> None:
    result = _inject_command(*args, stdin=stdin)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr


# -- the docs' annotation table ------------------------------------------------------


def test_the_kubernetes_page_lists_every_annotation_with_its_default() -> None:
    import streamwarden.tools.inject as inject

    section = (REPO / "docs" / "kubernetes.md").read_text()
    rows = dict(re.findall(r"^\| `(streamwarden\.io/[a-z-]+)` \|([^|]*)\|", section, re.MULTILINE))
    annotations = {
        value
        for name, value in vars(inject).items()
        if name.isupper()
        and isinstance(value, str)
        and value.startswith("streamwarden.io/")
        and value != inject.ANNOTATION_PREFIX
    }
    assert set(rows) == annotations
    defaults = {
        inject.LISTEN_PORT: f"`{inject.DEFAULT_LISTEN_PORT}`",
        inject.ADMIN_PORT: f"`{inject.DEFAULT_ADMIN_PORT}`",
        inject.DRAIN_TIMEOUT: f"`{inject.DEFAULT_DRAIN_TIMEOUT}`",
        inject.MODE: "`front`",
        inject.BASE_URL_ENV: "`"
        + ",".join(f"{v.name}={v.path}" if v.path else v.name for v in inject.DEFAULT_BASE_URL_ENV)
        + "`",
    }
    for annotation, default in defaults.items():
        assert rows[annotation].strip() == default, annotation
    # The command's default is the same list.
    assert _parser().parse_args(["inject"]).base_url_env == defaults[inject.BASE_URL_ENV].strip("`")


# -- the injected container, run ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_the_injected_container_runs_and_its_probes_answer(mock: MockServer) -> None:
    proxy_port, admin_port = _free_port(), _free_port()
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "chat",
            "annotations": {
                "streamwarden.io/inject": "enabled",
                "streamwarden.io/upstream": mock.url,
                "streamwarden.io/listen-port": str(proxy_port),
                "streamwarden.io/admin-port": str(admin_port),
                "streamwarden.io/drain-timeout": "1s",
            },
        },
        "spec": {"containers": [{"name": "app", "image": "app:1"}]},
    }
    sidecar, _ = sidecar_of(inject_object(pod, InjectOptions())[0])
    # The container's own command line; only what a laptop lacks is swapped: the
    # image's config file at its path, and loopback for the pod's every interface.
    command = [sys.executable, "-m", "streamwarden.cli"] + [
        str(IMAGE_CONFIG) if arg.endswith("config.yaml") else arg.replace("0.0.0.0", "127.0.0.1")
        for arg in sidecar["args"]
    ]
    process = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as session:

            async def probe(name: str) -> int:
                get = sidecar[name]["httpGet"]
                url = f"http://127.0.0.1:{get['port']}{get['path']}"
                try:
                    async with session.get(url) as response:
                        return response.status
                except aiohttp.ClientConnectionError:
                    return 0

            async def started() -> bool:
                return await probe("startupProbe") == 200

            await wait_until(started, timeout=30, what="the startup probe")
            assert await probe("readinessProbe") == 200
            assert await probe("livenessProbe") == 200
            proxy = next(p for p in sidecar["ports"] if p["name"] == "sw-proxy")
            url = f"http://127.0.0.1:{proxy['containerPort']}/v1/chat/completions"
            async with session.post(url, json={"stream": True, "messages": []}) as response:
                assert response.status == 200
                body = await response.read()
            assert body.rstrip().endswith(b"data: [DONE]")
            # On SIGTERM the readiness probe fails first (the pod leaves its Service).
            process.send_signal(signal.SIGTERM)

            async def unready() -> bool:
                return await probe("readinessProbe") != 200

            await wait_until(unready, timeout=30, what="the readiness probe failing")
        assert await asyncio.wait_for(process.wait(), timeout=30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
