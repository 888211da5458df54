"""The Helm chart, its alert rules and its dashboard, checked without a cluster.

The chart is rendered and linted by Helm's own engine (``helm-python-sdk``
binds Helm's Go SDK: no ``helm`` binary), for several values sets and for a
host chart that injects the sidecar into its own pod. Every rendered object
is validated, strictly and offline, against the Kubernetes OpenAPI schemas
(``kubernetes-validate``). The properties that keep streams alive on
Kubernetes are asserted on the objects themselves: the sidecar's ports are
the ConfigMap's ``listen`` and ``admin_listen``, probes hit the admin port,
the Service targets the sidecar, the grace period outlasts the preStop pause
plus ``drain_timeout``, the sidecar is locked down. The alert rules go
through ``promtool check rules`` and ``promtool test rules``
(tests/helm/alerts_test.yaml), and every dashboard query through promtool's
PromQL parser.

Tools (each test skips, saying why, when its tool is missing):
``pip install helm-python-sdk kubernetes-validate`` and
``apt-get install prometheus`` (for ``promtool``).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helm_tools import (
    CHART,
    CURRENT_KUBE,
    OLD_KUBE,
    Pod,
    find,
    helm_sdk,
    objects_of,
    render,
    the,
)
from locations import REPO, TESTS
from streamwarden.config import RouteSettings, Settings, parse_duration
from streamwarden.core.meter import EndState
from streamwarden.observation.metrics import StreamMetrics

CASES_DIR = TESTS / "helm"
HOST_CHART = CASES_DIR / "host-chart"
RULES_FILE = REPO / "configs" / "prometheus-rules.yaml"
DASHBOARD = REPO / "configs" / "grafana-dashboard.json"

# The config keys the chart names as top-level values; every other key goes
# through its free-form `config` map.
EXPLICIT_KEYS = {"listen", "admin_listen", "upstream", "drain_timeout", "keepalive_interval"}
# Settings the sidecar does not read (the middleware's), so the chart does not offer them.
NOT_FOR_THE_SIDECAR = {"metrics_path"}
# Secrets never go in the ConfigMap: the chart reads them from a Secret (resume.secret).
FROM_A_SECRET = {"resume_secret"}


# -- tools ---------------------------------------------------------------------


def _kubernetes_validate() -> Any:
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install kubernetes-validate)",
    )


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


def _run_promtool(*args: str, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


# -- rendering -----------------------------------------------------------------


def _values_file(name: str) -> dict[str, Any]:
    # Helm's own YAML reading, not PyYAML's: the two disagree on YAML 1.1 corners.
    values: dict[str, Any] = helm_sdk().values_from_yaml((CASES_DIR / name).read_text())
    return values


@pytest.fixture(scope="module")
def host_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The host chart with its streamwarden dependency vendored by `helm dependency update`."""
    helm = helm_sdk()
    target = tmp_path_factory.mktemp("host") / "chat-api"
    shutil.copytree(HOST_CHART, target)
    chart_yaml = target / "Chart.yaml"
    chart_yaml.write_text(
        chart_yaml.read_text().replace("file://../../../helm/streamwarden", f"file://{CHART}")
    )
    helm.dependency_update(target)
    return target


# name -> (values, Kubernetes version, chart)
CASES: dict[str, tuple[str | None, str, str]] = {
    "defaults": (None, CURRENT_KUBE, "chart"),
    "wrap": ("values-wrap.yaml", CURRENT_KUBE, "chart"),
    "all-optional-objects": ("values-all-on.yaml", CURRENT_KUBE, "chart"),
    "podmonitor": ("values-podmonitor.yaml", CURRENT_KUBE, "chart"),
    "native-sidecar-off": ("values-native-off.yaml", CURRENT_KUBE, "chart"),
    "egress": ("values-egress.yaml", CURRENT_KUBE, "chart"),
    "kubernetes-1.28": (None, OLD_KUBE, "chart"),
    "inject": (None, CURRENT_KUBE, "host"),
    "inject-kubernetes-1.28": (None, OLD_KUBE, "host"),
}


Rendered = Callable[[str], tuple[dict[str, Any], ...]]


