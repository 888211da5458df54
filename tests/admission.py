"""Kubernetes admission, as the API server does it: the review it sends, the patch it applies.

``admission_review`` is an ``AdmissionReview`` v1 request in the shape of the
Kubernetes documentation's "Webhook request and response" (uid, kind,
resource, operation, the pod as the ReplicaSet controller creates it, with
the API server's defaults filled in: ``replicaset_pod``); ``patch_of`` reads
the JSON patch of the answer, and ``apply_patch`` applies it (RFC 6902: add,
replace, remove). The webhook's tests and the chart's webhook mode share them.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def apply_patch(document: Any, patch: list[dict[str, Any]]) -> Any:
    result = copy.deepcopy(document)
    for operation in patch:
        tokens = [_unescape(t) for t in operation["path"].split("/")[1:]]
        parent = result
        for token in tokens[:-1]:
            parent = parent[int(token)] if isinstance(parent, list) else parent[token]
        last = tokens[-1]
        op = operation["op"]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if op == "add":
                parent.insert(index, operation["value"])
            elif op == "replace":
                parent[index] = operation["value"]
            elif op == "remove":
                del parent[index]
            else:
                raise AssertionError(f"unexpected op {op}")
        else:
            if op == "add":
                parent[last] = operation["value"]
            elif op == "replace":
                assert last in parent, f"replace of a missing member {operation['path']}"
                parent[last] = operation["value"]
            elif op == "remove":
                del parent[last]
            else:
                raise AssertionError(f"unexpected op {op}")
    return result


# -- requests as the API server sends them --------------------------------------------


def replicaset_pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod as the ReplicaSet controller creates it, after the API server's defaulting."""
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "generateName": "chat-api-7d9f8b6c5d-",
            "namespace": "llm",
            "uid": "5c0a4a24-9f0e-4f5e-9d1e-0a8c2b9c7f11",
            "creationTimestamp": None,
            "labels": {"app": "chat-api", "pod-template-hash": "7d9f8b6c5d"},
            "annotations": {"streamwarden.io/inject": "enabled", **(annotations or {})},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "chat-api-7d9f8b6c5d",
                    "uid": "0b6f0c2e-2f63-4a1c-8d1f-3f1d3f7e1a22",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "volumes": [
                {
                    "name": "kube-api-access-x7k2p",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}
                        ],
                        "defaultMode": 420,
                    },
                }
            ],
            "containers": [
                {
                    "name": "chat-api",
                    "image": "registry.example.com/acme/chat-api:2.3.1",
                    "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                    "env": [{"name": "LOG_LEVEL", "value": "info"}],
                    "resources": {},
                    "volumeMounts": [
                        {
                            "name": "kube-api-access-x7k2p",
                            "readOnly": True,
                            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                        }
                    ],
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                    "imagePullPolicy": "IfNotPresent",
                }
            ],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "serviceAccount": "default",
            "securityContext": {},
            "schedulerName": "default-scheduler",
            "tolerations": [
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                }
            ],
            "priority": 0,
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
        },
        "status": {},
    }


def admission_review(
    pod: Any,
    *,
    operation: str = "CREATE",
    kind: str = "Pod",
    uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002",
) -> dict[str, Any]:
    resource = {"group": "", "version": "v1", "resource": "pods"}
    group_kind = {"group": "", "version": "v1", "kind": kind}
    if kind == "Deployment":
        resource = {"group": "apps", "version": "v1", "resource": "deployments"}
        group_kind = {"group": "apps", "version": "v1", "kind": kind}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": group_kind,
            "resource": resource,
            "requestKind": group_kind,
            "requestResource": resource,
            "namespace": "llm",
            "operation": operation,
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "uid": "4f2a7a1e-0000-4000-8000-000000000001",
                "groups": ["system:serviceaccounts", "system:authenticated"],
            },
            "object": pod if operation != "DELETE" else None,
            "oldObject": pod if operation in ("UPDATE", "DELETE") else None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.title()}Options"},
        },
    }


def patch_of(answer: dict[str, Any]) -> list[dict[str, Any]] | None:
    response = answer["response"]
    if "patch" not in response:
        return None
    assert response["patchType"] == "JSONPatch"
    patch: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return patch
