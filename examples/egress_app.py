"""An app that calls its provider through the sidecar next to it (examples/egress.yaml).

    OPENAI_API_KEY=sk-... python examples/egress_app.py

Only the base URL changes: the SDK talks to the sidecar on loopback, which
forwards to the provider and keeps its stream alive and honest.
"""

from __future__ import annotations

import os

import openai

SIDECAR = os.environ.get("SIDECAR_URL", "http://127.0.0.1:8080")


def main() -> None:
    client = openai.OpenAI(base_url=SIDECAR + "/v1", api_key=os.environ["OPENAI_API_KEY"])
    stream = client.chat.completions.create(
        model=os.environ.get("MODEL", "gpt-4o-mini"),
        messages=[{"role": "user", "content": "Say hello."}],
        stream=True,
        stream_options={"include_usage": True},
    )
    answer, tokens = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            answer += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    print(answer)
    print(f"({tokens} tokens)")


if __name__ == "__main__":
    main()
