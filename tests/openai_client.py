"""Drives `bbc serve` with the official `openai` client; prints what it got as one JSON line.

Usage: python3 tests/openai_client.py BASE_URL   (BASE_URL like http://127.0.0.1:8000/v1)
"""

import json
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
prompt = "The capital of France is"
question = [{"role": "user", "content": "What is the capital of France?"}]

completion = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
stream = client.completions.create(
    model="smollm2",
    prompt=prompt,
    max_tokens=8,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
pieces, usage = [], None
for chunk in stream:
    if chunk.choices:
        pieces.append(chunk.choices[0].text)
    if chunk.usage is not None:
        usage = chunk.usage.completion_tokens

chat = client.chat.completions.create(model="smollm2", messages=question, max_completion_tokens=12, temperature=0)
chat_pieces = []
for chunk in client.chat.completions.create(
    model="smollm2", messages=question, max_completion_tokens=12, temperature=0, stream=True
):
    if chunk.choices and chunk.choices[0].delta.content:
        chat_pieces.append(chunk.choices[0].delta.content)

print(
    json.dumps(
        {
            "completion": completion.choices[0].text,
            "completion_usage": completion.usage.completion_tokens,
            "completion_stream": "".join(pieces),
            "stream_usage": usage,
            "chat": chat.choices[0].message.content,
            "chat_stream": "".join(chat_pieces),
            "models": [m.id for m in client.models.list()],
        }
    )
)
