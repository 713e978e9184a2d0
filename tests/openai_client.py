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

# Structured output, and tool calls (named, required and auto, whole and streamed), then the next
# turn with the call and its result in the history.
person = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
structured = client.chat.completions.create(
    model="smollm2",
    messages=[{"role": "user", "content": "Ana is 31. Describe her as JSON."}],
    max_completion_tokens=40,
    temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}},
)
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
weather = [{"role": "user", "content": "What is the weather in Paris?"}]
named = {"type": "function", "function": {"name": "get_weather"}}
called = client.chat.completions.create(
    model="smollm2", messages=weather, tools=tools, tool_choice=named, max_completion_tokens=40, temperature=0
)
call = called.choices[0].message.tool_calls[0]
streamed_arguments, streamed_names = [], []
for chunk in client.chat.completions.create(
    model="smollm2", messages=weather, tools=tools, tool_choice=named, max_completion_tokens=40, temperature=0, stream=True
):
    for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
        if delta.function.name:
            streamed_names.append(delta.function.name)
        streamed_arguments.append(delta.function.arguments or "")
required = client.chat.completions.create(
    model="smollm2", messages=weather, tools=tools, tool_choice="required", max_completion_tokens=60, temperature=0
)
# `tool_choice` auto (the default), the answer held to a Hermes call by a regular expression.
hermes_call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
auto = client.chat.completions.create(
    model="smollm2",
    messages=weather,
    tools=tools,
    max_completion_tokens=150,
    temperature=0,
    extra_body={"structured_outputs": {"regex": hermes_call}},
)
history = weather + [
    {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
    {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
]
answer = client.chat.completions.create(model="smollm2", messages=history, max_completion_tokens=12, temperature=0)

print(
    json.dumps(
        {
            "structured": structured.choices[0].message.content,
            "call_name": call.function.name,
            "call_arguments": call.function.arguments,
            "streamed_names": streamed_names,
            "streamed_arguments": "".join(streamed_arguments),
            "required_calls": [[c.function.name, c.function.arguments] for c in required.choices[0].message.tool_calls],
            "after_the_call": answer.choices[0].message.content,
            "auto_calls": [[c.function.name, c.function.arguments] for c in auto.choices[0].message.tool_calls],
            "auto_content": auto.choices[0].message.content,
            "auto_finish": auto.choices[0].finish_reason,
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
