"""What output filters cost: CPU per event, and how long events wait on a prefix.

``python -m bench filters-cost`` measures two things on the recorded-style
2,000-event OpenAI stream (``tests/fixtures/make_long_openai.py``: English
prose with accented, CJK and emoji tokens, one token per event):

1. **CPU per event** of the relay (``Relay.feed``, in process) on a route
   with the built-in ``secrets`` and ``cards`` sets against the same route
   without filters. The machine is shared, so wall-clock numbers drift
   between runs: both variants run alternately in one process, many rounds,
   and the ratio is taken per round (each round's filtered time over the
   unfiltered time right next to it), then its median; the best round of
   each is printed too. Two read patterns: 1,400-byte reads (a busy
   socket) and one event per read (a model streaming at a human pace).
2. **Hold-back latency**: the same stream through a real sidecar (in
   process, on loopback) from a small aiohttp upstream pacing it at
   ``--tps`` events per second, ``--streams`` at once, read by httpx; the
   sidecar's own ``streamwarden_filter_holdback_seconds`` histogram and its
   per-stream records give how many events waited and for how long.

With ``--instructions`` the CPU ratio is also counted in instructions
(``valgrind --tool=callgrind``, which counts every instruction the process
executes whatever else runs on the machine): each variant runs once with
one warm-up pass and once with ``passes`` more, and the difference, over
the events of those passes, is its instructions per event.

Only loopback addresses are used; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.fixtures import long_openai_stream
from streamwarden.core.filters import FilterRule, compile_filters
from streamwarden.core.relay import Limits, Relay
from streamwarden.pipeline.transforms import with_transforms

_BUILTINS = (
    FilterRule("builtin", "secrets", "redact", "secrets"),
    FilterRule("builtin", "cards", "redact", "cards"),
)


def _one_pass(reads: list[bytes], filtered: bool) -> float:
    relay = with_transforms(
        Relay(
            Limits(15.0, 60.0, 1800.0, 8 << 20),
            started_at=0.0,
            now=0.0,
            path="/v1/chat/completions",
            content_type="text/event-stream",
            headers={},
        ),
        filters=compile_filters(_BUILTINS, False) if filtered else None,
    )
    start = time.perf_counter()
    for read in reads:
        relay.feed(read, 1.0)
    relay.upstream_eof(2.0)
    return time.perf_counter() - start


def _patterns(stream: bytes) -> dict[str, list[bytes]]:
    return {
        "1400-byte reads": [stream[i : i + 1400] for i in range(0, len(stream), 1400)],
        "one event per read": [block + b"\n\n" for block in stream.split(b"\n\n")[:-1]],
    }


def cpu_per_event(stream: bytes, rounds: int) -> dict[str, Any]:
    events = stream.count(b"\n\n")
    out: dict[str, Any] = {}
    for name, reads in _patterns(stream).items():
        _one_pass(reads, True)  # compile and warm both paths first
        _one_pass(reads, False)
        plain: list[float] = []
        filtered: list[float] = []
        ratios: list[float] = []
        for i in range(rounds):
            # Alternate which goes first, so a drift in load favours neither.
            if i % 2:
                f = _one_pass(reads, True)
                p = _one_pass(reads, False)
            else:
                p = _one_pass(reads, False)
                f = _one_pass(reads, True)
            plain.append(p)
            filtered.append(f)
            ratios.append(f / p)
        out[name] = {
            "events": events,
            "plain_us_per_event_best": round(min(plain) / events * 1e6, 2),
            "filtered_us_per_event_best": round(min(filtered) / events * 1e6, 2),
            "plain_us_per_event_median": round(statistics.median(plain) / events * 1e6, 2),
            "filtered_us_per_event_median": round(statistics.median(filtered) / events * 1e6, 2),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_best": round(min(filtered) / min(plain), 3),
            "ratio_p90": round(statistics.quantiles(ratios, n=10)[-1], 3),
        }
    return out


async def hold_latency(stream: bytes, streams: int, tps: float) -> dict[str, Any]:
    import httpx
    from aiohttp import web

    from streamwarden.config import load_settings
    from streamwarden.sidecar import Sidecar

    blocks = [block + b"\n\n" for block in stream.split(b"\n\n")[:-1]]

    async def serve(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i, block in enumerate(blocks):
            delay = start + i / tps - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the model's pace
            await response.write(block)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    settings = load_settings(
        environ={},
        overrides={
            "upstream": f"http://127.0.0.1:{port}",
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "usage_injection": "off",  # the fixture has its usage chunk: keep it
            "output_filters": [
                {"builtin": "secrets", "action": "redact"},
                {"builtin": "cards", "action": "redact"},
            ],
        },
    )
    sidecar = Sidecar(settings)
    await sidecar.start()
    try:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one() -> bytes:
                body = {"model": "m", "messages": [], "stream": True}
                reply = await client.post(sidecar.proxy_url + "/v1/chat/completions", json=body)
                return reply.content

            replies = await asyncio.gather(*(one() for _ in range(streams)))
        assert all(reply == stream for reply in replies), "the stream must come out unchanged"
        for _ in range(200):  # the records are published just after the last byte
            if len(sidecar.tracker.finished) >= streams:
                break
            await asyncio.sleep(0.01)
        holds: list[float] = []
        held_bytes = 0
        events = 0
        for record in sidecar.tracker.finished:
            stats = record.meter.filters
            assert stats is not None
            holds += stats.hold_times
            held_bytes += stats.held_bytes
            events += record.meter.events_out
    finally:
        await sidecar.close()
        await runner.cleanup()
    holds.sort()
    ms = [h * 1000 for h in holds]

    def pct(q: float) -> float:
        return round(ms[min(len(ms) - 1, int(q * len(ms)))], 2) if ms else 0.0

    return {
        "streams": streams,
        "tps": tps,
        "events": events,
        "events_held": len(holds),
        "held_share": round(len(holds) / events, 4) if events else 0.0,
        "held_bytes": held_bytes,
        "gap_ms": round(1000 / tps, 2),
        "hold_ms_p50": pct(0.5),
        "hold_ms_p90": pct(0.9),
        "hold_ms_p99": pct(0.99),
        "hold_ms_max": round(ms[-1], 2) if ms else 0.0,
    }


_COLLECTED = re.compile(r"Collected : (\d+)")


def _instructions(passes: int, filtered: bool, pattern: str) -> int:
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "bench.filters_cost",
        str(passes),
        "1" if filtered else "0",
        pattern,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
    found = _COLLECTED.search(done.stderr)
    assert found is not None, done.stderr[-2000:]
    return int(found.group(1))


def instructions_per_event(passes: int) -> dict[str, Any]:
    """Instructions per event, with and without filters, counted by callgrind."""
    events = long_openai_stream(2000).count(b"\n\n")
    out: dict[str, Any] = {}
    for pattern in _patterns(b""):
        per: dict[str, float] = {}
        for filtered in (False, True):
            extra = _instructions(passes, filtered, pattern) - _instructions(0, filtered, pattern)
            per["filtered" if filtered else "plain"] = extra / (passes * events)
        out[pattern] = {
            "plain_instructions_per_event": round(per["plain"]),
            "filtered_instructions_per_event": round(per["filtered"]),
            "ratio": round(per["filtered"] / per["plain"], 3),
        }
    return out


def filters_cost(args: argparse.Namespace) -> int:
    stream = long_openai_stream(2000)
    result = {"cpu": cpu_per_event(stream, args.rounds)}
    print(json.dumps(result["cpu"], indent=2), flush=True)
    if args.instructions:
        if shutil.which("valgrind") is None:
            print("--instructions: valgrind is not installed (apt-get install valgrind)")
        else:
            result["instructions"] = instructions_per_event(args.passes)
            print(json.dumps(result["instructions"], indent=2), flush=True)
    if not args.no_latency:
        short = long_openai_stream(args.events)
        result["hold"] = asyncio.run(hold_latency(short, args.streams, args.tps))
        print(json.dumps(result["hold"], indent=2), flush=True)
    print("JSON " + json.dumps(result), flush=True)
    return 0


def _count(passes: int, filtered: bool, pattern: str) -> None:
    """Under callgrind: one warm-up pass (compiles, caches), then ``passes`` counted ones."""
    reads = _patterns(long_openai_stream(2000))[pattern]
    for _ in range(passes + 1):
        _one_pass(reads, filtered)


if __name__ == "__main__":
    _count(int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3])
