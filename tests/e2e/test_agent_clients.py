"""An agent framework's OpenAI client against a live server on the embedded
model (issue #21, item 4): LangChain's ChatOpenAI with bind_tools (a forced
call, the tool run and its result sent back, streamed calls merged as
LangChain merges them) and with_structured_output by JSON schema and by
function calling, the answers parsed into the caller's pydantic model."""

from __future__ import annotations

import langchain_openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from tests.e2e.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [HumanMessage("What is the weather in Paris?")]


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"18 degrees and sunny in {city}"


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def llm():
    server = ServerProcess("--max-model-len", "2048")
    yield langchain_openai.ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL,
                                      temperature=0, max_tokens=80)
    server.stop()


def test_bind_tools_calls_and_takes_the_result_back(llm):
    asked = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    [call] = asked.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"].startswith("call_")
    result = get_weather.invoke(call["args"])
    answer = llm.bind_tools([get_weather]).invoke([*QUESTION, asked, ToolMessage(result, tool_call_id=call["id"])])
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls)


def test_streamed_tool_calls_merge_into_one_call(llm):
    chunks = list(llm.bind_tools([get_weather], tool_choice="any").stream(QUESTION))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.tool_calls and all(call["name"] == "get_weather" for call in merged.tool_calls)
    assert all(isinstance(call["args"].get("city"), str) for call in merged.tool_calls)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_parses_into_the_model(llm, method):
    person = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
    assert isinstance(person, Person)
