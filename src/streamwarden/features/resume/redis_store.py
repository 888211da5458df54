"""The Redis resume store: a stream cut on one replica resumes on any other.

Layout, per stream id (all keys expire):

- ``streamwarden:s:<id>``: a Redis Stream, one entry per event, the
  event's sequence number as the entry id (``<seq>-0``) and its bytes in
  field ``d``; the end is one more entry, ``<last seq>-1``, with field
  ``end`` (the end state). Replay is ``XRANGE`` from just after the
  client's position, live continuation ``XREAD BLOCK`` from the last one.
- ``streamwarden:m:<id>``: a hash with the owner digest and the dialect.
- ``streamwarden:h:<id>``: the hold of a resumed client (``PX`` lease):
  the original replica looks at it when its ``resume_window`` runs out.
- the channel ``streamwarden:stop``: a replica asked to stop a stream that
  runs on another publishes its id; every replica subscribes and stops it
  where it runs.

A stream's events never wait on Redis. Its head waits for one write, its
owner's (one round trip; ``READ_TIMEOUT`` at most), because the head names
the stream's id and a client may resume on another replica the instant it
has it: a stream that exists must never be told it expired. That write,
like every other, goes through the writer: a journal's writes go into one
bounded queue that a single writer task sends in batches, each batch one
call of a small Lua script (:data:`APPLY`) that makes all of its writes:
one command and one reply per batch instead of one per event, which is
what a pipeline of XADD commands costs the client in Python; when
Redis is slow or down the queue fills and further writes are dropped
(counted, logged at most once a minute), live streams go on untouched,
new streams are not offered for resume (no ids, no header) until a write
succeeds again, and resumes answer ``resume_unavailable``. A stream whose
writes were dropped has a hole in its sequence, which a resume reports as
``resume_gap``, never as text that silently skips.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as redis_asyncio
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from streamwarden.config import Settings
from streamwarden.core.headers import redact_url
from streamwarden.core.journal import JournalSink
from streamwarden.features.resume.store import Batch, StoreUnavailable
from streamwarden.observation.logs import RateLimitedWarnings
from streamwarden.observation.metrics import StreamMetrics

__all__ = ["RedisBackend"]

log = logging.getLogger("streamwarden.resume")

#: Most writes, and most bytes of events, waiting for Redis; past either,
#: writes are dropped (and counted): events can be megabytes each.
MAX_QUEUED_WRITES = 20_000
MAX_QUEUED_BYTES = 64 * 1024 * 1024
#: Most writes sent in one call of the script.
BATCH = 512
#: Longest a resume's read may wait for Redis beyond its own wait.
READ_TIMEOUT = 2.0
#: Most events read in one replay step.
READ_COUNT = 256
#: Where a replica asks the others to stop a stream (an owner's DELETE).
STOP_CHANNEL = "streamwarden:stop"

#: One queued write: (operation, key, operand, operand); see APPLY.
Command = tuple[str, str, Any, Any]

#: Makes a batch of writes. KEYS[i] is the key of the i-th write and
#: ARGV[3i-2..3i] its operation and operands: "o" HSET owner <owner> dialect
#: <dialect> (a new stream's meta: one write, so one batch settles it), "a"
#: XADD <id> d <data>, "z" XADD <id> end <state> (the stream's end), "h" HSET
#: <field> <value>, "e" PEXPIRE <ms>, "t" XTRIM MINID <id>. pcall: one failed
#: write (a stream whose Redis restarted under it) does not lose the rest of
#: the batch.
#: The last ARGV is the TTL a key gets if it has none yet: whatever writes
#: were dropped before it, no key of ours is left without an expiry.
APPLY = """
local ttl = ARGV[#ARGV]
for i = 1, #KEYS do
  local op, a, b = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  if op == "a" then redis.pcall("XADD", KEYS[i], a, "d", b)
  elseif op == "o" then redis.pcall("HSET", KEYS[i], "owner", a, "dialect", b)
  elseif op == "z" then redis.pcall("XADD", KEYS[i], a, "end", b)
  elseif op == "h" then redis.pcall("HSET", KEYS[i], a, b)
  elseif op == "e" then redis.pcall("PEXPIRE", KEYS[i], a)
  elseif op == "t" then redis.pcall("XTRIM", KEYS[i], "MINID", a)
  end
  if op ~= "e" and redis.call("PTTL", KEYS[i]) == -1 then
    redis.pcall("PEXPIRE", KEYS[i], ttl)
  end
end
return #KEYS
"""


def _keys(stream_id: str) -> tuple[str, str, str]:
    return (
        f"streamwarden:s:{stream_id}",
        f"streamwarden:m:{stream_id}",
        f"streamwarden:h:{stream_id}",
    )


def _seq(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    left, _, right = text.partition("-")
    return int(left), int(right or 0)


class _RedisJournal:
    """One stream's writes, queued for the writer (a :class:`JournalSink`)."""

    __slots__ = ("_backend", "_bytes", "_first_kept", "_keys", "_sizes")

    def __init__(self, backend: RedisBackend, stream_id: str) -> None:
        self._backend = backend
        self._keys = _keys(stream_id)
        self._bytes = 0
        self._sizes: deque[int] = deque()
        self._first_kept = 1

    def append(self, seq: int, data: bytes) -> None:
        backend = self._backend
        events, meta, _ = self._keys
        backend.enqueue(("a", events, f"{seq}-0", data))
        self._sizes.append(len(data))
        self._bytes += len(data)
        trimmed = False
        while self._bytes > backend.max_stream_bytes and len(self._sizes) > 1:
            self._bytes -= self._sizes.popleft()
            self._first_kept += 1
            trimmed = True
        if trimmed:
            backend.enqueue(("t", events, f"{self._first_kept}-0", ""))
        if seq % 64 == 1:
            # While it runs, a stream outlives its TTL (long answers).
            backend.enqueue(("e", events, backend.live_ttl_ms, ""))
            backend.enqueue(("e", meta, backend.live_ttl_ms, ""))

    def end(self, state: str, dialect: str) -> None:
        backend = self._backend
        events, meta, _ = self._keys
        last = self._first_kept - 1 + len(self._sizes)
        backend.enqueue(("z", events, f"{last}-1", state))
        backend.enqueue(("h", meta, "dialect", dialect))
        backend.enqueue(("e", events, backend.ended_ttl_ms, ""))
        backend.enqueue(("e", meta, backend.ended_ttl_ms, ""))


class RedisBackend:
    """Resumable streams in Redis, shared by every replica that points at it."""

    def __init__(self, url: str, settings: Settings, metrics: StreamMetrics | None = None) -> None:
        self._url = url
        self._shown = redact_url(url)
        self._metrics = metrics
        self.max_stream_bytes = settings.resume_max_bytes
        self.ended_ttl_ms = max(1, int(settings.resume_ttl * 1000))
        # A running stream's keys live as long as it may run, plus its TTL.
        self.live_ttl_ms = int((settings.max_stream_duration or 86400.0) * 1000) + self.ended_ttl_ms
        self._client: redis_asyncio.Redis | None = None
        self._queue: deque[Command] = deque()
        self._queued_bytes = 0
        self._queued = asyncio.Event()
        #: Writes ever taken into the queue, and ever settled (applied or lost):
        #: a write's number says which batch settles it.
        self._taken = 0
        self._settled = 0
        #: New streams' meta writes still under way, by stream id: the write's
        #: number, its outcome, and the timer that gives up on it.
        self._storing: dict[str, tuple[int, asyncio.Future[bool], asyncio.TimerHandle]] = {}
        self._writer: asyncio.Task[None] | None = None
        self._apply: AsyncScript | None = None
        self._listener: asyncio.Task[None] | None = None
        #: Called with a stream id that another replica asked to stop.
        self.on_stop: Callable[[str], None] | None = None
        #: The last write round trip succeeded: new streams are offered for resume.
        self.healthy = True
        self._warnings = RateLimitedWarnings(60.0, log)
        if metrics is not None:
            metrics.store_queue.set_function(lambda: float(len(self._queue)))

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        self._client = redis_asyncio.Redis.from_url(
            self._url, socket_connect_timeout=1.0, health_check_interval=0
        )
        # EVALSHA, loading the script again after a Redis restart (NOSCRIPT).
        self._apply = self._client.register_script(APPLY)
        self._writer = asyncio.create_task(self._write_loop(), name="streamwarden-redis-writer")
        self._listener = asyncio.create_task(self._listen_for_stops(), name="streamwarden-stops")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        if self._writer is not None:
            # What is still queued gets one last chance.
            with contextlib.suppress(asyncio.TimeoutError, RedisError, OSError):
                async with asyncio.timeout(1.0):
                    while self._queue and self.healthy:
                        await self._flush()
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        self._settle(len(self._queue), applied=False)  # never to be written now
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- writes (never awaited by a stream) ------------------------------------

    def open(self, stream_id: str, owner: str, dialect: str) -> JournalSink | None:
        if not self.healthy:
            return None  # nothing would be kept: the stream is not offered for resume
        _, meta, _ = _keys(stream_id)
        # Its TTL is APPLY's (the live one): the key has none yet.
        if not self.enqueue(("o", meta, owner, dialect)):
            return None
        # A future, not a coroutine: nothing is left unawaited if the head never goes out.
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[bool] = loop.create_future()
        gives_up = loop.call_later(READ_TIMEOUT, _resolve, outcome, False)
        self._storing[stream_id] = (self._taken, outcome, gives_up)
        return _RedisJournal(self, stream_id)

    def storing(self, stream_id: str) -> Awaitable[bool] | None:
        """The write that makes a stream just opened findable, if still under way.

        Its response head waits for it, ``READ_TIMEOUT`` at most (then
        False): a client may resume on another replica the instant it has
        the id, and a stream that exists must never be told it expired.
        """
        storing = self._storing.get(stream_id)
        return None if storing is None else storing[1]

    def enqueue(self, command: Command) -> bool:
        """Queue a write for the writer; False if the queue is full (the write is dropped)."""
        size = len(command[3]) if command[0] == "a" else 0
        if len(self._queue) >= MAX_QUEUED_WRITES or self._queued_bytes + size > MAX_QUEUED_BYTES:
            self._error("the write queue is full")
            return False
        self._queue.append(command)
        self._queued_bytes += size
        self._taken += 1
        self._queued.set()
        return True

    def _settle(self, count: int, applied: bool) -> None:
        """The next ``count`` writes were applied or lost: tell the streams that wait on theirs."""
        self._settled += count
        if not self._storing:
            return
        settled = self._settled
        done: list[str] = []
        for stream_id, (number, _, _) in self._storing.items():  # in the order they were taken
            if number > settled:
                break
            done.append(stream_id)
        for stream_id in done:
            _, outcome, gives_up = self._storing.pop(stream_id)
            gives_up.cancel()
            _resolve(outcome, applied)

    async def _write_loop(self) -> None:
        pause = 0.05
        while True:
            if not self._queue and self.healthy:
                self._queued.clear()
                await self._queued.wait()
            # Unhealthy with nothing queued: _flush pings, to notice Redis is back.
            try:
                await self._flush()
                self.healthy = True
                pause = 0.05
            except (RedisError, OSError, TimeoutError) as exc:
                self.healthy = False
                self._error(f"{type(exc).__name__}")
                # Back off, then try again with what is queued (bounded).
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)

    async def _flush(self) -> None:
        assert self._client is not None and self._apply is not None
        queue = self._queue
        batch = [queue.popleft() for _ in range(min(BATCH, len(queue)))]
        if not batch:
            await self._client.ping()
            return
        keys = [command[1] for command in batch]
        args: list[Any] = []
        for op, _, first, second in batch:
            args += (op, first, second)
            if op == "a":
                self._queued_bytes -= len(second)
        args.append(self.live_ttl_ms)
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                await self._apply(keys=keys, args=args)
        except BaseException:
            # Lost: the streams they belong to have a hole a resume reports.
            if self._metrics is not None:
                self._metrics.store_errors.inc(len(batch))
            self._settle(len(batch), applied=False)
            raise
        self._settle(len(batch), applied=True)

    def _error(self, what: str) -> None:
        if self._metrics is not None:
            self._metrics.store_errors.inc()
        self._warnings.warn("resume_store", "resume store %s: %s", self._shown, what)

    # -- reads (a resume's own task) -------------------------------------------

    async def _call(self, *command: Any, timeout: float = READ_TIMEOUT) -> Any:
        client = self._client
        if client is None:
            raise StoreUnavailable("not started")
        try:
            async with asyncio.timeout(timeout):
                return await client.execute_command(*command)  # type: ignore[no-untyped-call]
        except (RedisError, OSError, TimeoutError) as exc:
            self._error(f"{type(exc).__name__} on {command[0]}")
            raise StoreUnavailable(type(exc).__name__) from None

    async def lookup(self, stream_id: str) -> tuple[str, str] | None:
        _, meta, _ = _keys(stream_id)
        found = await self._call("HMGET", meta, "owner", "dialect")
        owner, dialect = found
        if owner is None:
            return None
        return owner.decode(), (dialect or b"generic").decode()

    async def read(self, stream_id: str, after: int, wait: float) -> Batch | None:
        events_key, meta, _ = _keys(stream_id)
        # Exclusive of the position itself, so the end entry <after>-1 is seen.
        entries = await self._call("XRANGE", events_key, f"({after}-0", "+", "COUNT", READ_COUNT)
        if not entries and wait > 0:
            block = max(1, int(wait * 1000))
            found = await self._call(
                "XREAD",
                "COUNT",
                READ_COUNT,
                "BLOCK",
                block,
                "STREAMS",
                events_key,
                f"{after}-0",
                timeout=wait + READ_TIMEOUT,
            )
            entries = _xread_entries(found)
        if not entries:
            if not await self._call("EXISTS", meta):
                return None  # expired meanwhile
            return Batch([])
        events: list[bytes] = []
        expected = after + 1
        for entry_id, fields in _pairs(entries):
            seq, part = _seq(entry_id)
            if part == 1:  # the end: only once every event before it was read
                return Batch(events, ended=True, gap=seq != expected - 1)
            if seq != expected:
                # Evicted (the per-stream cap) or a write that was dropped.
                return Batch(events, gap=True)
            events.append(fields.get(b"d", b""))
            expected += 1
        return Batch(events)

    async def hold(self, stream_id: str, seconds: float) -> None:
        _, _, hold = _keys(stream_id)
        await self._call("SET", hold, b"1", "PX", max(1, int(seconds * 1000)))

    async def held_for(self, stream_id: str) -> float | None:
        _, _, hold = _keys(stream_id)
        left = await self._call("PTTL", hold)
        return left / 1000 if isinstance(left, int) and left > 0 else None

    def bytes_held(self) -> int | None:
        return None

    # -- stops across replicas -------------------------------------------------

    async def request_stop(self, stream_id: str) -> bool:
        # Every replica listens, so a publish always has receivers: a stream
        # whose end is stored has nothing left to stop (as with the memory store).
        # The end is written off the hot path, so a stop in the instant after a
        # stream ended may still be told 204; the replica then finds nothing to stop.
        events_key, _, _ = _keys(stream_id)
        last = _pairs(await self._call("XREVRANGE", events_key, "+", "-", "COUNT", 1))
        if last and _seq(last[0][0])[1] == 1:
            return False
        receivers = await self._call("PUBLISH", STOP_CHANNEL, stream_id)
        return isinstance(receivers, int) and receivers > 0

    async def _listen_for_stops(self) -> None:
        pause = 0.05
        while True:
            assert self._client is not None
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(STOP_CHANNEL)
                pause = 0.05
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is None or message.get("type") != "message":
                        continue
                    data = message.get("data")
                    stream_id = data.decode() if isinstance(data, bytes) else str(data)
                    if self.on_stop is not None:
                        self.on_stop(stream_id)
            except (RedisError, OSError) as exc:
                self._error(f"{type(exc).__name__} on the stop channel")
                await asyncio.sleep(pause)  # then subscribe again, backing off
                pause = min(pause * 2, 2.0)
            finally:
                # Through a typed name: redis-py types aclose() from 8.2 on and
                # not before, and an ignore would be unused on one of the two.
                close: Callable[[], Awaitable[None]] = pubsub.aclose
                with contextlib.suppress(RedisError, OSError):
                    await close()


def _resolve(outcome: asyncio.Future[bool], stored: bool) -> None:
    # Done already: given up on, or cancelled with the task that awaited it.
    if not outcome.done():
        outcome.set_result(stored)


def _pairs(entries: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """XRANGE's entries as (id, fields), whatever shape the client decoded them to."""
    out: list[tuple[bytes, dict[bytes, bytes]]] = []
    for entry in entries:
        entry_id, fields = entry[0], entry[1]
        if isinstance(fields, list):
            fields = dict(zip(fields[::2], fields[1::2], strict=False))
        out.append((entry_id, fields))
    return out


def _xread_entries(found: Any) -> list[Any]:
    if not found:
        return []
    if isinstance(found, dict):  # RESP3
        return next(iter(found.values()), [[]])[0] if found else []
    return list(found[0][1])  # RESP2: [[key, entries]]
