"""Event JSON parses the same with and without orjson (the ``fast`` extra)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamwarden.core.dialects import base

orjson = pytest.importorskip("orjson")

TRICKY = [
    '{"choices":[{"delta":{"content":"hi"}}]}',
    '{"a": NaN, "b": Infinity, "c": -Infinity}',  # json accepts these, orjson does not
    '{"s": "\\ud800"}',  # a lone surrogate
    '{"s": "caf\\u00e9 \\ud83d\\ude00"}',
    "[DONE]",
    "",
    "   ",
    "{",
    '{"a":1} trailing',
    "1e400",
    "-0",
    '{"n": 18446744073709551615}',  # 2**64 - 1: still exact in both
]
#: Past 64 bits orjson gives a float where json keeps an exact integer.
HUGE = ['{"n": 20000000000000000000}', "-9223372036854775809"]


def _past_64_bits(value: Any) -> bool:
    """Holds an integer orjson reads as a float (the one documented difference)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -(2**63) <= value < 2**64
    if isinstance(value, list):
        return any(_past_64_bits(v) for v in value)
    if isinstance(value, dict):
        return any(_past_64_bits(v) for v in value.values())
    return False


def _same(data: str) -> None:
    fast, stdlib = base._load_json_fast(data), base._load_json_stdlib(data)
    if _past_64_bits(stdlib):
        return  # test_integers_past_64_bits_differ_but_no_dialect_counts_them
    # repr: NaN != NaN, and 1 == 1.0 == True must not pass for one another.
    assert repr(fast) == repr(stdlib), data


def test_the_fast_parser_is_the_one_in_use() -> None:
    assert base.load_json is base._load_json_fast


@pytest.mark.parametrize("data", TRICKY)
def test_tricky_inputs_parse_the_same(data: str) -> None:
    _same(data)


#: orjson reads integers past 64 bits as floats; no field a dialect reads
#: (token counts, indexes) comes near that.
INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)

json_values = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@given(json_values)
def test_any_json_document_parses_the_same(value: Any) -> None:
    _same(json.dumps(value))


@pytest.mark.parametrize("data", HUGE)
def test_integers_past_64_bits_differ_but_no_dialect_counts_them(data: str) -> None:
    assert repr(base._load_json_fast(data)) != repr(base._load_json_stdlib(data))
    for parsed in (base._load_json_fast(data), base._load_json_stdlib(data)):
        value = parsed["n"] if isinstance(parsed, dict) else parsed
        assert base.as_int(value) is None


def test_a_huge_usage_count_is_no_count_with_either_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from streamwarden.core.dialects import openai_chat
    from streamwarden.core.sse import Event

    event = Event("message", '{"choices":[],"usage":{"completion_tokens":20000000000000000000}}')
    assert openai_chat.OpenAIChat().inspect(event).output_tokens is None
    monkeypatch.setattr(openai_chat, "load_json", base._load_json_stdlib)
    assert openai_chat.OpenAIChat().inspect(event).output_tokens is None


@given(st.text(max_size=64))
def test_any_text_parses_the_same(data: str) -> None:
    _same(data)
