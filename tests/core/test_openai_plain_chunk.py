"""The plain-chunk reading of OpenAI Chat chunks says what the parsed reading says.

``OpenAIChat.plain_text`` reads the one shape nearly every chunk has with a
scan instead of a JSON parse (the parse was half of the sidecar's own work per
event). It may decline any chunk; a chunk it takes must mean exactly what
``inspect_parsed`` reads from it. Hypothesis builds chunks from the members
real servers send and from hostile ones (escapes, control characters,
duplicates, whitespace, numbers out of JSON's form, other members), then
mutates a byte here and there.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamwarden.core.dialects.base import NOTHING, Observation
from streamwarden.core.dialects.openai_chat import OpenAIChat, inspect_parsed
from streamwarden.core.sse import Event

#: Chunks as servers send them, each of which must take the short way.
REAL_CHUNKS = [
    # OpenAI
    '{"id":"chatcmpl-L2m6","object":"chat.completion.chunk","created":1757435012,'
    '"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_b6fa",'
    '"choices":[{"index":0,"delta":{"content":" a"},"logprobs":null,"finish_reason":null}],'
    '"usage":null,"obfuscation":"xaqK0jcB"}',
    # vLLM
    '{"id":"chatcmpl-9f","object":"chat.completion.chunk","created":1727000000,'
    '"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":'
    '{"content":" café"},"logprobs":null,"finish_reason":null}]}',
    # Ollama's OpenAI API
    '{"id":"chatcmpl-12","object":"chat.completion.chunk","created":1727000000,"model":"llama3",'
    '"system_fingerprint":"fp_ollama","choices":[{"index":0,"delta":{"role":"assistant",'
    '"content":"日本"},"finish_reason":null}]}',
    # TGI
    '{"object":"chat.completion.chunk","id":"","created":1727000000,"model":"tgi",'
    '"system_fingerprint":"2.0.4-native","choices":[{"index":0,"delta":{"role":"assistant",'
    '"content":"😀"},"logprobs":null,"finish_reason":null}],"usage":null}',
]


def plain_text(data: str, after: str | None = None) -> str | None:
    """What a stream's dialect takes the short way, fresh or after ``after`` (its cache warm)."""
    dialect = OpenAIChat()
    if after is not None:
        dialect.plain_text(after)
    return dialect.plain_text(data)


def test_real_chunks_take_the_short_way_to_the_same_reading() -> None:
    for data in REAL_CHUNKS:
        text = plain_text(data)
        assert text is not None, data
        assert text == json.loads(data)["choices"][0]["delta"]["content"]
        assert OpenAIChat().inspect(Event("message", data, None)) == inspect_parsed(data)


def test_what_means_more_than_text_takes_the_long_way() -> None:
    base = json.loads(REAL_CHUNKS[0])
    changes: tuple[dict[str, object], ...] = (
        {"usage": {"completion_tokens": 3, "prompt_tokens": 2}},
        {"error": {"message": "overloaded"}},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": []},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c"}]}}]},
        {"choices": [{"index": 0, "delta": {"content": "a\nb"}}]},
        {"error": "overloaded"},
        {"error": 1},
        {"usage": 0},
    )
    for change in changes:
        data = json.dumps({**base, **change}, separators=(",", ":"), ensure_ascii=False)
        assert plain_text(data) is None, data
    # Two "choices" members: which counts is the parser's rule, not this one's.
    # Integers past what every parser reads (json refuses 4,301 digits): the parse decides.
    for huge in (
        '{"created":' + "1" * 4301 + ',"choices":[{"index":0,"delta":{"content":"hi"}}]}',
        '{"choices":[{"index":' + "1" * 4301 + ',"delta":{"content":"hi"}}]}',
        '{"choices":[{"index":0,"delta":{"content":"hi"}}],"x":' + "9" * 4301 + "}",
        '{"created":' + "1" * 20 + ',"choices":[{"index":0,"delta":{"content":"hi"}}]}',
    ):
        assert plain_text(huge) is None
    nineteen = '{"created":' + "9" * 19 + ',"choices":[{"index":0,"delta":{"content":"hi"}}]}'
    assert plain_text(nineteen) == "hi"
    # Another choice's text (n > 1) is a text of its own for the filters: the parse keys it.
    assert plain_text('{"choices":[{"index":1,"delta":{"content":"hi"}}]}') is None
    for second in ("[]", '[{"index":0,"delta":{"content":"b"}}]'):
        twice = REAL_CHUNKS[0][:-1] + f',"choices":{second}}}'
        assert plain_text(twice) is None
        assert plain_text(twice, after=REAL_CHUNKS[0]) is None