@pytest.fixture(scope="module")
def rendered(request: pytest.FixtureRequest) -> Rendered:
    """The objects of a values set in CASES, rendered once per module."""

    @functools.cache
    def render_case(name: str) -> tuple[dict[str, Any], ...]:
        values_file, kube_version, which = CASES[name]
        values = _values_file(values_file) if values_file else None
        chart = request.getfixturevalue("host_chart") if which == "host" else CHART
        return tuple(objects_of(render(values, kube_version=kube_version, chart=chart)))

    return render_case


def _port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


POD_CASES = list(CASES)
WRAP_CASES = [name for name in CASES if CASES[name][2] == "chart"]


# -- lint and Kubernetes validity ---------------------------------------------------


@pytest.mark.parametrize(
    "values_file",
    [
        None,
        "values-wrap.yaml",
        "values-all-on.yaml",
        "values-podmonitor.yaml",
        "values-native-off.yaml",
        "values-egress.yaml",
    ],
)
@pytest.mark.parametrize("kube_version", [CURRENT_KUBE, OLD_KUBE])
def test_chart_lints_clean(values_file: str | None, kube_version: str) -> None:
    helm = helm_sdk()
    values = _values_file(values_file) if values_file else None
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{kube_version}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_host_chart_lints_clean(host_chart: Path) -> None:
    helm = helm_sdk()
    report = helm.lint(host_chart, strict=True, kube_version=f"v{CURRENT_KUBE}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("case", POD_CASES)
def test_every_rendered_object_is_valid_kubernetes(case: str, rendered: Rendered) -> None:
    validator = _kubernetes_validate()
    kube_version = CASES[case][1]
    for obj in rendered(case):
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # prometheus-operator CRDs: no schema offline, checked below
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            validator.validate(obj, kube_version, strict=True)
        except validator.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            pytest.fail(
                f"{case}: {where} is not valid for Kubernetes {kube_version}: {path}: {exc}"
            )


def test_defaults_alone_render_a_working_placeholder(rendered: Rendered) -> None:
    objects = rendered("defaults")
    assert sorted(obj["kind"] for obj in objects) == ["ConfigMap", "Deployment", "Service"]
    pod = Pod(objects)
    app = next(c for c in pod.containers if c["name"] == "app")
    assert app["args"][0] == "mock-upstream"
    # The placeholder listens on loopback only: reachable through the sidecar alone.
    assert app["args"][-1] == "127.0.0.1:8000"
    assert pod.config_keys["upstream"] == "http://127.0.0.1:8000"
    assert pod.sidecar["image"] == "ghcr.io/streamwarden/streamwarden:0.1.0"
    assert pod.sidecar["command"] + pod.sidecar["args"] == [
        "streamwarden",
        "run",
        "--config",
        "/etc/streamwarden/config.yaml",
    ]


def test_optional_objects_render_only_when_enabled(rendered: Rendered) -> None:
    kinds = sorted(obj["kind"] for obj in rendered("all-optional-objects"))
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Service",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
        ]
    )
    deployment = the(rendered("all-optional-objects"), "Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"


# -- the pod -------------------------------------------------------------------------


@pytest.mark.parametrize("case", POD_CASES)
def test_sidecar_ports_are_the_configmaps_listen_and_admin_listen(
    case: str, tmp_path: Path, rendered: Rendered
) -> None:
    pod = Pod(rendered(case))
    # The ConfigMap states these keys itself, never leaving them to defaults.
    for key in ("listen", "admin_listen", "drain_timeout"):
        assert re.search(rf"^{key}: ", pod.config_text, re.MULTILINE), key
    settings = pod.settings(tmp_path)
    assert pod.port("sw-proxy") == _port_of(settings.listen)
    assert pod.port("sw-admin") == _port_of(settings.admin_listen)
    assert pod.port("sw-proxy") != pod.port("sw-admin")


def test_wrap_values_reach_the_configmap(tmp_path: Path, rendered: Rendered) -> None:
    pod = Pod(rendered("wrap"))
    settings = pod.settings(tmp_path)
    assert (settings.listen, settings.admin_listen) == ("0.0.0.0:8081", "0.0.0.0:9464")
    assert settings.upstream == "http://127.0.0.1:8000"
    assert settings.drain_timeout == 90.0
    assert settings.keepalive_interval == 10.0
    assert settings.upstream_idle_timeout == 120.0
    assert settings.max_event_bytes == 16 * 1024 * 1024
    assert settings.max_concurrent_streams == 500
    assert settings.for_path("/v1/chat/completions").limits.keepalive_interval == 5.0
    app = next(c for c in pod.containers if c["name"] == "chat-api")
    assert app["image"] == "registry.example.com/acme/chat-api:2.3.1"
    assert {"name": "LOG_LEVEL", "value": "info"} in app["env"]
    assert app["ports"] == [{"name": "app", "containerPort": 8000, "protocol": "TCP"}]


@pytest.mark.parametrize("case", POD_CASES)
def test_probes_hit_the_admin_port(case: str, rendered: Rendered) -> None:
    pod = Pod(rendered(case))
    admin = pod.port("sw-admin")
    expected = {
        "readinessProbe": "/readyz",
        "livenessProbe": "/healthz",
        "startupProbe": "/healthz",
    }
    for probe, path in expected.items():
        assert pod.sidecar[probe]["httpGet"] == {"path": path, "port": admin}, probe


@pytest.mark.parametrize("case", [name for name in POD_CASES if name != "egress"])
def test_the_service_targets_the_sidecars_proxy_port(case: str, rendered: Rendered) -> None:
    objects = rendered(case)
    pod = Pod(objects)
    services = [s for s in find(objects, "Service") if "metrics" not in s["metadata"]["name"]]
    assert len(services) == 1
    service = services[0]
    assert set(service["spec"]["selector"].items()) <= set(pod.labels.items())
    # A number: Services resolve native sidecars' named ports only from Kubernetes 1.32.
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [pod.port("sw-proxy")]
    for policy in find(objects, "NetworkPolicy"):
        allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert allowed == {pod.port("sw-proxy"), pod.port("sw-admin")}


def test_egress_placement_puts_the_sidecar_between_app_and_provider(
    tmp_path: Path, rendered: Rendered
) -> None:
    objects = rendered("egress")
    pod = Pod(objects)
    settings = pod.settings(tmp_path)
    assert settings.upstream == "https://api.openai.com"
    assert settings.listen == "127.0.0.1:8080", "only the app in the pod talks to the sidecar"
    app = next(c for c in pod.containers if c["name"] == "chat-api")
    assert {"name": "OPENAI_BASE_URL", "value": "http://127.0.0.1:8080/v1"} in app["env"]
    # Clients call the app; the app's streams from the provider pass the sidecar.
    service = the(objects, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [8000]
    policy = the(objects, "NetworkPolicy")
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == {8000, pod.port("sw-admin")}
    # Native: up before the app's first call, down after its last stream.
    assert pod.native


@pytest.mark.parametrize("case", POD_CASES)
def test_metrics_are_reachable_on_the_admin_port_only(case: str, rendered: Rendered) -> None:
    objects = rendered(case)
    pod = Pod(objects)
    admin = pod.port("sw-admin")
    for service in find(objects, "Service"):
        targets = {p["targetPort"] for p in service["spec"]["ports"]}
        if service["metadata"]["name"].endswith("-metrics"):
            assert targets == {admin}
        else:
            assert admin not in targets
    for monitor in find(objects, "PodMonitor"):
        assert monitor["spec"]["podMetricsEndpoints"] == [
            {"port": "sw-admin", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
        ]
    for monitor in find(objects, "ServiceMonitor"):
        metrics_service = next(
            s for s in find(objects, "Service") if s["metadata"]["name"].endswith("-metrics")
        )
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert set(selector.items()) <= set(metrics_service["metadata"]["labels"].items())
        assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
            ("metrics", "/metrics")
        ]
        assert set(metrics_service["spec"]["selector"].items()) <= set(pod.labels.items())


@pytest.mark.parametrize("case", POD_CASES)
def test_grace_period_outlasts_prestop_plus_drain_timeout(
    case: str, tmp_path: Path, rendered: Rendered
) -> None:
    pod = Pod(rendered(case))
    drain = pod.settings(tmp_path).drain_timeout
    pre_stop = pod.pre_stop_seconds(pod.sidecar)
    assert pre_stop > 0, (
        "without a preStop pause, SIGTERM closes the listener before endpoints drain"
    )
    grace = pod.spec["terminationGracePeriodSeconds"]
    assert grace > drain + pre_stop
    if pod.native and case in WRAP_CASES:
        # A native sidecar stops after the app, whose own preStop pause comes first.
        app = next(c for c in pod.containers if c["name"] != "streamwarden")
        assert grace > pod.pre_stop_seconds(app) + pre_stop + drain


@pytest.mark.parametrize(
    ("drain_timeout", "drain_seconds"),
    [("25s", 25), ("1500ms", 2), ("2m", 120), ("1h", 3600), (45, 45), (2.5, 3)],
)
def test_grace_period_follows_any_drain_timeout(drain_timeout: object, drain_seconds: int) -> None:
    assert parse_duration(drain_timeout) <= drain_seconds
    pod = Pod(tuple(objects_of(render({"drain_timeout": drain_timeout}))))
    # drain + sidecar preStop (5) + app preStop (5, native) + 5
    assert pod.spec["terminationGracePeriodSeconds"] == drain_seconds + 15


def test_a_grace_period_too_short_for_the_drain_fails_the_render() -> None:
    helm = helm_sdk()
    with pytest.raises(helm.HelmError, match=r"terminationGracePeriodSeconds \(30\) must exceed"):
        render({"terminationGracePeriodSeconds": 30})
    pod = Pod(tuple(objects_of(render({"terminationGracePeriodSeconds": 31}))))
    assert pod.spec["terminationGracePeriodSeconds"] == 31


@pytest.mark.parametrize("case", POD_CASES)
def test_sidecar_is_locked_down(case: str, rendered: Rendered) -> None:
    pod = Pod(rendered(case))
    context = pod.sidecar["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] != 0
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert "add" not in context["capabilities"]
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    resources = pod.sidecar["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert "memory" in resources["limits"]
    mounts = {m["mountPath"]: m for m in pod.sidecar["volumeMounts"]}
    assert mounts["/etc/streamwarden"]["readOnly"] is True
    assert "/tmp" in mounts, "a read-only root filesystem still needs a scratch /tmp"


@pytest.mark.parametrize("case", POD_CASES)
def test_no_service_links_reach_the_sidecars_environment(case: str, rendered: Rendered) -> None:
    # For a Service named streamwarden-*, Kubernetes would add STREAMWARDEN_*
    # variables, which the sidecar refuses as unknown config keys.
    assert Pod(rendered(case)).spec["enableServiceLinks"] is False


@pytest.mark.parametrize(
    ("native", "kube_version", "expected"),
    [
        ("auto", CURRENT_KUBE, True),
        ("auto", "1.29.0", True),
        ("auto", OLD_KUBE, False),
        (True, OLD_KUBE, True),
        (False, CURRENT_KUBE, False),
    ],
)
def test_native_sidecar_switch(native: object, kube_version: str, expected: bool) -> None:
    values = {"sidecar": {"native": native}}
    pod = Pod(tuple(objects_of(render(values, kube_version=kube_version))))
    assert pod.native is expected
    if expected:
        assert pod.sidecar["restartPolicy"] == "Always"
        assert pod.init_containers.index(pod.sidecar) == 0
        assert "startupProbe" in pod.sidecar, "the app starts only once the sidecar answers"
    else:
        assert "restartPolicy" not in pod.sidecar
        assert "initContainers" not in pod.spec


def test_prestop_uses_the_sleep_action_from_kubernetes_1_30() -> None:
    new = Pod(tuple(objects_of(render(kube_version="1.30.0"))))
    assert new.sidecar["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    old = Pod(tuple(objects_of(render(kube_version="1.29.0"))))
    assert old.sidecar["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}


def test_config_changes_roll_the_pods() -> None:
    def checksum(values: dict[str, Any] | None) -> str:
        deployment = the(tuple(objects_of(render(values))), "Deployment")
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        return str(annotations["checksum/streamwarden-config"])

    assert checksum(None) == checksum(None)
    assert checksum(None) != checksum({"config": {"upstream_idle_timeout": "90s"}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"admin_listen": "127.0.0.1:9090"}, "admin_listen .* is a loopback address"),
        ({"admin_listen": "0.0.0.0:8080"}, "listen and admin_listen use the same port 8080"),
        ({"app": {"port": 9090}}, r"app.port 9090 is also a port of the sidecar"),
        (
            {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
            "not both",
        ),
        ({"mode": "inject", "metrics": {"podMonitor": {"enabled": True}}}, "inject.podSelector"),
        ({"placement": "egress"}, "placement egress needs upstream"),
        ({"listen": "127.0.0.1:8080"}, "listen .* is a loopback address"),
    ],
)
def test_inconsistent_values_fail_the_render_with_one_clear_line(
    values: dict[str, Any], message: str
) -> None:
    helm = helm_sdk()
    with pytest.raises(helm.HelmError, match=message):
        render(values)


# -- inject mode -------------------------------------------------------------------


def test_inject_mode_renders_no_pod_of_its_own() -> None:
    objects = objects_of(render({"mode": "inject", "prometheusRule": {"enabled": True}}))
    assert [obj["kind"] for obj in objects] == ["PrometheusRule"]


def test_host_chart_gets_the_sidecar_and_its_config(rendered: Rendered) -> None:
    objects = rendered("inject")
    pod = Pod(objects)
    assert [c["name"] for c in pod.containers] == ["chat-api"]
    assert pod.native and pod.sidecar["restartPolicy"] == "Always"
    # The image tag is streamwarden's appVersion, not the host chart's.
    assert pod.sidecar["image"] == "ghcr.io/streamwarden/streamwarden:0.1.0"
    assert pod.config_keys["drain_timeout"] == "60s"
    monitor = the(objects, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "chat-api"}
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(pod.labels.items())
    annotations = pod.deployment["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/streamwarden-config" in annotations


def test_readme_example_is_the_tested_host_chart() -> None:
    readme = (CHART / "README.md").read_text()
    for template in ("deployment.yaml", "streamwarden-config.yaml"):
        source = (HOST_CHART / "templates" / template).read_text().strip()
        assert source in readme, f"README's inject example differs from host-chart/{template}"


def test_readme_shows_the_three_adoption_paths_and_the_metrics() -> None:
    readme = (CHART / "README.md").read_text()
    for heading in (
        "## 1. Wrap a service",
        "## 2. Inject into your own chart",
        "## 3. Between your app and its provider",
        "## Quick start: from `helm install` to `streamwarden_streams_total` in Prometheus",
    ):
        assert heading in readme
    assert "helm install" in readme
    assert "streamwarden_streams_total" in readme


# -- values and their schema -----------------------------------------------------------


@pytest.mark.parametrize(
    ("values_file", "message"),
    [
        ("bad-values-wrong-type.yaml", "at '/replicaCount': got string, want integer"),
        ("bad-values-unknown-key.yaml", "additional properties 'replicas' not allowed"),
        (
            "bad-values-unknown-config-key.yaml",
            "at '/config': additional properties 'upstream_idle_timout' not allowed",
        ),
        ("bad-values-duration.yaml", "at '/drain_timeout'"),
        ("bad-values-tool-arguments.yaml", "at '/config/max_tool_arguments_bytes'"),
    ],
)
def test_bad_values_fail_the_schema_with_a_clear_message(values_file: str, message: str) -> None:
    helm = helm_sdk()
    values = _values_file(values_file)
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as schema_error:
        chart.validate_schema(values)
    assert message in str(schema_error.value)
    # `helm install` and `helm template` refuse them the same way.
    with pytest.raises(helm.HelmValuesError) as render_error:
        render(values)
    assert message in str(render_error.value)


def test_schema_offers_every_sidecar_config_key() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"]["config"]
    assert config["additionalProperties"] is False
    expected = set(Settings.model_fields) - EXPLICIT_KEYS - NOT_FOR_THE_SIDECAR - FROM_A_SECRET
    offered = set(config["properties"])
    assert offered == expected, (
        f"values.schema.json's `config` lacks {sorted(expected - offered)} "
        f"and has {sorted(offered - expected)} that streamwarden.config.Settings does not"
    )
    assert set(schema["properties"]) >= EXPLICIT_KEYS
    route = config["properties"]["routes"]["additionalProperties"]
    assert set(route["properties"]) == set(RouteSettings.model_fields)
    end_states = schema["properties"]["prometheusRule"]["properties"]["unterminatedStreams"]
    assert set(end_states["properties"]["endStates"]["items"]["enum"]) == {
        str(state) for state in EndState
    }


def test_values_defaults_are_the_sidecars_defaults() -> None:
    with helm_sdk().Chart.load(CHART) as chart:
        values = chart.values
    defaults = Settings()
    assert values["listen"] == defaults.listen
    assert values["admin_listen"] == defaults.admin_listen
    assert parse_duration(values["drain_timeout"]) == defaults.drain_timeout
    assert parse_duration(values["keepalive_interval"]) == defaults.keepalive_interval


def _schema_paths(
    schema: dict[str, Any], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    for key, sub in schema.get("properties", {}).items():
        path = (*prefix, key)
        yield path
        if key != "config":
            yield from _schema_paths(sub, path)


def test_values_yaml_comments_every_key() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    chart_keys = set(_schema_paths(schema))  # not the free-form data under them
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str, bool]] = []  # indent, key, has a comment above
    seen: set[tuple[str, ...]] = set()
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z_][\w-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        commented = number > 0 and lines[number - 1].lstrip().startswith("#")
        stack.append((indent, match.group(2), commented))
        path = tuple(key for _, key, _ in stack)
        if path not in chart_keys:
            continue
        seen.add(path)
        # A key is documented by its own comment or, for a block of plain
        # Kubernetes fields (probe timings), by the comment on the block.
        documented = any(has_comment for _, _, has_comment in stack)
        assert documented, f"values.yaml: {'.'.join(path)} has no comment"
    top_level = {path for path in chart_keys if len(path) == 1} - {("global",)}
    assert top_level <= seen, f"values.yaml lacks {sorted(top_level - seen)}"


# -- alert rules -----------------------------------------------------------------------


def _rule_groups(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rule = the(tuple(objects_of(render(values))), "PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def test_configs_rules_are_the_charts_default_rules() -> None:
    chart_groups = _rule_groups({"prometheusRule": {"enabled": True}})
    file_groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    assert file_groups == chart_groups, (
        "configs/prometheus-rules.yaml differs from the chart's PrometheusRule: render the "
        "chart with prometheusRule.enabled=true and copy spec.groups into the file"
    )
    alerts = [rule["alert"] for rule in chart_groups[0]["rules"]]
    assert alerts == [
        "StreamWardenTimeToFirstTokenHigh",
        "StreamWardenStreamsEndWithoutTerminalEvent",
        "StreamWardenZombieTokensHigh",
        "StreamWardenClientCancelsRising",
        "StreamWardenCancelPropagationSlow",
        "StreamWardenEngineUnseenTokens",
    ]


def test_rule_thresholds_come_from_values() -> None:
    groups = _rule_groups(
        {
            "prometheusRule": {
                "enabled": True,
                "alertLabels": {"team": "llm"},
                "ttft": {"thresholdSeconds": 2.5, "window": "5m"},
                "unterminatedStreams": {"ratio": 0.05, "endStates": ["upstream_truncated"]},
                "zombieTokens": {"enabled": False},
            }
        }
    )
    rules = {rule["alert"]: rule for rule in groups[0]["rules"]}
    assert "StreamWardenZombieTokensHigh" not in rules
    ttft = rules["StreamWardenTimeToFirstTokenHigh"]
    assert ttft["expr"].rstrip().endswith("> 2.5") and "[5m]" in ttft["expr"]
    unterminated = rules["StreamWardenStreamsEndWithoutTerminalEvent"]["expr"]
    assert 'end_state=~"upstream_truncated"' in unterminated
    assert unterminated.rstrip().endswith("> 0.05")
    assert all(rule["labels"]["team"] == "llm" for rule in rules.values())


def test_rules_pass_promtool_check() -> None:
    _run_promtool("check", "rules", str(RULES_FILE))


def test_rendered_prometheusrule_passes_promtool_check(tmp_path: Path, rendered: Rendered) -> None:
    groups = the(rendered("all-optional-objects"), "PrometheusRule")["spec"]["groups"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    _run_promtool("check", "rules", str(path))


def test_each_alert_fires_on_synthetic_series_and_only_then() -> None:
    output = _run_promtool("test", "rules", "alerts_test.yaml", cwd=CASES_DIR)
    assert "SUCCESS" in output
    tested = set(re.findall(r"alertname: (\w+)", (CASES_DIR / "alerts_test.yaml").read_text()))
    shipped = {r["alert"] for r in yaml.safe_load(RULES_FILE.read_text())["groups"][0]["rules"]}
    assert tested == shipped, "every shipped alert needs a promtool unit test"


# -- metric names, dashboard ------------------------------------------------------------


def _exported_series_names() -> set[str]:
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum"]}
    return {
        family.name + suffix
        for family in StreamMetrics().registry.collect()
        for suffix in suffixes[family.type]
    }


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_rules_and_dashboard_use_only_exported_metrics() -> None:
    exported = _exported_series_names()
    texts = [RULES_FILE.read_text(), *_dashboard_queries()]
    used = {name for text in texts for name in re.findall(r"\bstreamwarden_[a-z_]+\b", text)}
    assert used <= exported, (
        f"not exported by streamwarden.observation.metrics: {sorted(used - exported)}"
    )


def test_dashboard_covers_what_the_alerts_watch() -> None:
    def families(text: str) -> set[str]:
        names = re.findall(r"\bstreamwarden_[a-z_]+\b", text)
        return {re.sub(r"_(bucket|count|sum)$", "", name) for name in names}

    dashboard_families = families(DASHBOARD.read_text())
    assert families(RULES_FILE.read_text()) <= dashboard_families
    assert {re.sub(r"_(bucket)$", "", n) for n in _exported_series_names()} >= dashboard_families


def test_dashboard_is_grafana_json_over_a_chosen_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"namespace", "job", "dialect"} <= set(variables)
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    def concrete(expr: str) -> str:
        expr = expr.replace("$__rate_interval", "5m")
        return re.sub(r"\$(namespace|job|dialect)\b", ".*", expr)

    rules = [
        {"record": f"dashboard:query_{index}", "expr": concrete(expr)}
        for index, expr in enumerate(_dashboard_queries())
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _run_promtool("check", "rules", str(path))


def test_replicas_share_a_redis_resume_store_from_a_url_or_a_secret(tmp_path: Path) -> None:
    plain = Pod(tuple(objects_of(render({"resume": {"redis": {"url": "redis://redis:6379/0"}}}))))
    assert plain.settings(tmp_path).resume_store == "redis://redis:6379/0"
    secret = Pod(
        tuple(
            objects_of(
                render(
                    {
                        "resume": {
                            "redis": {
                                "url": "redis://ignored:6379/0",
                                "existingSecret": "llm-redis",
                                "secretKey": "resume-url",
                            }
                        }
                    }
                )
            )
        )
    )
    # A URL with a password never lands in the ConfigMap: it comes from the Secret.
    assert "resume_store" not in secret.config_keys
    assert {
        "name": "STREAMWARDEN_RESUME_STORE",
        "valueFrom": {"secretKeyRef": {"name": "llm-redis", "key": "resume-url"}},
    } in secret.sidecar["env"]
    defaults = Pod(tuple(objects_of(render())))
    assert "resume_store" not in defaults.config_keys
    assert "env" not in defaults.sidecar


def test_the_resume_secret_comes_from_a_secret_never_the_configmap() -> None:
    keyed = Pod(tuple(objects_of(render({"resume": {"secret": {"existingSecret": "llm-resume"}}}))))
    assert "resume_secret" not in keyed.config_keys
    assert {
        "name": "STREAMWARDEN_RESUME_SECRET",
        "valueFrom": {"secretKeyRef": {"name": "llm-resume", "key": "secret"}},
    } in keyed.sidecar["env"]


def test_the_notes_warn_while_the_image_is_the_placeholder() -> None:
    placeholder = render()
    notes = next(text for path, text in placeholder.items() if path.endswith("NOTES.txt"))
    assert "image.repository is still the placeholder" in notes
    own = render({"image": {"repository": "registry.example.com/me/streamwarden"}})
    notes = next(text for path, text in own.items() if path.endswith("NOTES.txt"))
    assert "placeholder" not in notes.split("streamwarden is in front")[0]
