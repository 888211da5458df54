"""``streamwarden webhook``: the injection as a mutating admission webhook, over real HTTPS.

The webhook runs on loopback with a certificate from a test CA (``trustme``)
in files, as a mounted Secret provides them, and is sent the
``AdmissionReview`` v1 requests the Kubernetes API server sends (the shape
of the Kubernetes documentation's "Webhook request and response": uid, kind,
resource, operation, the Pod as the ReplicaSet controller creates it, with
the API server's defaults filled in: ``admission.py``). Its JSON patch,
applied to the pod by the RFC 6902 applier there, must give exactly what
``streamwarden inject`` gives. It skips what it should with a reason, never denies, and serves a
renewed certificate without a restart. (How fast it answers, against the
issue's 100 ms: ``python -m bench.webhook_latency``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admission import admission_review, apply_patch, patch_of, replicaset_pod
from streamwarden.tools import webhook as webhook_module
from streamwarden.tools.inject import SKIPPED, InjectOptions, inject_object
from streamwarden.tools.webhook import CertificateFiles, webhook_app
from upstreams import ServeUpstream, port_of
from waiting import wait_until

Review = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


# -- the JSON patch applier (admission.py) that checks the patch ------------------------


def test_the_patch_applier_follows_rfc_6902() -> None:
    # RFC 6902 appendix A.1, A.2, A.6 and the ~1 escape of A.14's kind.
    assert apply_patch({"foo": "bar"}, [{"op": "add", "path": "/baz", "value": "qux"}]) == {
        "foo": "bar",
        "baz": "qux",
    }
    assert apply_patch({"foo": ["bar", "baz"]}, [{"op": "add", "path": "/foo/1", "value": 1}]) == {
        "foo": ["bar", 1, "baz"]
    }
    assert apply_patch({"a": {"b/c": 1}}, [{"op": "replace", "path": "/a/b~1c", "value": 2}]) == {
        "a": {"b/c": 2}
    }
    assert apply_patch([1], [{"op": "add", "path": "/-", "value": 2}]) == [1, 2]


# -- a webhook on loopback -------------------------------------------------------------


def write_pair(cert: trustme.LeafCert, directory: Path, *, key: bool = True) -> None:
    """Replace the files the way a Secret volume does: whole new files, renamed in."""
    for name, blob in [("tls.crt", cert.cert_chain_pems[0]), ("tls.key", cert.private_key_pem)]:
        if name == "tls.key" and not key:
            continue
        partial = directory / f".{name}.new"
        blob.write_to_path(str(partial))
        os.replace(partial, directory / name)


class Webhook:
    def __init__(self, certificates: CertificateFiles, port: int, ca: trustme.CA) -> None:
        self.certificates = certificates
        self.port = port
        self.url = f"https://127.0.0.1:{port}/mutate"
        self.ca = ca

    def client_context(self, ca: trustme.CA | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context()
        (ca or self.ca).configure_trust(context)
        return context


@pytest.fixture
async def webhook(tmp_path: Path, serve_upstream: ServeUpstream) -> Webhook:
    ca = trustme.CA()
    write_pair(ca.issue_cert("127.0.0.1", "localhost"), tmp_path)
    certificates = CertificateFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    served = await serve_upstream(webhook_app(InjectOptions()), ssl_context=certificates.context)
    return Webhook(certificates, port_of(served), ca)


@pytest.fixture
async def review(webhook: Webhook) -> AsyncIterator[Review]:
    connector = aiohttp.TCPConnector(ssl=webhook.client_context())
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send(body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(webhook.url, json=body) as response:
                assert response.status == 200, await response.text()
                answer: dict[str, Any] = await response.json()
                return answer

        yield send


# -- the patch ------------------------------------------------------------------------


async def test_the_patch_applied_to_the_pod_is_what_inject_writes(review: Review) -> None:
    pod = replicaset_pod()
    answer = await review(admission_review(pod))
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002"
    assert response["allowed"] is True
    assert "warnings" not in response and "status" not in response
    patch = patch_of(answer)
    assert patch, "an annotated pod gets a patch"
    # Without the patch the pod has no sidecar; with it, exactly inject's pod.
    expected, _ = inject_object(pod, InjectOptions())
    assert pod != expected
    assert apply_patch(pod, patch) == expected
    names = [c["name"] for c in expected["spec"]["initContainers"]]
    assert names == ["streamwarden"]


async def test_an_egress_pod_gets_its_base_url_variables(review: Review) -> None:
    pod = replicaset_pod(
        {"streamwarden.io/mode": "egress", "streamwarden.io/upstream": "https://api.openai.com"}
    )
    patch = patch_of(await review(admission_review(pod)))
    assert patch is not None
    patched = apply_patch(pod, patch)
    assert patched == inject_object(pod, InjectOptions())[0]
    env = {e["name"]: e.get("value") for e in patched["spec"]["containers"][0]["env"]}
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8080/v1"


# -- what it skips, allowed, with a reason ------------------------------------------------


def _already_injected() -> dict[str, Any]:
    return inject_object(replicaset_pod(), InjectOptions())[0]


def _not_annotated() -> dict[str, Any]:
    pod = replicaset_pod()
    del pod["metadata"]["annotations"]
    return pod


def _malformed() -> dict[str, Any]:
    pod = replicaset_pod()
    pod["spec"]["containers"] = "chat-api"
    return pod


def _host_network() -> dict[str, Any]:
    pod = replicaset_pod()
    pod["spec"]["hostNetwork"] = True
    return pod


SKIPS: dict[str, tuple[dict[str, Any], str]] = {
    "not-annotated": (admission_review(_not_annotated()), "not annotated streamwarden.io/inject"),
    "already-injected": (admission_review(_already_injected()), "already injected"),
    "malformed-pod": (admission_review(_malformed()), "malformed pod: pod/chat-api-7d9f8b6c5d-*"),
    "not-a-pod": (
        admission_review({"kind": "Deployment", "apiVersion": "apps/v1"}, kind="Deployment"),
        "a Deployment is not a Pod",
    ),
    "update": (admission_review(replicaset_pod(), operation="UPDATE"), "operation UPDATE"),
    "delete": (admission_review(replicaset_pod(), operation="DELETE"), "operation DELETE"),
}


@pytest.mark.parametrize("case", list(SKIPS))
async def test_what_it_skips_is_allowed_unpatched_with_a_reason(case: str, review: Review) -> None:
    body, reason = SKIPS[case]
    answer = await review(body)
    response = answer["response"]
    assert response["allowed"] is True
    assert response["uid"] == body["request"]["uid"]
    assert patch_of(answer) is None
    assert reason in response["status"]["message"]


async def test_a_pod_that_asked_but_cannot_be_injected_carries_the_reason(
    review: Review,
) -> None:
    pod = _host_network()
    answer = await review(admission_review(pod))
    response = answer["response"]
    assert response["allowed"] is True
    assert "hostNetwork" in response["status"]["message"]
    # kubectl shows warnings to whoever created the pod's owner.
    assert any("hostNetwork" in w for w in response["warnings"])
    patch = patch_of(answer)
    assert patch is not None
    patched = apply_patch(pod, patch)
    assert "hostNetwork" in patched["metadata"]["annotations"][SKIPPED]
    del patched["metadata"]["annotations"][SKIPPED]
    assert patched == pod, "only the reason is added"


async def test_a_body_that_is_no_admission_review_is_a_400(webhook: Webhook) -> None:
    connector = aiohttp.TCPConnector(ssl=webhook.client_context())
    async with aiohttp.ClientSession(connector=connector) as session:
        for body, message in [
            (b"{not json", "Expecting"),
            (b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1beta1"}', "v1beta1"),
            (b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}', "uid"),
            (b"[" * 200_000 + b"]" * 200_000, "nested too deep"),
        ]:
            async with session.post(webhook.url, data=body) as response:
                assert response.status == 400
                assert message in (await response.json())["error"]
        # Bounded: a body over max_body_bytes (4 MiB) is refused unread.
        async with session.post(webhook.url, data=b"x" * (5 * 1024 * 1024)) as response:
            assert response.status == 413


# Any JSON value, put anywhere the rewrite reads or extends a pod.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
HOSTILE_PATHS = [
    ("metadata",),
    ("metadata", "annotations"),
    ("metadata", "annotations", "streamwarden.io/upstream-port"),
    ("metadata", "annotations", "streamwarden.io/mode"),
    ("spec",),
    ("spec", "containers"),
    ("spec", "containers", 0),
    ("spec", "containers", 0, "name"),
    ("spec", "containers", 0, "ports"),
    ("spec", "containers", 0, "ports", 0),
    ("spec", "containers", 0, "env"),
    ("spec", "containers", 0, "env", 0),
    ("spec", "containers", 0, "lifecycle"),
    ("spec", "initContainers"),
    ("spec", "volumes"),
    ("spec", "volumes", 0),
    ("spec", "hostNetwork"),
    ("spec", "terminationGracePeriodSeconds"),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(HOSTILE_PATHS), JSON)
def test_any_pod_gets_an_answer_and_a_patch_that_applies(
    path: tuple[str | int, ...], value: Any
) -> None:
    pod = replicaset_pod(
        {"streamwarden.io/mode": "egress", "streamwarden.io/upstream": "https://x"}
    )
    target: Any = pod
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    answer, _ = webhook_module.review(admission_review(pod), InjectOptions())
    response = answer["response"]
    assert response["allowed"] is True
    patch = patch_of(answer)
    if patch is not None:
        assert apply_patch(pod, patch) == inject_object(pod, InjectOptions())[0]


# -- TLS from files, reloaded ------------------------------------------------------------


async def _handshake(port: int, context: ssl.SSLContext) -> bool:
    """Whether a new TLS handshake with the webhook verifies under ``context``."""
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="localhost"
        )
    except ssl.SSLCertVerificationError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def test_a_renewed_certificate_is_served_without_a_restart(
    webhook: Webhook, tmp_path: Path
) -> None:
    new_ca = trustme.CA()
    old, new = webhook.client_context(), webhook.client_context(new_ca)
    assert await _handshake(webhook.port, old)
    assert not await _handshake(webhook.port, new), "the new CA does not sign the old cert"

    renewed = new_ca.issue_cert("127.0.0.1", "localhost")
    # Half-way through an update: the new certificate, the old key. It does not
    # load, so the old pair is still served.
    write_pair(renewed, tmp_path, key=False)
    assert await _handshake(webhook.port, old)
    write_pair(renewed, tmp_path)
    assert await _handshake(webhook.port, new)
    assert not await _handshake(webhook.port, old)
    assert webhook.certificates.reloads == 1


# -- the command --------------------------------------------------------------------------


async def test_the_command_serves_reviews_and_stops_on_sigterm(tmp_path: Path) -> None:
    ca = trustme.CA()
    write_pair(ca.issue_cert("127.0.0.1", "localhost"), tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "streamwarden.cli",
        "webhook",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        str(tmp_path / "tls.crt"),
        "--tls-key",
        str(tmp_path / "tls.key"),
        "--log-format",
        "text",
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert process.stderr is not None
    try:
        line = await asyncio.wait_for(process.stderr.readline(), timeout=30)
        found = re.search(rb"listening on 127\.0\.0\.1:(\d+)", line)
        assert found, line
        port = int(found.group(1))
        context = ssl.create_default_context()
        ca.configure_trust(context)
        connector = aiohttp.TCPConnector(ssl=context)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def healthy() -> bool:
                async with session.get(f"https://127.0.0.1:{port}/healthz") as response:
                    return response.status == 200

            await wait_until(healthy, what="the webhook's /healthz")
            pod = replicaset_pod()
            body = admission_review(pod)
            async with session.post(f"https://127.0.0.1:{port}/mutate", json=body) as response:
                answer = await response.json()
        patch = patch_of(answer)
        assert patch is not None
        assert apply_patch(pod, patch) == inject_object(pod, InjectOptions())[0]
        logged = await asyncio.wait_for(process.stderr.readline(), timeout=30)
        assert b"705ab4f5-6393-11e8-b7cc-42010a800002: pod/chat-api-7d9f8b6c5d-*: injected" in (
            logged
        )
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


#: A uid that would write a review's line of its own, were it logged raw.
FORGED_UID = (
    "705ab4f5\r\n2026-01-01 00:00:00,000 INFO streamwarden.webhook: admission review"
    " 00000000: FORGED\u2028FORGED-LS\x85FORGED-NEL\x1b[2K"
)


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_an_admission_uid_cannot_forge_a_log_line(tmp_path: Path, log_format: str) -> None:
    ca = trustme.CA()
    write_pair(ca.issue_cert("127.0.0.1", "localhost"), tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "streamwarden.cli", "webhook", "--listen", "127.0.0.1:0"),
        *("--tls-cert", str(tmp_path / "tls.crt"), "--tls-key", str(tmp_path / "tls.key")),
        *("--log-format", log_format),
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert process.stderr is not None
    try:
        first = await asyncio.wait_for(process.stderr.readline(), timeout=30)
        found = re.search(rb"listening on 127\.0\.0\.1:(\d+)", first)
        assert found, first
        context = ssl.create_default_context()
        ca.configure_trust(context)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            url = f"https://127.0.0.1:{int(found.group(1))}/mutate"
            body = admission_review(replicaset_pod(), uid=FORGED_UID)
            async with session.post(url, json=body) as response:
                assert (await response.json())["response"]["uid"] == FORGED_UID
        process.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(process.stderr.read(), timeout=30)
        assert await asyncio.wait_for(process.wait(), timeout=30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    output = (first + rest).decode()
    # One line for the start, one for the review, whatever splits them.
    assert output.splitlines() == output.split("\n")[:-1]
    lines = output.splitlines()
    assert len(lines) == 2, lines
    assert not re.search("[\x00-\x1f\x7f-\x9f\u2028\u2029]", "".join(lines))
    if log_format == "json":
        assert json.loads(lines[1])["msg"].startswith(f"admission review {FORGED_UID}: ")
    else:
        assert "admission review 705ab4f5\\r\\n2026-01-01 00:00:00,000 INFO" in lines[1]
        assert "FORGED\\u2028FORGED-LS\\x85FORGED-NEL\\x1b[2K: pod/" in lines[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"],
            "--tls-cert/--tls-key: /nonexistent.crt: No such file",
        ),
        (["--tls-key", "k"], "the following arguments are required: --tls-cert"),
        (["--tls-cert", "c", "--tls-key", "k", "--max-body-bytes", "lots"], "--max-body-bytes"),
        (["--tls-cert", "c", "--tls-key", "k", "--listen", "8443"], "--listen: '8443'"),
    ],
)
async def test_bad_flags_exit_2_with_one_line(args: list[str], message: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "streamwarden.cli",
        "webhook",
        *args,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 2
    assert len(stderr.decode().strip().splitlines()) == 1, stderr
    assert message in stderr.decode()