_STRINGS = st.text(
    alphabet=st.sampled_from(['a', ' ', '"', "\\", "\n", "\x00", "\x1f", "\x7f", "é", "日",
                              "\u2028", "\u200d", "😀", "{", "}", ",", ":", "[", "]"]),
    max_size=6,
)  # fmt: skip


def _string(value: str) -> str:
    """A JSON string: escaped as json.dumps does, or raw (often not JSON at all)."""
    return json.dumps(value, ensure_ascii=False)


#: Strings as most chunks carry them (the shape a plain chunk may have).
_PLAIN_STRING = st.text(alphabet="ab é日😀-.", max_size=5).map(lambda s: f'"{s}"')
_RAW_STRING = st.one_of(_STRINGS.map(_string), _STRINGS.map(lambda s: f'"{s}"'))
_NUMBER = st.sampled_from(["0", "-0", "12", "01", "1.5", "1e3", "-", "99999999999999999999999"])
_VALUE = st.one_of(_RAW_STRING, _NUMBER, st.sampled_from(["null", "true", "{}", "[]", '{"a":1}']))

_DELTA = st.lists(
    st.tuples(st.sampled_from(["role", "content", "refusal", "reasoning_content", "tool_calls"]),
              st.one_of(_RAW_STRING, st.just('"assistant"'), st.just("null"), st.just("[]"))),
    max_size=3,
)  # fmt: skip
_CHOICE_TAIL = st.lists(
    st.tuples(st.sampled_from(["logprobs", "finish_reason", "stop_reason", "text", "index"]),
              st.one_of(st.just("null"), _VALUE)),
    max_size=3,
)  # fmt: skip


@st.composite
def _choices(draw: st.DrawFn) -> str:
    choices = []
    for _ in range(draw(st.integers(0, 2))):
        members = [("index", draw(_NUMBER))] if draw(st.booleans()) else []
        delta = ",".join(f"{_string(k)}:{v}" for k, v in draw(_DELTA))
        members.append(("delta", "{" + delta + "}"))
        members += draw(_CHOICE_TAIL)
        choices.append("{" + ",".join(f"{_string(k)}:{v}" for k, v in members) + "}")
    return "[" + ",".join(choices) + "]"


@st.composite
def _plain_choice(draw: st.DrawFn) -> str:
    """A choice near the plain shape: its parts in order, each sometimes off."""
    index = draw(st.sampled_from(["0"] * 4 + ["3", "01", "-1", "1.0", '"0"']))
    role = draw(st.sampled_from([""] * 3 + ['"role":"assistant",'] * 2 + ['"role":"user",']))
    content = draw(st.one_of(_PLAIN_STRING, _PLAIN_STRING, _RAW_STRING))
    tails = draw(
        st.lists(st.sampled_from([',"logprobs":null', ',"finish_reason":null',
                                  ',"stop_reason":null', ',"finish_reason":"stop"',
                                  ',"logprobs":{}', ',"text":"x"']), max_size=3)
    )  # fmt: skip
    return f'[{{"index":{index},"delta":{{{role}"content":{content}}}{"".join(tails)}}}]'


@st.composite
def chunks(draw: st.DrawFn) -> str:
    names = ["id", "object", "created", "model", "system_fingerprint", "service_tier",
             "obfuscation", "usage", "error", "choices", "other"]  # fmt: skip
    plain = draw(st.booleans())
    members = []
    chosen = draw(st.lists(st.sampled_from(names[:8] if plain else names), min_size=1, max_size=6))
    if plain and draw(st.integers(0, 9)) == 0:
        chosen.append(draw(st.sampled_from(["error", "other", "choices"])))
    if plain and "choices" not in chosen:
        chosen.append("choices")
    for name in chosen:
        if name == "choices":
            value = draw(_plain_choice()) if plain else draw(_choices())
        elif plain and name in ("usage", "error", "other"):
            value = draw(st.sampled_from(["null"] * 8 + ["{}", '"x"', "0"]))
        elif plain and name == "created":
            value = draw(_NUMBER)
        elif plain:
            value = draw(st.one_of(_PLAIN_STRING, _PLAIN_STRING, _PLAIN_STRING, _RAW_STRING))
        else:
            value = draw(_VALUE)
        members.append(f"{_string(name)}:{value}")
    separator = draw(st.sampled_from([","] * 6 + [", ", ",\t"]))
    data = "{" + separator.join(members) + "}"
    for _ in range(max(0, draw(st.integers(-3, 2)))):  # a byte changed, dropped or added
        at = draw(st.integers(0, len(data)))
        data = (
            data[:at] + draw(st.sampled_from(["", '"', "\\", ",", "}", " ", "x"])) + data[at + 1 :]
        )
    return data


