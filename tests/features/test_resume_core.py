"""The resume core with no I/O: ids on events, positions, owners and the memory store's bounds."""

from __future__ import annotations

from urllib.parse import urlencode

from hypothesis import given
from hypothesis import strategies as st

from streamwarden.core.sse import SSEDecoder
from streamwarden.features.resume.model import (
    MemoryStore,
    OwnerNames,
    Position,
    new_stream_id,
    owner_digest,
    parse_stream_id,
    resume_position,
    stamp,
)

EOL = st.sampled_from([b"\n", b"\r\n", b"\r"])
FIELD_LINE = st.one_of(
    st.builds(
        lambda v: b"data: " + v,
        st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b),
    ),
    st.builds(
        lambda v: b"id: " + v,
        st.binary(max_size=10).filter(
            lambda b: b"\r" not in b and b"\n" not in b and b"\0" not in b
        ),
    ),
    st.just(b"id"),
    st.just(b"event: delta"),
    st.just(b": a comment"),
    st.just(b"idx: not an id"),
)


@given(st.lists(st.tuples(FIELD_LINE, EOL), min_size=1, max_size=8), EOL)
def test_a_stamped_event_has_our_id_and_otherwise_the_same_fields(
    lines: list[tuple[bytes, bytes]], last: bytes
) -> None:
    block = b"".join(line + eol for line, eol in lines) + last
    if last == b"\n" and lines[-1][1] == b"\r":
        return  # "\r\n" would be one line end: not the end of a block
    (original,) = SSEDecoder().feed(block + b"data: x\n\n")[:1] or [None]
    stamped = stamp(block, b"abc.7")
    events = SSEDecoder().feed(stamped)
    if not any(line.startswith(b"data") for line, _ in lines):
        assert events == []  # no data: nothing dispatched, with or without an id
        return
    (event,) = events
    assert event.id == "abc.7"
    assert original is not None
    assert (event.event, event.data) == (original.event, original.data)


def test_positions_are_the_ids_the_sidecar_writes_and_nothing_else() -> None:
    stream_id = new_stream_id()
    assert len(stream_id) == 32 and stream_id != new_stream_id()
    assert resume_position(f"{stream_id}.12", "") == Position(stream_id, 12)
    assert resume_position(None, f"model=x&last_event_id={stream_id}.3") == Position(stream_id, 3)
    assert resume_position("", "") is None and resume_position("  ", "") is None
    for foreign in ("chatcmpl-1", f"{stream_id}", f"{stream_id}.x", "../..", f"{stream_id}.-1"):
        assert resume_position(foreign, "") == foreign  # a resume, of an unknown stream


# Digits of other scripts and forms int() and str.isdigit() take, and what
# only a lenient parser would: each is a resume of an unknown stream.
NOT_ASCII_DIGITS = ["\u00b2", "\u0663", "\uff11", "1\u00b9", "\U0001d7d9"]
LENIENT = ["+1", " 1", "1_0", "0x1", "1.0", "1e3", "1" * 19, "", "1\n"]


def test_a_position_holds_ascii_digits_only_and_a_bounded_count_of_them() -> None:
    stream_id = new_stream_id()
    assert resume_position(f"{stream_id}.{'9' * 18}", "") == Position(stream_id, 10**18 - 1)
    assert resume_position(f" {stream_id}.7\t", "") == Position(stream_id, 7)  # HTTP's blanks
    for seq in NOT_ASCII_DIGITS + LENIENT:
        asked = f"{stream_id}.{seq}"
        assert resume_position(asked, "") == asked, seq
        query = urlencode({"last_event_id": asked})
        assert resume_position(None, query) == asked, seq
    for foreign_id in (stream_id.upper(), "\u0660" * 32, stream_id[:31] + "\u212a"):
        assert resume_position(f"{foreign_id}.1", "") == f"{foreign_id}.1"
    huge = f"{stream_id}." + "1" * 100_000
    assert resume_position(huge, "") == huge  # answered as unknown, not parsed
    assert parse_stream_id(f" {stream_id.upper()} ") == stream_id
    for foreign_id in ("\u0660" * 32, stream_id[:31] + "\u212a", stream_id + "0", ""):
        assert parse_stream_id(foreign_id) is None


def test_the_owner_is_the_credentials_keyed_by_the_stream() -> None:
    one = [("Authorization", "Bearer sk-1"), ("Accept", "text/event-stream")]
    assert owner_digest(one, "s1") == owner_digest([("authorization", "Bearer sk-1")], "s1")
    assert owner_digest(one, "s1") != owner_digest([("Authorization", "Bearer sk-2")], "s1")
    assert owner_digest(one, "s1") != owner_digest(one, "s2")  # nothing to match across streams
    assert owner_digest(one, "s1") != owner_digest([*one, ("Cookie", "a=b")], "s1")
    tenant = [("X-Tenant", "acme")]
    assert owner_digest(tenant, "s") == owner_digest([], "s")  # not a credential by default
    configured = OwnerNames.of(["X-Tenant"])
    assert owner_digest(tenant, "s", configured) != owner_digest([], "s", configured)


