"""Coverage-guided fuzzing of the SSE decoder and framer with atheris.

Each input is split into chunks at fuzzer-chosen points and fed to a
decoder, a framer and a line framer with a small ``max_event_bytes``. It
checks what must hold for any bytes at any chunking:

- the only exception is the documented ``EventTooLarge``;
- the decoder gives the same events whole and chunked;
- the framer's raw frames are exactly the bytes it consumed (BOM aside) and
  re-decode to the same events;
- the framer never holds more than ``max_event_bytes`` (plus a partial BOM).

Run: ``python fuzz/fuzz_sse.py -max_total_time=60`` (libFuzzer flags apply).
CI runs it for a few seconds through ``tests/project/test_fuzz_smoke.py``.
"""

from __future__ import annotations

import os
import sys

import atheris

# atheris instruments Python bytecode: the framer must run from its source,
# not the compiled build, for the fuzzer to see which branches an input took.
os.environ["STREAMWARDEN_PURE_PYTHON"] = "1"

with atheris.instrument_imports():
    from streamwarden.core.sse import EventTooLarge, LineFramer, SSEDecoder, SSEFramer

LIMIT = 64
BOM = b"\xef\xbb\xbf"


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, start = [], 0
    for point in [*points, len(data)]:
        out.append(data[start:point])
        start = point
    return out


def decode_all(pieces: list[bytes]) -> list[object]:
    decoder = SSEDecoder()
    events: list[object] = []
    for piece in pieces:
        events += decoder.feed(piece)
    return events + decoder.close()


def test_one_input(raw: bytes) -> None:
    provider = atheris.FuzzedDataProvider(raw)
    cuts = [provider.ConsumeIntInRange(0, 4096) for _ in range(provider.ConsumeIntInRange(0, 8))]
    data = provider.ConsumeBytes(provider.remaining_bytes())
    pieces = chunks(data, cuts)

    whole = decode_all([data])
    assert decode_all(pieces) == whole

    framer = SSEFramer()
    frames = []
    for piece in pieces:
        frames += framer.feed(piece)
    raw_out = b"".join(frame.raw for frame in frames)
    stripped = data[3:] if data.startswith(BOM) and not data.startswith(BOM * 2) else data
    assert stripped.startswith(raw_out)
    assert decode_all([raw_out]) == [f.event for f in frames if f.event is not None]

    limited = SSEFramer(max_event_bytes=LIMIT)
    lines = LineFramer(max_event_bytes=LIMIT)
    for framer_under_limit in (limited, lines):
        try:
            for piece in pieces:
                framer_under_limit.feed(piece)
                assert framer_under_limit.pending_bytes <= LIMIT + 2
        except EventTooLarge:
            pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
