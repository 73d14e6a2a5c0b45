"""Chat with the README's LLM through the OpenAI API at the control plane's address, with the
unchanged `openai` client, streaming the answer as it is generated:

    .venv/bin/python examples/chat.py "$CP/v1" "$KEY" "Write a haiku about GPUs."

It prints the tokens as they arrive, then a line with the tokens counted by the engine.
"""

from __future__ import annotations

import sys

from openai import OpenAI


def main(base_url: str, key: str, prompt: str, model: str = "smollm2") -> int:
    client = OpenAI(base_url=base_url, api_key=key)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(
                f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} "
                "completion tokens]"
            )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: chat.py <the control plane's URL>/v1 <the service's key> <prompt>")
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