# Where each dialect's clients put their credential.
CREDENTIAL_HEADERS = ["Authorization", "Proxy-Authorization", "x-api-key", "api-key"]
CREDENTIAL_HEADERS += ["x-goog-api-key", "Cookie"]


def test_every_dialects_credential_makes_the_owner_in_headers_and_in_the_query() -> None:
    for name in CREDENTIAL_HEADERS:
        mine = owner_digest([(name, "k-1")], "s")
        assert mine != owner_digest([(name, "k-2")], "s"), name
        assert mine != owner_digest([], "s"), name
        assert mine == owner_digest([(name.upper(), "k-1")], "s"), name
    for param in ("key", "access_token", "api_key", "api-key"):
        mine = owner_digest([], "s", query_string=f"alt=sse&{param}=k-1")
        assert mine != owner_digest([], "s", query_string=f"alt=sse&{param}=k-2"), param
        assert mine != owner_digest([], "s", query_string="alt=sse"), param
        # Order, other parameters and the position do not change who asks.
        again = f"last_event_id=x.1&{param.upper()}=k-1&alt=json"
        assert mine == owner_digest([], "s", query_string=again), param
    # Not a credential by default; one when configured.
    plain = owner_digest([], "s", query_string="alt=sse")
    assert owner_digest([], "s", query_string="alt=sse&token=t") == plain
    configured = OwnerNames.of(extra_params=["token"])
    tokened = owner_digest([], "s", configured, query_string="token=t")
    assert tokened != owner_digest([], "s", configured, query_string="token=u")
    # A value's bytes cannot pass for another credential: "=", "&" or NUL in it.
    assert owner_digest([], "s", query_string="key=a%26api_key%3Db") != owner_digest(
        [], "s", query_string="key=a&api_key=b"
    )
    assert owner_digest([], "s", query_string="key=a%00%3Fkey%3Db") != owner_digest(
        [], "s", query_string="key=a&key=b"
    )
    # A header and a query parameter of the same name are two credentials.
    assert owner_digest([("api-key", "a")], "s") != owner_digest([], "s", query_string="api-key=a")


def test_a_resume_secret_keys_the_owner_digest_too() -> None:
    one = [("Authorization", "Bearer sk-1")]
    secret = "k" * 32
    keyed = owner_digest(one, "s1", secret=secret)
    # Whoever reads the store and guesses the credential cannot check the guess...
    assert keyed != owner_digest(one, "s1")
    assert keyed != owner_digest(one, "s1", secret="j" * 32)
    # ...while every replica given the secret computes the same digest.
    assert keyed == owner_digest([("authorization", "Bearer sk-1")], "s1", secret=secret)
    assert keyed != owner_digest(one, "s2", secret=secret)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_memory_store_evicts_a_streams_oldest_events_past_its_cap() -> None:
    store = MemoryStore(max_stream_bytes=100, max_total_bytes=10_000, ttl=60, clock=Clock())
    stored = store.open("s", "owner", "openai-chat")
    for seq in range(1, 11):
        stored.append(seq, b"x" * 30)
    assert stored.bytes <= 100 and stored.first_seq == 8
    assert stored.after(2) is None  # evicted: a gap, never silently skipped
    assert stored.after(7) == [b"x" * 30] * 3
    assert stored.after(10) == []


def test_the_memory_store_bounds_all_streams_and_expires_ended_ones() -> None:
    clock = Clock()
    store = MemoryStore(max_stream_bytes=1000, max_total_bytes=300, ttl=10, clock=clock)
    old = store.open("old", "o", "generic")
    old.append(1, b"a" * 100)
    old.end("completed", "generic")
    live = store.open("live", "o", "generic")
    for seq in range(1, 4):
        live.append(seq, b"b" * 100)
    assert store.find("old") is None  # an ended stream goes first
    assert store.total_bytes <= 300
    live.end("completed", "generic")
    clock.now = 9.9
    assert store.find("live") is not None
    clock.now = 10.0
    assert store.find("live") is None and store.total_bytes == 0


def test_removing_an_id_line_never_joins_a_cr_with_the_blocks_end() -> None:
    from streamwarden.features.resume.model import strip_ids

    # "\r" ends the comment; removing "id\n" must not turn "\r" + "\n" into one CRLF.
    decoder = SSEDecoder()
    assert decoder.feed(strip_ids(b": c\rid\n\n") + b"data: next\n\n")[0].data == "next"
    (event,) = SSEDecoder().feed(stamp(b"data: \rid\n\n", b"abc.7"))
    assert (event.data, event.id) == ("", "abc.7")


def test_query_credentials_that_differ_in_any_byte_make_different_owners() -> None:
    # Decoded as UTF-8 with replacement, %FF and %FE were one character, one owner.
    def owner(query: str) -> str:
        return owner_digest([], "s1", query_string=query)

    assert owner("key=%FF") != owner("key=%FE")
    assert owner("key=%C3%A9") == owner("key=%C3%A9") != owner("key=%C3%A8")
