"""The Helm chart rendered by Helm's own engine, and the objects and the pod it renders.

``helm-python-sdk`` binds Helm's Go SDK (no ``helm`` binary); without it, a
test that renders skips, saying how to install it. The chart's tests
(tests/project/test_helm_chart.py, test_helm_webhook.py) and ``inject``'s
(tests/tools/test_inject.py: the injected sidecar is the chart's) share these.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from locations import REPO
from streamwarden.config import Settings, load_settings

CHART = REPO / "helm" / "streamwarden"

RELEASE = "demo"
NAMESPACE = "llm"
# The Kubernetes version the chart is rendered for (.Capabilities.KubeVersion)
# and its objects are validated against; 1.28 is the last without native sidecars.
CURRENT_KUBE = "1.36.0"
OLD_KUBE = "1.28.0"


def helm_sdk() -> Any:
    """Helm's engine (``helm-python-sdk``), or the test skips saying how to install it."""
    return pytest.importorskip(
        "helm_python", reason="helm-python-sdk is not installed (pip install helm-python-sdk)"
    )


def render(
    values: dict[str, Any] | None = None,
    *,
    kube_version: str = CURRENT_KUBE,
    chart: Path = CHART,
) -> dict[str, str]:
    """Render like `helm template --kube-version`: template path -> manifest text."""
    helm = helm_sdk()
    with helm.Chart.load(chart) as loaded:
        if "kube_version" in inspect.signature(loaded.render).parameters:
            rendered: dict[str, str] = loaded.render(
                values, name=RELEASE, namespace=NAMESPACE, kube_version=f"v{kube_version}"
            )
            return rendered
        # helm-python-sdk 0.2.2's Chart.render() does not forward the Kubernetes
        # version, but the native helm_render call it wraps takes it.
        from helm_python import _native

        options = {"name": RELEASE, "namespace": NAMESPACE, "kube_version": f"v{kube_version}"}
        payload = _native.call_string(
            "helm_render",
            loaded._raw(),
            None if values is None else json.dumps(values),
            json.dumps(options),
        )
        rendered = json.loads(payload)
        return rendered


def objects_of(manifests: dict[str, str]) -> list[dict[str, Any]]:
    """The objects of rendered manifests (NOTES.txt is no manifest)."""
    found: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        found.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return found


def find(objects: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def the(objects: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    matches = find(objects, kind)
    assert len(matches) == 1, f"expected one {kind}, got {len(matches)}"
    return matches[0]


# -- reading a rendered pod ------------------------------------------------------


class Pod:
    """The rendered pod template, its sidecar and the sidecar's ConfigMap."""

    def __init__(self, objects: tuple[dict[str, Any], ...]) -> None:
        self.deployment = the(objects, "Deployment")
        self.spec: dict[str, Any] = self.deployment["spec"]["template"]["spec"]
        self.labels: dict[str, str] = self.deployment["spec"]["template"]["metadata"]["labels"]
        self.init_containers: list[dict[str, Any]] = self.spec.get("initContainers") or []
        self.containers: list[dict[str, Any]] = self.spec["containers"]
        sidecars = [
            c for c in self.init_containers + self.containers if c["name"] == "streamwarden"
        ]
        assert len(sidecars) == 1, "the pod must carry exactly one streamwarden container"
        self.sidecar = sidecars[0]
        self.native = self.sidecar in self.init_containers
        volume = next(v for v in self.spec["volumes"] if v["name"] == "streamwarden-config")
        config_map = next(
            c
            for c in find(objects, "ConfigMap")
            if c["metadata"]["name"] == volume["configMap"]["name"]
        )
        self.config_text: str = config_map["data"]["config.yaml"]
        self.config_keys: dict[str, Any] = yaml.safe_load(self.config_text)

    def settings(self, tmp_path: Path) -> Settings:
        """The ConfigMap read by the real config loader, as `streamwarden run --config` does."""
        path = tmp_path / "config.yaml"
        path.write_text(self.config_text)
        return load_settings(path, environ={})

    def port(self, name: str) -> int:
        ports = {p["name"]: p["containerPort"] for p in self.sidecar["ports"]}
        return int(ports[name])

    @staticmethod
    def pre_stop_seconds(container: dict[str, Any]) -> int:
        handler = container.get("lifecycle", {}).get("preStop")
        if handler is None:
            return 0
        if "sleep" in handler:
            return int(handler["sleep"]["seconds"])
        command = handler["exec"]["command"]
        assert command[0] == "sleep", command
        return int(command[1])
