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

# The Responses API: the same question as the chat above, whole and streamed; a named
# function's call, then the next turn with its output; `auto` held to a Hermes call.
response = client.responses.create(model="smollm2", input="What is the capital of France?", max_output_tokens=12, temperature=0)
response_pieces, response_final = [], None
for event in client.responses.create(
    model="smollm2", input="What is the capital of France?", max_output_tokens=12, temperature=0, stream=True
):
    if event.type == "response.output_text.delta":
        response_pieces.append(event.delta)
    if event.type in ("response.completed", "response.incomplete"):
        response_final = event.response
# Log-probabilities of the answer's tokens, two alternatives each: chat's, the Responses
# API's (whole and streamed, where `include` asks for them).
chat_logprobs = client.chat.completions.create(
    model="smollm2", messages=question, max_completion_tokens=12, temperature=0, logprobs=True, top_logprobs=2
).choices[0].logprobs.content
scored = client.responses.create(
    model="smollm2", input="What is the capital of France?", max_output_tokens=12, temperature=0,
    top_logprobs=2, include=["message.output_text.logprobs"],
)
streamed_logprobs = []
for event in client.responses.create(
    model="smollm2", input="What is the capital of France?", max_output_tokens=12, temperature=0,
    top_logprobs=2, include=["message.output_text.logprobs"], stream=True,
):
    if event.type == "response.output_text.delta":
        streamed_logprobs.extend(event.logprobs)
as_lists = lambda entries: [[e.token, e.logprob, [[a.token, a.logprob] for a in e.top_logprobs]] for e in entries]
flat_tools = [{"type": "function", **tools[0]["function"]}]
weather_text = weather[0]["content"]
named_response = client.responses.create(
    model="smollm2",
    input=weather_text,
    tools=flat_tools,
    tool_choice={"type": "function", "name": "get_weather"},
    max_output_tokens=40,
    temperature=0,
)
response_call = [item for item in named_response.output if item.type == "function_call"][0]
followed = client.responses.create(
    model="smollm2",
    input=[
        {"role": "user", "content": weather_text},
        {"type": "function_call", "call_id": response_call.call_id, "name": response_call.name, "arguments": response_call.arguments},
        {"type": "function_call_output", "call_id": response_call.call_id, "output": "18 C and sunny"},
    ],
    max_output_tokens=12,
    temperature=0,
)
auto_response = client.responses.create(
    model="smollm2",
    input=weather_text,
    tools=flat_tools,
    max_output_tokens=150,
    temperature=0,
    extra_body={"structured_outputs": {"regex": hermes_call}},
)

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
            "responses_text": response.output_text,
            "responses_status": response.status,
            "responses_usage": [response.usage.input_tokens, response.usage.output_tokens],
            "responses_stream": "".join(response_pieces),
            "responses_stream_text": response_final.output_text,
            "responses_call": [response_call.name, response_call.arguments],
            "responses_after_the_call": followed.output_text,
            "responses_auto": [[i.type, getattr(i, "name", None), getattr(i, "arguments", None)] for i in auto_response.output],
            "chat_logprobs": as_lists(chat_logprobs),
            "responses_logprobs": as_lists(scored.output[0].content[0].logprobs),
            "responses_stream_logprobs": as_lists(streamed_logprobs),
            "responses_plain_logprobs": response.output[0].content[0].logprobs,
        }
    )
)
