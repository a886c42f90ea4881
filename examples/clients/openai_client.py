"""The official ``openai`` SDK against rollserve (``pip install openai``).

    python examples/clients/openai_client.py --base-url http://127.0.0.1:8080/v1 --model smollm2
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    chat = client.chat.completions.create(model=args.model, max_tokens=16,
                                          messages=[{"role": "user", "content": "Say hello"}])
    print("chat:", chat.choices[0].message.content, chat.usage)
    stream = client.completions.create(model=args.model, prompt="Once upon a time", max_tokens=16, stream=True)
    for chunk in stream:
        print(chunk.choices[0].text if chunk.choices else "", end="", flush=True)
    print()


if __name__ == "__main__":
    main()
