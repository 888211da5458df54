"""How fast ``streamwarden webhook`` answers an AdmissionReview over HTTPS.

Run: ``python -m bench.webhook_latency`` (``--requests N``; the ``test``
extra's ``trustme`` makes the certificate).

The Kubernetes API server waits for a mutating webhook on every pod
creation (10 s by default, then the pod is refused or admitted without
it, as ``failurePolicy`` says), and the issue's bound for this one is an
answer within 100 ms. The webhook runs in this process on loopback with a
certificate from a throw-away CA, as a mounted Secret provides it; one
client connection (TLS session set up in the warm-up) sends the review of
an annotated ReplicaSet pod, which gets the full patch, one request at a
time. The median is the figure (robust to a shared machine's stalls); the
99th percentile and the slowest are shown next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import trustme
from aiohttp import web

from streamwarden.tools.inject import InjectOptions
from streamwarden.tools.webhook import CertificateFiles, webhook_app

#: The issue's bound on the median answer.
BOUND_SECONDS = 0.1
WARM_UP = 10


def review_of_an_annotated_pod() -> dict[str, Any]:
    """An AdmissionReview v1 of a pod as the ReplicaSet controller creates it."""
    pod = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "generateName": "chat-api-7d9f8b6c5d-",
            "namespace": "llm",
            "labels": {"app": "chat-api", "pod-template-hash": "7d9f8b6c5d"},
            "annotations": {"streamwarden.io/inject": "enabled"},
        },
        "spec": {
            "containers": [
                {
                    "name": "chat-api",
                    "image": "registry.example/chat-api:1.4.2",
                    "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                    "resources": {},
                    "terminationMessagePath": "/dev/termination-log",
                    "imagePullPolicy": "IfNotPresent",
                }
            ],
            "restartPolicy": "Always",
            "dnsPolicy": "ClusterFirst",
        },
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "llm",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod,
            "dryRun": False,
        },
    }


async def measure(requests: int) -> list[float]:
    """Seconds per answer of ``requests`` sequential reviews, after a warm-up."""
    ca = trustme.CA()
    with tempfile.TemporaryDirectory() as directory:
        leaf = ca.issue_cert("127.0.0.1")
        leaf.cert_chain_pems[0].write_to_path(str(Path(directory, "tls.crt")))
        leaf.private_key_pem.write_to_path(str(Path(directory, "tls.key")))
        files = CertificateFiles(str(Path(directory, "tls.crt")), str(Path(directory, "tls.key")))
        runner = web.AppRunner(webhook_app(InjectOptions()))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=files.context)
        await site.start()
        try:
            url = f"https://127.0.0.1:{runner.addresses[0][1]}/mutate"
            client = ssl.create_default_context()
            ca.configure_trust(client)
            body = review_of_an_annotated_pod()
            timings: list[float] = []
            connector = aiohttp.TCPConnector(ssl=client)
            async with aiohttp.ClientSession(connector=connector) as session:
                for index in range(WARM_UP + requests):
                    started = time.perf_counter()
                    async with session.post(url, json=body) as response:
                        answer = await response.json()
                    took = time.perf_counter() - started
                    if response.status != 200 or "patch" not in answer["response"]:
                        raise SystemExit(f"not a patch: {response.status} {answer}")
                    if index >= WARM_UP:
                        timings.append(took)
            return timings
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args(argv)
    timings = sorted(asyncio.run(measure(args.requests)))
    median = statistics.median(timings)
    p99 = timings[min(len(timings) - 1, int(0.99 * len(timings)))]
    met = "met" if median < BOUND_SECONDS else "NOT met"
    print(
        f"webhook answer over HTTPS, {len(timings)} reviews: median {median * 1000:.2f} ms, "
        f"p99 {p99 * 1000:.2f} ms, slowest {timings[-1] * 1000:.2f} ms "
        f"(bound: median < {BOUND_SECONDS * 1000:.0f} ms, {met})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
