"""Resume across replicas: two sidecars sharing a real ``redis-server``.

A client cut on one replica reconnects to the other with its last event id
and gets the missing events, then the rest live, from the one generation
the first replica still reads. Redis going away must not touch a live
stream; resumes then say ``resume_unavailable``; Redis coming back makes
new streams resumable again without restarting anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from resume_client import KEY, TOKENS, cut_after, mock_headers, read_events, resume, text_of
from resume_cuts import (
    SHAPES,
    assert_as_direct,
    assert_exact,
    chat_body,
    cut_everywhere,
    read_direct,
    scripted_chat,
)
from sidecars import StartSidecar
from streamwarden.features.resume.model import STREAM_ID_HEADER
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer
from streamwarden.tools.mock.tokens import mock_text
from waiting import wait_for, wait_until

CHAT = "/v1/chat/completions"
REDIS = shutil.which("redis-server")

pytestmark = pytest.mark.skipif(REDIS is None, reason="needs Debian's redis-server")


class RedisServer:
    """A real redis-server on a free loopback port, nothing persisted."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS is not None
        self.process = subprocess.Popen(
            [
                REDIS,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    async def ready(self) -> None:
        async def answers() -> bool:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                return False
            writer.write(b"PING\r\n")
            line = await reader.readline()
            writer.close()
            return line.startswith(b"+PONG")

        await wait_until(answers, what="redis-server answers PING")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.kill()


@pytest.fixture
async def replicas(
    mock: MockServer, start_sidecar: StartSidecar, redis_server: RedisServer
) -> AsyncIterator[tuple[Sidecar, Sidecar]]:
    await redis_server.ready()
    settings = {"on_client_gone": "detach", "resume_store": redis_server.url}
    # A short window on the first replica: only the resumed client's hold,
    # written on the other replica, keeps its upstream running past it.
    first = await start_sidecar(mock.url, resume_window="500ms", **settings)
    second = await start_sidecar(mock.url, resume_window="500ms", **settings)
    yield first, second


async def test_a_client_cut_on_one_replica_resumes_on_the_other(
    mock: MockServer, replicas: tuple[Sidecar, Sidecar]
) -> None:
    first, second = replicas
    tokens = 40
    stream_id, head = await cut_after(first.proxy_url, "across", 5, tps=20, tokens=tokens)
    await wait_for(lambda: first.metrics.detached._value.get() == 1, what="detached")
    async with aiohttp.ClientSession() as session:
        async with session.get(
            second.proxy_url + CHAT, headers={**KEY, "Last-Event-ID": head[-1].id or ""}
        ) as again:
            assert again.headers[STREAM_ID_HEADER] == stream_id
            rest = await read_events(again)
    ids = [event.id for event in head + rest]
    assert ids == [f"{stream_id}.{n}" for n in range(1, len(ids) + 1)]
    assert rest[-1].data == "[DONE]"
    assert text_of(head + rest) == mock_text(tokens)
    assert len(mock.stats.records) == 1  # one generation
    upstream = await mock.stats.wait_ended("across")
    assert upstream.completed  # held past the first replica's 500 ms window
    await wait_for(lambda: len(first.tracker.finished) == 1)
    assert first.tracker.finished[-1].meter.end_state == "completed"
    assert 'streamwarden_resumes_total{result="ok"} 1.0' in second.metrics.render().decode()


@pytest.mark.parametrize("asks_usage", [False, True], ids=["plain", "asks-usage"])
async def test_a_resume_on_the_other_replica_gets_exactly_the_events_not_seen(
    replicas: tuple[Sidecar, Sidecar], asks_usage: bool
) -> None:
    first, second = replicas
    whole, cuts = await cut_everywhere(
        first.proxy_url + CHAT,
        mock_headers("exact", tps=200, tokens=8),
        chat_body(asks_usage),
        resume_url=second.proxy_url + CHAT,
    )
    assert len(whole) == 11 + asks_usage
    assert_exact(whole, cuts)


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_a_resume_on_the_other_replica_is_exact_whatever_the_upstream_ends_with(
    start_sidecar: StartSidecar, redis_server: RedisServer, shape: str
) -> None:
    await redis_server.ready()
    settings = {"on_client_gone": "detach", "resume_store": redis_server.url}
    async with scripted_chat() as upstream:
        first = await start_sidecar(upstream, **settings)
        second = await start_sidecar(upstream, **settings)
        # A client that asks for no usage: the sidecar may add the option.
        direct = await read_direct(f"{upstream}/{shape}{CHAT}", KEY, chat_body(asks_usage=False))
        whole, cuts = await cut_everywhere(
            f"{first.proxy_url}/{shape}{CHAT}",
            KEY,
            chat_body(asks_usage=False),
            resume_url=f"{second.proxy_url}/{shape}{CHAT}",
        )
    assert_as_direct(whole, direct)  # a usage chunk of the upstream's own included
    assert_exact(whole, cuts)


async def test_a_resume_with_other_credentials_on_another_replica_is_refused(
    mock: MockServer, replicas: tuple[Sidecar, Sidecar]
) -> None:
    first, second = replicas
    async with aiohttp.ClientSession() as session:
        async with session.post(
            first.proxy_url + CHAT, headers=mock_headers("theirs"), json={"stream": True}
        ) as response:
            events = await read_events(response)
    await wait_for(lambda: len(first.tracker.finished) == 1)
    position = events[2].id or ""

    async def stored() -> bool:  # the writer is off the hot path: wait for it
        _, _, _, body = await resume(second.proxy_url, position)
        return b"[DONE]" in body

    await wait_until(stored, what="the stream's events reach Redis")
    _, _, _, stranger = await resume(
        second.proxy_url, position, headers={"Authorization": "Bearer sk-else"}
    )
    _, _, _, unknown = await resume(second.proxy_url, "a" * 32 + ".3")
    assert stranger == unknown and b"resume_expired" in stranger
    _, _, rest, _ = await resume(second.proxy_url, position)
    assert text_of(events[:3] + rest) == mock_text(TOKENS)


async def test_with_a_resume_secret_the_stored_owner_is_useless_without_it(
    mock: MockServer, start_sidecar: StartSidecar, redis_server: RedisServer
) -> None:
    import redis.asyncio as redis_asyncio

    from streamwarden.features.resume.model import owner_digest

    await redis_server.ready()
    secret = {"resume_secret": "s" * 40}
    settings = {"on_client_gone": "detach", "resume_store": redis_server.url}
    first = await start_sidecar(mock.url, **settings, **secret)
    second = await start_sidecar(mock.url, **settings, **secret)
    other = await start_sidecar(mock.url, **settings, resume_secret="o" * 40)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            first.proxy_url + CHAT, headers=mock_headers("keyed"), json={"stream": True}
        ) as response:
            stream_id = response.headers[STREAM_ID_HEADER]
            events = await read_events(response)
    position = events[2].id or ""

    async def stored() -> bool:  # the writer is off the hot path: wait for it
        _, _, _, body = await resume(second.proxy_url, position)
        return b"[DONE]" in body

    await wait_until(stored, what="the stream reaches Redis, resumable on the other replica")
    client = redis_asyncio.Redis.from_url(redis_server.url)
    try:
        kept = await client.hget(f"streamwarden:m:{stream_id}", "owner")
    finally:
        await client.aclose()
    # The stored digest is not the one the credentials give without the secret.
    assert kept is not None
    assert kept.decode() != owner_digest(KEY.items(), stream_id)
    assert kept.decode() == owner_digest(KEY.items(), stream_id, secret="s" * 40)
    # A replica with another secret cannot tell the owner: as if unknown.
    _, _, _, refused = await resume(other.proxy_url, position)
    assert b"resume_expired" in refused


async def test_redis_killed_mid_stream_leaves_the_live_stream_untouched(
    mock: MockServer, replicas: tuple[Sidecar, Sidecar], redis_server: RedisServer
) -> None:
    first, second = replicas
    tokens = 40
    async with aiohttp.ClientSession() as session:
        async with session.post(
            first.proxy_url + CHAT,
            headers=mock_headers("unharmed", tps=40, tokens=tokens),
            json={"stream": True},
        ) as response:
            head = await read_events(response, until=lambda got: len(got) >= 5)
            redis_server.kill()
            rest = await read_events(response)
    assert rest[-1].data == "[DONE]"
    assert text_of(head + rest) == mock_text(tokens)  # every event, in order
    status, _, _, body = await resume(second.proxy_url, head[-1].id or "")
    assert status == 200 and b"resume_unavailable" in body
    metrics = second.metrics.render().decode()
    assert 'streamwarden_resumes_total{result="unavailable"} 1.0' in metrics

    # Redis comes back (empty): new streams are resumable again, no restart.
    redis_server.start()
    await redis_server.ready()

    async def offered() -> bool:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                first.proxy_url + CHAT,
                headers=mock_headers("probe", tokens=2),
                json={"stream": True},
            ) as response:
                await response.read()
                return STREAM_ID_HEADER in response.headers

    await wait_until(offered, what="new streams are offered for resume again")
    _, again_head = await cut_after(first.proxy_url, "after", 3, tps=20, tokens=tokens)
    async with aiohttp.ClientSession() as session:
        async with session.get(
            second.proxy_url + CHAT, headers={**KEY, "Last-Event-ID": again_head[-1].id or ""}
        ) as again:
            again_rest = await read_events(again)
    assert text_of(again_head + again_rest) == mock_text(tokens)


