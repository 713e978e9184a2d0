"""Drives `bbc serve`'s Messages API with the official `anthropic` client; prints what it got
as one JSON line.

Usage: python3 tests/anthropic_client.py BASE_URL   (BASE_URL like http://127.0.0.1:8000)
"""

import json
import sys

import anthropic

client = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused")
question = [{"role": "user", "content": "What is the capital of France?"}]
# Current clients no longer take `temperature`; the server reads it from the body (greedy here).
greedy = {"extra_body": {"temperature": 0}}


def text_of(message):
    return "".join(block.text for block in message.content if block.type == "text")


whole = client.messages.create(model="smollm2", max_tokens=12, messages=question, **greedy)
with client.messages.stream(model="smollm2", max_tokens=12, messages=question, **greedy) as stream:
    streamed = "".join(stream.text_stream)
    streamed_final = stream.get_final_message()
# A stop sequence: the answer's second word.
word = text_of(whole).split()[1]
stopped = client.messages.create(model="smollm2", max_tokens=12, messages=question, stop_sequences=[word], **greedy)
counted = client.messages.count_tokens(model="smollm2", messages=question)

tools = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]
weather = [{"role": "user", "content": "What is the weather in Paris?"}]
named = {"type": "tool", "name": "get_weather"}
called = client.messages.create(
    model="smollm2", max_tokens=40, messages=weather, tools=tools, tool_choice=named, **greedy
)
use = [block for block in called.content if block.type == "tool_use"][0]
with client.messages.stream(
    model="smollm2", max_tokens=40, messages=weather, tools=tools, tool_choice=named, **greedy
) as stream:
    streamed_use = [block for block in stream.get_final_message().content if block.type == "tool_use"][0]
followed = client.messages.create(
    model="smollm2",
    max_tokens=12,
    tools=tools,
    **greedy,
    messages=weather
    + [
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]},
    ],
)
# `auto` (the default with tools), the answer held to a Hermes call by a regular expression.
hermes_call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
auto = client.messages.create(
    model="smollm2",
    max_tokens=150,
    messages=weather,
    tools=tools,
    extra_body={"temperature": 0, "structured_outputs": {"regex": hermes_call}},
)

print(
    json.dumps(
        {
            "text": text_of(whole),
            "stop_reason": whole.stop_reason,
            "usage": [whole.usage.input_tokens, whole.usage.output_tokens],
            "streamed": streamed,
            "streamed_final": text_of(streamed_final),
            "streamed_stop_reason": streamed_final.stop_reason,
            "word": word,
            "stopped": [text_of(stopped), stopped.stop_reason, stopped.stop_sequence],
            "counted": counted.input_tokens,
            "use": [use.name, use.input, called.stop_reason],
            "streamed_use": [streamed_use.name, streamed_use.input],
            "after_the_call": text_of(followed),
            "auto": [[b.type, getattr(b, "name", None), getattr(b, "input", None)] for b in auto.content],
            "auto_stop_reason": auto.stop_reason,
        }
    )
)
