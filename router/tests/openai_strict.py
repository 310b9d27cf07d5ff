"""The official `openai` Python client, with strict response validation, against a running
router: every response and streamed chunk must parse into the client's own types. Chat and
completions, streamed and not, log-probabilities, structured output (the client's own
`parse` helper with a Pydantic model), and a refused field as the client's error type.

Run by router/tests/it/openai_client.rs: `python3 openai_strict.py BASE_URL TOOLS_URL`
(TOOLS_URL: a router whose nodes have a tool template: a tool call round trip, streamed
and not), with the client installed by scripts/test.sh (PYTHONPATH=.build/openai-py).
"""

import json
import math
import sys

import openai
import pydantic
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", _strict_response_validation=True)
model = client.models.list().data[0].id
hi = [{"role": "user", "content": "Name a colour."}]

# Chat, with log-probabilities.
r = client.chat.completions.create(
    model=model, messages=hi, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
)
choice = r.choices[0]
entries = choice.logprobs.content
assert entries and len(entries) <= r.usage.completion_tokens, r
assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in entries) == choice.message.content, r
for e in entries:
    assert e.logprob <= 0 and len(e.top_logprobs) == 2, e
    assert e.top_logprobs[0].token == e.token and math.isclose(e.top_logprobs[0].logprob, e.logprob), e

# The same, streamed: the same tokens and values.
streamed = []
text = ""
usage = None
for chunk in client.chat.completions.create(
    model=model, messages=hi, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
    stream=True, stream_options={"include_usage": True},
):
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        text += c.delta.content or ""
        if c.logprobs and c.logprobs.content:
            streamed += c.logprobs.content
assert text == choice.message.content, (text, choice.message.content)
assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
assert usage.completion_tokens == r.usage.completion_tokens

# Completions, with log-probabilities.
c = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
)
lp = c.choices[0].logprobs
assert "".join(lp.tokens) == c.choices[0].text, c
assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs), c
# Streamed completions: the client types every chunk as a whole `Completion`, whose
# `finish_reason` may not be null, while the API (and this router, and llama-server) sends
# null until the last chunk; so this one call goes through a client without strict
# validation.
lenient = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
chunks = list(lenient.completions.create(
    model=model, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True
))
assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text


# Structured output through the client's own helper: a Pydantic model as the schema.
class Planet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    order: int = pydantic.Field(ge=1, le=9)


class Planets(pydantic.BaseModel):
    planets: list[Planet] = pydantic.Field(min_length=2, max_length=2)


parsed = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Name the first two planets from the Sun."}],
    response_format=Planets,
    max_tokens=96,
    temperature=0,
)
got = parsed.choices[0].message.parsed
assert isinstance(got, Planets) and len(got.planets) == 2, parsed

obj = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "A cat, as JSON."}],
    response_format={"type": "json_object"}, max_tokens=48, temperature=0,
)
assert obj.choices[0].message.content.lstrip().startswith("{"), obj

# What we do not do is the client's BadRequestError, naming the field.
try:
    client.chat.completions.create(
        model=model, messages=hi, max_tokens=4,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    )
    raise AssertionError("tools were accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "tools", e.body

# A tool call round trip, through a stack whose template takes tools.
tools_client = OpenAI(base_url=sys.argv[2] + "/v1", api_key="unused", _strict_response_validation=True)
tools = [{"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
                   "required": ["timezone"], "additionalProperties": False}}}]
ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
forced = {"type": "function", "function": {"name": "get_time"}}
r = tools_client.chat.completions.create(
    model=model, messages=ask, tools=tools, tool_choice=forced, parallel_tool_calls=False,
    max_tokens=64, temperature=0,
)
call_choice = r.choices[0]
assert call_choice.finish_reason == "tool_calls", r
(call,) = call_choice.message.tool_calls
assert call.type == "function" and call.function.name == "get_time" and call.id, call
assert "timezone" in json.loads(call.function.arguments), call
streamed_calls = {}
finish = None
for chunk in tools_client.chat.completions.create(
    model=model, messages=ask, tools=tools, tool_choice=forced, parallel_tool_calls=False,
    max_tokens=64, temperature=0, stream=True,
):
    for c in chunk.choices:
        finish = c.finish_reason or finish
        for d in c.delta.tool_calls or []:
            name, args = streamed_calls.get(d.index, ("", ""))
            streamed_calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
assert finish == "tool_calls", finish
assert streamed_calls == {0: (call.function.name, call.function.arguments)}, streamed_calls
answer = tools_client.chat.completions.create(
    model=model, tools=tools, max_tokens=24, temperature=0,
    messages=ask + [call_choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "14:05"}],
)
assert answer.choices[0].message.content or answer.choices[0].message.tool_calls, answer

print("ok:", json.dumps({"chat": choice.message.content, "planets": got.model_dump(),
                         "call": call.function.arguments}))