async def test_an_unreachable_redis_never_puts_its_password_in_a_log_line(
    mock: MockServer, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"redis://:hunter2-secret@127.0.0.1:{port}/0"
    with caplog.at_level("DEBUG"):
        sidecar = await start_sidecar(mock.url, on_client_gone="detach", resume_store=url)
        async with aiohttp.ClientSession() as session:
            async with session.post(
                sidecar.proxy_url + CHAT, headers=mock_headers("no-redis"), json={"stream": True}
            ) as response:
                events = await read_events(response)
        assert events[-1].data == "[DONE]"  # the live stream does not need Redis
        status, _, _, body = await resume(sidecar.proxy_url, "b" * 32 + ".1")
        assert status == 200 and b"resume_unavailable" in body
        await wait_for(
            lambda: "resume store" in caplog.text, what="a warning that the store is unreachable"
        )
    assert "hunter2" not in caplog.text
    assert f"127.0.0.1:{port}" in caplog.text  # which store, without its secret


async def test_a_stop_sent_to_the_other_replica_stops_the_stream_where_it_runs(
    mock: MockServer, replicas: tuple[Sidecar, Sidecar]
) -> None:
    first, second = replicas
    stream_id, _ = await cut_after(first.proxy_url, "stopped-elsewhere", 2, tps=20, tokens=2000)
    await wait_for(lambda: first.metrics.detached._value.get() == 1, what="detached")
    stop = {STREAM_ID_HEADER: stream_id}
    async with aiohttp.ClientSession() as session:

        async def known_to_redis() -> bool:  # its owner reaches Redis off the hot path
            async with session.delete(
                second.proxy_url + CHAT, headers={"Authorization": "Bearer sk-else", **stop}
            ) as refused:
                assert refused.status == 404  # not the owner's: as if unknown
            return len(await second.proxy.resume.backend.lookup(stream_id) or ()) == 2  # type: ignore[union-attr]

        await wait_until(known_to_redis, what="the stream's owner in Redis")
        async with session.delete(second.proxy_url + CHAT, headers={**KEY, **stop}) as stopped:
            assert stopped.status == 204
    upstream = await mock.stats.wait_ended("stopped-elsewhere")
    assert upstream.closed_early and upstream.tokens_generated < 2000
    await wait_for(lambda: len(first.tracker.finished) == 1)
    assert first.tracker.finished[-1].meter.end_state == "client_cancelled"


async def test_a_stop_of_a_stream_that_already_ended_is_a_404_on_every_replica(
    mock: MockServer, replicas: tuple[Sidecar, Sidecar]
) -> None:
    first, second = replicas
    async with aiohttp.ClientSession() as session:
        async with session.post(
            first.proxy_url + CHAT, headers=mock_headers("ended-stop"), json={"stream": True}
        ) as response:
            stream_id = response.headers[STREAM_ID_HEADER]
            events = await read_events(response)
        assert events[-1].data == "[DONE]"
        stop = {**KEY, STREAM_ID_HEADER: stream_id}

        async def ended_in_redis() -> bool:  # the end reaches Redis off the hot path
            status, _, rest, _ = await resume(second.proxy_url, f"{stream_id}.1")
            return status == 200 and bool(rest) and rest[-1].data == "[DONE]"

        await wait_until(ended_in_redis, what="the stream's end in Redis")
        # Nothing runs to be stopped: the same answer as the memory store gives.
        for replica in (first, second):
            async with session.delete(replica.proxy_url + CHAT, headers=stop) as answered:
                assert answered.status == 404


async def test_a_hole_in_the_stored_stream_is_told_after_the_events_before_it(
    mock: MockServer, replicas: tuple[Sidecar, Sidecar], redis_server: RedisServer
) -> None:
    import redis.asyncio as redis_asyncio

    first, second = replicas
    async with aiohttp.ClientSession() as session:
        async with session.post(
            first.proxy_url + CHAT, headers=mock_headers("holed"), json={"stream": True}
        ) as response:
            stream_id = response.headers[STREAM_ID_HEADER]
            events = await read_events(response)
    client = redis_asyncio.Redis.from_url(redis_server.url)

    async def stored() -> bool:  # the writer is off the hot path: wait for the end entry
        return bool(await client.xrange(f"streamwarden:s:{stream_id}", f"{len(events)}-1", "+"))

    await wait_until(stored, what="the stream's end in Redis")
    # A write that never made it (a dropped batch, say): event 6 is missing.
    await client.xdel(f"streamwarden:s:{stream_id}", "6-0")
    await client.aclose()
    _, _, rest, _ = await resume(second.proxy_url, f"{stream_id}.2")
    assert [e.id for e in rest[:-1]] == [f"{stream_id}.{n}" for n in (3, 4, 5)]
    assert "resume_gap" in rest[-1].data


@contextlib.asynccontextmanager
async def writes_held(redis_server: RedisServer, milliseconds: int) -> AsyncIterator[None]:
    """Redis takes no write for a while; reads go on (``CLIENT PAUSE ... WRITE``).

    As a loaded Redis or a writer busy with a long batch would: one replica's
    writes wait while another replica's reads are answered at once.
    """
    import redis.asyncio as redis_asyncio

    client = redis_asyncio.Redis.from_url(redis_server.url)
    try:
        await client.execute_command("CLIENT", "PAUSE", milliseconds, "WRITE")
        yield
    finally:
        await client.aclose()


#: Long beside the few milliseconds a client takes to resume after its first
#: event, short beside the writer's timeout (READ_TIMEOUT, 2 s).
HELD_MS = 1000


async def test_a_resume_sent_to_the_other_replica_the_instant_the_first_event_arrives_finds_it(
    mock: MockServer, replicas: tuple[Sidecar, Sidecar], redis_server: RedisServer
) -> None:
    first, second = replicas
    tokens = 20
    async with writes_held(redis_server, HELD_MS), aiohttp.ClientSession() as session:
        async with session.post(
            first.proxy_url + CHAT,
            headers=mock_headers("instant", tps=50, tokens=tokens),
            json={"stream": True},
        ) as response:
            stream_id = response.headers[STREAM_ID_HEADER]
            head = await read_events(response, until=lambda got: len(got) >= 1)
            # At once, on the other replica: no waiting for the store.
            async with session.get(
                second.proxy_url + CHAT, headers={**KEY, "Last-Event-ID": head[-1].id or ""}
            ) as again:
                rest = await read_events(again)
    assert "resume_expired" not in rest[-1].data
    ids = [event.id for event in head + rest]
    assert ids == [f"{stream_id}.{n}" for n in range(1, len(ids) + 1)]
    assert rest[-1].data == "[DONE]" and text_of(head + rest) == mock_text(tokens)
    assert len(mock.stats.records) == 1  # one generation


async def test_through_the_middleware_too_a_resume_on_the_other_app_finds_the_stream_at_once(
    redis_server: RedisServer,
) -> None:
    from paced_model import TOKENS as APP_TOKENS
    from paced_model import Model, served

    await redis_server.ready()
    options = {"on_client_gone": "detach", "resume_store": redis_server.url}
    model = Model(pace=0.02)
    async with served(model, **options) as (one, _), served(model, **options) as (other, _):
        async with writes_held(redis_server, HELD_MS), aiohttp.ClientSession() as session:
            async with session.post(one + CHAT, headers=KEY, json={"stream": True}) as response:
                stream_id = response.headers[STREAM_ID_HEADER]
                head = await read_events(response, until=lambda got: len(got) >= 1)
                async with session.post(
                    other + CHAT,
                    headers={**KEY, "Last-Event-ID": head[-1].id or ""},
                    json={"stream": True},
                ) as again:
                    rest = await read_events(again)
    assert "resume_expired" not in rest[-1].data
    ids = [event.id for event in head + rest]
    assert ids == [f"{stream_id}.{n}" for n in range(1, len(ids) + 1)]
    assert rest[-1].data == "[DONE]" and len(ids) == APP_TOKENS + 1
    assert model.generations == 1  # the resume never reached the other app