@st.composite
def plain_chunks(draw: st.DrawFn) -> tuple[str, str]:
    """A chunk of the plain shape in any of its forms, and its content."""
    # What isprintable takes: every category but controls, formats, separators
    # (the space aside), surrogates, private use and unassigned.
    printable = st.characters(
        exclude_categories=["Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp"],
        exclude_characters='"\\',
        include_characters=" ",
    )
    content = draw(st.text(printable, max_size=8))
    role = draw(st.sampled_from(["", '"role":"assistant",']))
    tails = draw(
        st.permutations([',"logprobs":null', ',"finish_reason":null', ',"stop_reason":null'])
    )
    # Choice 0 only: another choice's text is keyed for the filters (n > 1), by the parsed reading.
    choice = (f'[{{"index":0,"delta":{{{role}"content":"{content}"}}'
              f'{"".join(tails[: draw(st.integers(0, 3))])}}}]')  # fmt: skip
    members = [f'"choices":{choice}']
    for name in draw(st.lists(st.sampled_from(["id", "object", "model", "system_fingerprint",
                                               "service_tier", "obfuscation", "created",
                                               "usage"]), max_size=6)):  # fmt: skip
        if name == "created":
            members.append(f'"created":{draw(st.integers(-(10**19) + 1, 10**19 - 1))}')
        elif name == "usage":
            members.append('"usage":null')
        else:
            members.append(f'"{name}":{draw(st.one_of(st.just("null"), _PLAIN_STRING))}')
    order = draw(st.permutations(members))
    return "{" + ",".join(order) + "}", content


@settings(max_examples=1000, deadline=None)
@given(plain_chunks())
def test_every_form_of_the_plain_shape_takes_the_short_way(chunk: tuple[str, str]) -> None:
    data, content = chunk
    assert plain_text(data) == content, data
    assert plain_text(data, after=data) == content, data  # the head and tail known
    assert (Observation(content) if content else NOTHING) == inspect_parsed(data)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks())
def test_a_chunk_taken_the_short_way_means_what_its_parse_means(data: str) -> None:
    for text in (plain_text(data), *(plain_text(data, after=real) for real in REAL_CHUNKS)):
        if text is not None:
            assert (Observation(text) if text else NOTHING) == inspect_parsed(data)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(REAL_CHUNKS), st.integers(0, 400), st.sampled_from(["", '"', "\\", "1", " "])
)
def test_a_real_chunk_with_a_byte_changed_means_what_its_parse_means(
    data: str, at: int, byte: str
) -> None:
    changed = data[:at] + byte + data[at + 1 :]
    # Fresh, and after the chunk it changes (the stream's head and tail known).
    for text in (plain_text(changed), plain_text(changed, after=data)):
        if text is not None:
            assert (Observation(text) if text else NOTHING) == inspect_parsed(changed)


@settings(max_examples=1000, deadline=None)
@given(plain_chunks(), st.sampled_from(["usage", "error", "choices", "other", "id"]), _VALUE,
       st.booleans())  # fmt: skip
def test_a_plain_chunk_with_a_member_added_means_what_its_parse_means(
    chunk: tuple[str, str], name: str, value: str, first: bool
) -> None:
    data, _ = chunk
    member = f'"{name}":{value}'
    added = "{" + member + "," + data[1:] if first else data[:-1] + "," + member + "}"
    for text in (plain_text(added), plain_text(added, after=data)):
        if text is not None:
            assert (Observation(text) if text else NOTHING) == inspect_parsed(added)


def test_a_stream_reads_the_same_whatever_its_chunks_repeat() -> None:
    """Through one stream's dialect (its cache, and its pause after misses in a row)."""
    steady = REAL_CHUNKS[0]
    for changing in ("id", "obfuscation"):
        dialect = OpenAIChat()
        for n in range(300):
            data = steady.replace(f'"{changing}":"', f'"{changing}":"{n}', 1)
            event = Event("message", data, None)
            assert dialect.inspect(event) == inspect_parsed(data) == Observation(" a")
    # A stream that repeats its head and only its content changes: every chunk the cheap way.
    dialect = OpenAIChat()
    for n in range(300):
        assert dialect.plain_text(steady.replace('" a"', f'" {n}"')) == f" {n}"
