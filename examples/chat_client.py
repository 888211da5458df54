"""The openai SDK streaming through the sidecar (examples/in-front-of-a-server.yaml).

    OPENAI_BASE_URL=http://127.0.0.1:8080/v1 python examples/chat_client.py

A truncated or broken stream raises here (the sidecar writes an error event
the SDK raises on) instead of returning a shorter answer as if it were whole.
"""

from __future__ import annotations

import os

import openai


def main() -> None:
    client = openai.OpenAI(
        base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8080/v1"),
        api_key=os.environ.get("OPENAI_API_KEY", "not-needed-by-a-local-server"),
    )
    stream = client.chat.completions.create(
        model=os.environ.get("MODEL", "local"),
        messages=[{"role": "user", "content": "Say hello."}],
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
