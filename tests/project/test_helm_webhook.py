"""The chart's ``webhook.enabled`` mode, rendered by Helm's engine and used for real.

The webhook's Deployment, Service, MutatingWebhookConfiguration and
certificate are rendered (``helm-python-sdk``), linted, and validated
strictly offline against the Kubernetes schemas (``kubernetes-validate``),
with and without cert-manager on the cluster (``.Capabilities.APIVersions``).
The generated certificate is then used the way the API server uses it: the
real webhook serves the rendered Secret's pair on loopback, and a client
that trusts only the rendered ``caBundle`` and asks for the Service's DNS
name gets a patch for a real ``AdmissionReview``. The rendered command line
is read by the real ``streamwarden`` parser.
"""

from __future__ import annotations

import base64
import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from admission import admission_review, apply_patch, patch_of, replicaset_pod
from helm_tools import CHART, NAMESPACE, RELEASE, helm_sdk, objects_of
from streamwarden.cli import _inject_options, _parser
from streamwarden.tools.inject import InjectOptions, inject_object
from streamwarden.tools.webhook import CertificateFiles, webhook_app
from upstreams import ServeUpstream, port_of

WEBHOOK_ONLY = {"mode": "inject", "webhook": {"enabled": True}}
SERVICE_DNS = f"{RELEASE}-streamwarden-webhook.{NAMESPACE}.svc"


def render(
    values: dict[str, Any], *, kube_version: str = "1.30.0", api_versions: list[str] | None = None
) -> list[dict[str, Any]]:
    """Like `helm template --kube-version V --api-versions A`, as objects."""
    helm = helm_sdk()
    from helm_python import _native

    options = {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "kube_version": f"v{kube_version}",
        "api_versions": api_versions or [],
    }
    with helm.Chart.load(CHART) as chart:
        payload = _native.call_string(
            "helm_render", chart._raw(), json.dumps(values), json.dumps(options)
        )
    return objects_of(json.loads(payload))


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(obj["kind"] for obj in objects)


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"one {kind}, got {len(found)}"
    return found[0]


def test_the_webhook_renders_only_when_enabled() -> None:
    assert kinds(render({"mode": "inject"})) == []
    assert kinds(render(WEBHOOK_ONLY)) == [
        "Deployment",
        "MutatingWebhookConfiguration",
        "Secret",
        "Service",
    ]
    with_cert_manager = render(WEBHOOK_ONLY, api_versions=["cert-manager.io/v1"])
    assert kinds(with_cert_manager) == [
        "Certificate",
        "Deployment",
        "Issuer",
        "MutatingWebhookConfiguration",
        "Service",
    ]


@pytest.mark.parametrize("kube_version", ["1.29.0", "1.30.0"])
@pytest.mark.parametrize("cert_manager", [False, True], ids=["generated", "cert-manager"])
def test_the_webhook_objects_are_valid_kubernetes(kube_version: str, cert_manager: bool) -> None:
    validator = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate missing")
    api_versions = ["cert-manager.io/v1"] if cert_manager else []
    for obj in render(WEBHOOK_ONLY, kube_version=kube_version, api_versions=api_versions):
        if obj["apiVersion"].startswith("cert-manager.io/"):
            continue  # a CRD: no schema offline; its fields are checked below
        try:
            validator.validate(obj, kube_version, strict=True)
        except validator.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{obj['kind']}: {kube_version}: {path}: {exc}")


def test_the_webhook_values_lint_clean() -> None:
    helm = helm_sdk()
    for values in (WEBHOOK_ONLY, {"webhook": {"enabled": True}}):
        report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and problems == [], report


def test_a_broken_webhook_never_blocks_a_deploy() -> None:
    objects = render(WEBHOOK_ONLY)
    [hook] = one(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert 1 <= hook["timeoutSeconds"] <= 10
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["sideEffects"] == "None"
    assert hook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    service = one(objects, "Service")
    assert hook["clientConfig"]["service"] == {
        "name": service["metadata"]["name"],
        "namespace": NAMESPACE,
        "path": "/mutate",
        "port": 443,
    }
    deployment = one(objects, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert set(service["spec"]["selector"].items()) <= set(labels.items())
    # The webhook is never in the way of its own pods' creation.
    assert {"key": "streamwarden.io/webhook", "operator": "DoesNotExist"} in hook["objectSelector"][
        "matchExpressions"
    ]
    assert labels["streamwarden.io/webhook"] == "true"
    assert "kube-system" in hook["namespaceSelector"]["matchExpressions"][0]["values"]


def test_selectors_and_timeout_come_from_the_values() -> None:
    values = {
        "mode": "inject",
        "webhook": {
            "enabled": True,
            "timeoutSeconds": 3,
            "namespaceSelector": {"matchLabels": {"streamwarden.io/injection": "enabled"}},
            "objectSelector": {"matchLabels": {"tier": "llm"}},
        },
    }
    [hook] = one(render(values), "MutatingWebhookConfiguration")["webhooks"]
    assert hook["timeoutSeconds"] == 3
    assert hook["namespaceSelector"] == {
        "matchLabels": {"streamwarden.io/injection": "enabled"},
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["kube-system", "kube-node-lease", "kube-public"],
            }
        ],
    }
    assert hook["objectSelector"] == {
        "matchLabels": {"tier": "llm"},
        "matchExpressions": [{"key": "streamwarden.io/webhook", "operator": "DoesNotExist"}],
    }


