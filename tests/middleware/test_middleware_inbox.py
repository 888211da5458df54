"""The middleware's receive channel: one caller of the server's receive() at a time.

A scripted server stands in for uvicorn/hypercorn: ``receive()`` hands out
queued messages and counts how many callers wait in it at once, which must
never be more than one (hypercorn gives each message to a single waiter).
"""

from __future__ import annotations

import asyncio
from typing import Any

from streamwarden.middleware.inbox import Inbox

Message = dict[str, Any]


class ScriptedServer:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.waiting = 0
        self.most_waiting = 0

    async def receive(self) -> Message:
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            return await self.queue.get()
        finally:
            self.waiting -= 1

    def deliver(self, message: Message) -> None:
        self.queue.put_nowait(message)


def body(data: bytes, more: bool) -> Message:
    return {"type": "http.request", "body": data, "more_body": more}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_app_reads_the_server_directly_until_a_stream_is_watched() -> None:
    server = ScriptedServer()
    inbox = Inbox(server.receive)
    server.deliver(body(b"a", more=False))
    assert await inbox.receive() == body(b"a", more=False)
    assert server.most_waiting == 1


async def test_the_watcher_keeps_what_it_receives_for_the_app_in_order() -> None:
    server = ScriptedServer()
    inbox = Inbox(server.receive)
    gone: list[str] = []
    inbox.watch(lambda: gone.append("gone"))
    server.deliver(body(b"a", more=True))
    server.deliver(body(b"b", more=False))
    await settle()
    assert gone == []
    assert await inbox.receive() == body(b"a", more=True)
    assert await inbox.receive() == body(b"b", more=False)
    server.deliver({"type": "http.disconnect"})
    await settle()
    assert gone == ["gone"]
    assert await inbox.receive() == {"type": "http.disconnect"}
    assert await inbox.receive() == {"type": "http.disconnect"}  # every time, at once
    assert server.most_waiting == 1
    await inbox.stop()


async def test_an_app_waiting_in_receive_gets_the_watchers_message_not_a_second_wait() -> None:
    server = ScriptedServer()
    inbox = Inbox(server.receive)
    inbox.watch(lambda: None)
    await settle()  # the watcher now waits in the server's receive()
    app_call = asyncio.ensure_future(inbox.receive())
    await settle()
    assert server.waiting == 1
    server.deliver(body(b"late", more=False))
    assert await asyncio.wait_for(app_call, 1) == body(b"late", more=False)
    assert server.most_waiting == 1
    await inbox.stop()


async def test_the_watcher_stands_aside_while_the_app_waits_itself() -> None:
    # Starlette's listen_for_disconnect is already waiting when the stream starts.
    server = ScriptedServer()
    inbox = Inbox(server.receive)
    gone: list[str] = []
    app_call = asyncio.ensure_future(inbox.receive())
    await settle()
    inbox.watch(lambda: gone.append("gone"))
    await settle()
    assert server.waiting == 1
    server.deliver({"type": "http.disconnect"})
    assert await asyncio.wait_for(app_call, 1) == {"type": "http.disconnect"}
    assert gone == ["gone"]  # seen by the app's call, reported all the same
    assert server.most_waiting == 1
    await inbox.stop()


async def test_an_app_call_cancelled_hands_the_wait_back_to_the_watcher() -> None:
    server = ScriptedServer()
    inbox = Inbox(server.receive)
    gone: list[str] = []
    app_call = asyncio.ensure_future(inbox.receive())
    await settle()
    inbox.watch(lambda: gone.append("gone"))
    app_call.cancel()  # e.g. Starlette's task group ends its listener
    await settle()
    assert server.waiting == 1  # the watcher took over
    server.deliver({"type": "http.disconnect"})
    await settle()
    assert gone == ["gone"]
    await inbox.stop()


async def test_stopping_the_watcher_returns_the_app_to_the_server() -> None:
    server = ScriptedServer()
    inbox = Inbox(server.receive)
    inbox.watch(lambda: None)
    await settle()
    app_call = asyncio.ensure_future(inbox.receive())
    await settle()
    await inbox.stop()
    await settle()
    assert server.waiting == 1  # now the app's own call
    server.deliver(body(b"x", more=False))
    assert await asyncio.wait_for(app_call, 1) == body(b"x", more=False)


async def test_a_disconnect_seen_before_watching_is_reported_at_once() -> None:
    server = ScriptedServer()
    inbox = Inbox(server.receive)
    server.deliver({"type": "http.disconnect"})
    assert (await inbox.receive())["type"] == "http.disconnect"
    gone: list[str] = []
    inbox.watch(lambda: gone.append("gone"))
    assert gone == ["gone"]
    await inbox.stop()


async def test_a_websocket_inbox_holds_one_message_and_gives_the_servers_disconnect() -> None:
    # A WebSocket session's app reads its client all session long: a client
    # that floods while the app answers is held back by the server, not here.
    server = ScriptedServer()
    inbox = Inbox(server.receive, disconnect="websocket.disconnect", hold_at_most=1)
    gone: list[str] = []
    inbox.watch(lambda: gone.append("gone"))
    for n in range(3):
        server.deliver({"type": "websocket.receive", "text": str(n)})
    server.deliver({"type": "websocket.disconnect", "code": 1001})
    await settle()
    assert server.queue.qsize() == 3  # one message taken, the rest still the server's
    assert gone == []
    for n in range(3):
        assert await inbox.receive() == {"type": "websocket.receive", "text": str(n)}
    await settle()
    assert gone == ["gone"]
    # The server's own disconnect message, its close code in it (Starlette reads it).
    assert await inbox.receive() == {"type": "websocket.disconnect", "code": 1001}
    assert server.most_waiting == 1
    await inbox.stop()
