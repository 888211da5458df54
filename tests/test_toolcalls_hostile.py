"""Tool calls against a hostile or odd upstream: what leaves the tracker, what it holds.

Arguments never leave the tracker (an ``id`` inside them is no call's id);
what an upstream controls (its call keys, ids, names, the number of its
fragments) counts against ``max_tool_arguments_bytes``; a close is judged
on the whole input it carries.
"""

from __future__ import annotations

import json

from tool_streams import BY_NAME, error_of

GEMINI = BY_NAME["gemini"]


def test_a_gemini_cut_names_the_call_by_its_own_keys_never_by_its_arguments() -> None:
    first = {"candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]}}]}
    head = f"data: {json.dumps(first)}\n\n".encode()
    cuts = {
        # An id inside the args, and the name after them: only the call's own keys.
        b'{"functionCall":{"args":{"account":{"id":"ACCT-SECRET-4111","name":"N-SECRET"}},'
        b'"name":"transfer","id":"fc_1","x":"': ("fc_1", "transfer"),
        # Cut inside the args before the call's own id came: no id at all.
        b'{"functionCall":{"name":"transfer",'
        b'"args":{"account":{"id":"ACCT-SECRET-4111","pin":"12': ("", "transfer"),
        b'{"functionCall":{"args":["id","ACCT-SECRET-4111",{"name":"N-SECRET"': ("", ""),
    }
    for call, (call_id, name) in cuts.items():
        relay = GEMINI.relay()
        cut = b'data: {"candidates":[{"content":{"role":"model","parts":[' + call
        out = relay.feed(head + cut, 1.0) + relay.upstream_failed(2.0)
        record = json.dumps(relay.meter.as_record())
        assert b"SECRET" not in out and "SECRET" not in record, call
        code, message = error_of(GEMINI, GEMINI.decode(out)[-1])
        assert code == "tool_call_truncated" and f"({name or 'unnamed'})" in message, message
        (listed,) = relay.meter.as_record()["tool_calls"]
        assert (listed["id"], listed["name"]) == (call_id, name)