def test_cert_manager_issues_the_certificate_when_it_is_there() -> None:
    objects = render(WEBHOOK_ONLY, api_versions=["cert-manager.io/v1"])
    configuration = one(objects, "MutatingWebhookConfiguration")
    certificate = one(objects, "Certificate")
    annotation = configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == f"{NAMESPACE}/{certificate['metadata']['name']}"
    assert "caBundle" not in configuration["webhooks"][0]["clientConfig"]
    assert SERVICE_DNS in certificate["spec"]["dnsNames"]
    issuer = one(objects, "Issuer")
    assert certificate["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"]
    assert issuer["spec"] == {"selfSigned": {}}
    volume = one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"][0]
    assert volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    # Forced off, the chart generates its own pair even with cert-manager there.
    forced = {"mode": "inject", "webhook": {"enabled": True, "certificate": {"certManager": False}}}
    assert "Secret" in kinds(render(forced, api_versions=["cert-manager.io/v1"]))


def test_the_rendered_command_is_the_webhooks_command_line() -> None:
    container = one(render(WEBHOOK_ONLY), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["streamwarden"]
    args = _parser().parse_args(container["args"])
    assert args.command == "webhook"
    assert args.listen == "0.0.0.0:8443"
    assert _inject_options(args) == InjectOptions(image="ghcr.io/streamwarden/streamwarden:0.1.0")
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    # Clusters without native sidecars (< 1.29) get regular ones.
    old = one(render(WEBHOOK_ONLY, kube_version="1.28.0"), "Deployment")
    old_args = _parser().parse_args(old["spec"]["template"]["spec"]["containers"][0]["args"])
    assert _inject_options(old_args).native is False


async def test_the_generated_certificate_serves_the_api_servers_calls(
    tmp_path: Path, serve_upstream: ServeUpstream
) -> None:
    objects = render(WEBHOOK_ONLY)
    secret = one(objects, "Secret")
    configuration = one(objects, "MutatingWebhookConfiguration")
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_bytes(base64.b64decode(secret["data"][name]))
    certificates = CertificateFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    served = await serve_upstream(webhook_app(InjectOptions()), ssl_context=certificates.context)
    port = port_of(served)
    # The API server trusts the caBundle only, and calls the Service's DNS name.
    ca_bundle = base64.b64decode(configuration["webhooks"][0]["clientConfig"]["caBundle"])
    trusting = ssl.create_default_context(cadata=ca_bundle.decode())
    pod = replicaset_pod()
    connector = aiohttp.TCPConnector(ssl=trusting, resolver=_Loopback(SERVICE_DNS))
    async with aiohttp.ClientSession(connector=connector) as session:
        url = f"https://{SERVICE_DNS}:{port}/mutate"
        async with session.post(url, json=admission_review(pod)) as response:
            answer = await response.json()
    patch = patch_of(answer)
    assert patch is not None
    assert apply_patch(pod, patch) == inject_object(pod, InjectOptions())[0]
    # And the system's trust store does not know that CA: the caBundle is what counts.
    connector = aiohttp.TCPConnector(
        ssl=ssl.create_default_context(), resolver=_Loopback(SERVICE_DNS)
    )
    async with aiohttp.ClientSession(connector=connector) as session:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await session.post(url, json=admission_review(pod))


class _Loopback(aiohttp.abc.AbstractResolver):
    """Resolves the Service's DNS name to 127.0.0.1, as cluster DNS would to its IP."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def resolve(self, host: str, port: int = 0, family: int = 0) -> list[Any]:
        assert host == self.name, host
        return [
            {
                "hostname": host,
                "host": "127.0.0.1",
                "port": port,
                "family": 2,
                "proto": 0,
                "flags": 0,
            }
        ]

    async def close(self) -> None:
        return None


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return set(selector.items()) <= set(labels.items())


def test_with_wrap_mode_each_service_selects_only_its_own_pods() -> None:
    everything = {
        "webhook": {"enabled": True},
        "networkPolicy": {"enabled": True},
        "podDisruptionBudget": {"enabled": True},
    }
    objects = render(everything)
    deployments = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Deployment"}
    webhook_pod = deployments[f"{RELEASE}-streamwarden-webhook"]["spec"]["template"]
    app_pod = deployments[f"{RELEASE}-streamwarden"]["spec"]["template"]
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        is_webhook = service["metadata"]["name"].endswith("-webhook")
        assert _selects(selector, webhook_pod["metadata"]["labels"]) is is_webhook
        assert _selects(selector, app_pod["metadata"]["labels"]) is not is_webhook
    for kind in ("NetworkPolicy", "PodDisruptionBudget"):
        obj = one(objects, kind)
        selector = (obj["spec"].get("podSelector") or obj["spec"]["selector"])["matchLabels"]
        assert not _selects(selector, webhook_pod["metadata"]["labels"]), kind
