"""The Responses API over a WebSocket is a stream through the sidecar, as its HTTP version is.

The openai SDK's ``client.responses.connect()`` yields the server's
events until the socket closes: a close with 1000 (or 1001) ends its loop
without a word, any other close code raises (``websockets``'
``ConnectionClosedError``, from ``_iter_events`` in
``openai/_websocket_connection.py``). So directly, an upstream that closes
with 1000 half-way through an answer is a silent truncation; one that
vanishes without a close frame (1006) raises. Through the sidecar each
``response.create`` is a stream: every fault reaches the SDK as the
``error`` event (``ResponseWsError``) and a 1011 close, a whole answer
reads the same, and the streams are metered under ``openai-responses``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from websockets.exceptions import ConnectionClosedError

from sidecars import StartSidecar
from streamwarden.core.messages import CUT_CLOSE_CODE, FORWARD, MessageSession
from streamwarden.core.meter import EndState
from streamwarden.core.relay import Limits, Relay
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer, mock_text
from waiting import wait_for, wait_until

TOKENS = 8


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1", max_retries=0)


async def converse(url: str, answers: int = 1, **controls: str) -> tuple[list[Any], str]:
    """Ask for ``answers`` responses in one session; the events and the text the SDK gave.

    Raises what the SDK raises.
    """
    events: list[Any] = []
    text = ""
    query = {"tokens": str(TOKENS), "tps": "0", "ttft": "0", **controls}
    async with client(url).responses.connect(extra_query=query) as connection:
        for _ in range(answers):
            await connection.response.create(model="gpt-4.1", input="hi")
            async for event in connection:
                events.append(event)
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type in ("response.completed", "error"):
                    break
        else:  # every answer whole: the client ends the session
            return events, text
    return events, text


async def metric(sidecar: Sidecar, name: str, *labels: str) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.admin_url + "/metrics") as response:
            text = await response.text()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(label in line for label in labels)
    )


DIALECT = 'dialect="openai-responses"'


async def test_directly_the_sdk_ends_silently_on_a_1000_close_and_raises_on_1006(
    mock: MockServer,
) -> None:
    events, text = await converse(mock.url, fault="truncate")
    assert text == mock_text(TOKENS // 2)  # half an answer, and not a word about it
    assert not any(event.type in ("error", "response.completed") for event in events)

    with pytest.raises(ConnectionClosedError):
        await converse(mock.url, fault="reset")


@pytest.mark.parametrize(
    ("fault", "settings", "code", "end_state"),
    [
        ("truncate", {}, "stream_truncated", "upstream_truncated"),
        ("reset", {}, "upstream_error", "upstream_error"),
        ("stall", {"upstream_idle_timeout": "300ms"}, "upstream_timeout", "upstream_timeout"),
        (
            "giant-event",
            {"max_event_bytes": "64KiB", "size": "131072"},
            "event_too_large",
            "limit_exceeded",
        ),
    ],
)
async def test_through_the_sidecar_every_fault_raises_after_an_error_event(
    mock: MockServer,
    start_sidecar: StartSidecar,
    fault: str,
    settings: dict[str, str],
    code: str,
    end_state: str,
) -> None:
    controls = {"fault": fault}
    if "size" in settings:
        controls["size"] = settings.pop("size")
    sidecar = await start_sidecar(mock.url, **settings)
    events: list[Any] = []
    with pytest.raises(ConnectionClosedError) as raised:
        async with (
            asyncio.timeout(30),
            client(sidecar.proxy_url).responses.connect(
                extra_query={"tokens": str(TOKENS), "tps": "0", "ttft": "0", **controls}
            ) as connection,
        ):
            await connection.response.create(model="gpt-4.1", input="hi")
            async for event in connection:
                events.append(event)
    assert raised.value.rcvd is not None and raised.value.rcvd.code == 1011
    error = events[-1]
    assert error.type == "error" and error.error.code == code, events[-1]
    assert code in error.error.message
    # The partial answer went through as it came, and no terminal event.
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert mock_text(TOKENS).startswith(deltas) and deltas != mock_text(TOKENS)
    await wait_until(lambda: _counted(sidecar, end_state), what=f"a stream counted {end_state}")


async def _counted(sidecar: Sidecar, end_state: str) -> bool:
    labels = (DIALECT, f'end_state="{end_state}"')
    return await metric(sidecar, "streamwarden_streams_total", *labels) == 1


async def test_whole_answers_read_the_same_through_the_sidecar_each_a_metered_stream(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    _, direct = await converse(mock.url, answers=2)
    assert direct == mock_text(TOKENS) * 2

    sidecar = await start_sidecar(mock.url)
    events, through = await converse(sidecar.proxy_url, answers=2)
    assert through == direct
    assert [e.type for e in events].count("response.completed") == 2
    await wait_until(lambda: _counted_twice(sidecar), what="two completed streams")
    assert await metric(sidecar, "streamwarden_tokens_generated_total", DIALECT) == 2 * TOKENS
    assert await metric(sidecar, "streamwarden_ttft_seconds_count", DIALECT) == 2


async def _counted_twice(sidecar: Sidecar) -> bool:
    labels = (DIALECT, 'end_state="completed"')
    return await metric(sidecar, "streamwarden_streams_total", *labels) == 2


async def test_a_client_that_leaves_mid_answer_closes_the_upstream_at_once(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    query = {"tokens": str(TOKENS), "tps": "0", "ttft": "0", "fault": "stall"}
    query["request-id"] = "leaves"
    async with client(sidecar.proxy_url).responses.connect(extra_query=query) as connection:
        await connection.response.create(model="gpt-4.1", input="hi")
        async for event in connection:
            if event.type == "response.output_text.delta":
                break  # the client has seen the answer start, and leaves
    # The mock (silent, mid-answer) hears its session close: the sidecar closed it.
    await wait_for(lambda: _ended(mock, "leaves"), what="the upstream session closed")
    await wait_until(
        lambda: _counted(sidecar, "client_cancelled"), what="a stream counted client_cancelled"
    )


def _ended(mock: MockServer, request_id: str) -> bool:
    record = mock.stats.get(request_id)
    return record is not None and record.ended


def test_lanes_of_one_session_are_each_a_stream_of_their_own() -> None:
    # The sans-I/O model alone: a response.create may name a lane
    # (stream_id), whose events echo it; lanes interleave.
    finished: list[Relay] = []

    def open_stream(started_at: float, now: float) -> Relay:
        limits = Limits(0.0, 60.0, 0.0, 1 << 20)
        return Relay(
            limits,
            started_at=started_at,
            now=now,
            path="/v1/responses",
            content_type=None,
            headers={},
            framing="messages",
        )

    def message(kind: str, lane: str, **fields: Any) -> str:
        return json.dumps({"type": kind, "stream_id": lane, **fields})

    session = MessageSession(open_stream, lambda relay, now: finished.append(relay))
    for lane in ("a", "b"):
        assert session.client_message(json.dumps({"type": "response.create", "stream_id": lane}), 0)
    for lane in ("a", "b"):
        delta = message("response.output_text.delta", lane, delta="hi", output_index=0)
        assert session.upstream_message(delta, 1.0) is FORWARD
    usage = {"usage": {"output_tokens": 1, "input_tokens": 1}}
    session.upstream_message(message("response.completed", "a", response=usage), 2.0)
    assert [relay.end_state for relay in finished] == [EndState.COMPLETED]

    closing = session.upstream_closed(1000, 3.0)  # a normal close, with lane b mid-answer
    assert closing.code == CUT_CLOSE_CODE
    assert closing.error is not None and json.loads(closing.error)["code"] == "stream_truncated"
    session.end(4.0)
    assert [relay.end_state for relay in finished] == [
        EndState.COMPLETED,
        EndState.UPSTREAM_TRUNCATED,
    ]


def test_a_response_past_the_sessions_books_is_refused_not_forwarded_unread() -> None:
    # Past MAX_TRACKED open and queued responses, one more was once forwarded
    # untracked: no filters, no limits, no meter for it.
    from streamwarden.core.messages import MAX_TRACKED

    def open_stream(started_at: float, now: float) -> Relay:
        limits = Limits(0.0, 60.0, 0.0, 1 << 20)
        return Relay(
            limits, started_at=started_at, now=now, path="/v1/responses",
            content_type=None, headers={}, framing="messages",
        )  # fmt: skip

    session = MessageSession(open_stream, lambda relay, now: None)
    create = json.dumps({"type": "response.create"})
    for _ in range(MAX_TRACKED):
        assert session.client_reply(create, 0.0).forward  # one answered, the rest queued
    one_more = json.dumps({"type": "response.create", "stream_id": "x"})
    reply = session.client_reply(one_more, 0.0)
    assert not reply.forward
    assert reply.answer is not None
    refusal = json.loads(reply.answer)
    assert refusal["type"] == "error" and refusal["stream_id"] == "x"
    assert refusal["error"]["code"] == "too_many_streams"
