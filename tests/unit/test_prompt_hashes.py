"""The router's block hashes of a request are the ones its replica registers:
the direct chat rendering and the memo of shared beginnings are shortcuts that
never change a hash."""

import copy
import random

import pytest

from heron.core.hashing import prompt_block_hashes
from heron.engine.input_processor import InputProcessor
from heron.router.chat_render import ChatSkeletons, DirectChatRenderer, substitutes_content_only
from heron.router.prompt_hashes import CHAT_PATH, PrefixHashMemo, PromptHasher

SYSTEMS = ["You answer questions about estuary birds. " * 20, "You are terse.", "Ünïcode 🦩 and\ttabs  " * 9]
WORDS = ["heron", "egret", "  ", "\n", "<|im_start|>", "<|im_end|>", "mud", "🦩", "2+2?", "x" * 70]


@pytest.fixture(scope="module")
def hasher() -> PromptHasher:
    return PromptHasher(None)


def _replica_hashes(hasher: PromptHasher, body: dict, block_size: int) -> list[bytes]:
    """What the replica does: apply_chat_template, the tokenizer, the hash chain."""
    processor = hasher.processor
    if "messages" in body:
        text = processor.render_chat(body["messages"], add_generation_prompt=body.get("add_generation_prompt", True))
        ids = processor.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = processor.tokenizer.encode(body["prompt"], add_special_tokens=True)
    return prompt_block_hashes(ids, block_size, body.get("cache_salt"))


def _conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.8 else []
    for turn in range(rng.randint(1, 4)):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})
    return messages


def test_the_router_hashes_what_the_replica_registers(hasher):
    # the shortcuts are in use here
    assert hasher._chat is not None and hasher._chat._skeletons is not None and hasher._memo is not None
    rng = random.Random(3)
    for _ in range(150):
        block_size = rng.choice([4, 16])
        body: dict = {"messages": _conversation(rng), "add_generation_prompt": rng.random() < 0.8}
        if rng.random() < 0.3:
            body["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
        expected = _replica_hashes(hasher, body, block_size)
        assert hasher.block_hashes(CHAT_PATH, body, block_size) == expected
        prompt = {"prompt": rng.choice(SYSTEMS) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 20)))}
        assert hasher.block_hashes("/v1/completions", prompt, block_size) == _replica_hashes(hasher, prompt,
                                                                                            block_size)


def test_a_completion_without_special_tokens_is_hashed_as_the_replica_encodes_it(hasher):
    """``add_special_tokens: false`` on /v1/completions: the replica encodes the
    text without the tokenizer's BOS, and the router hashed it with, so on a
    BOS-adding tokenizer (Llama's) no block it computed ever matched."""
    body = {"prompt": "herons wait " * 30, "add_special_tokens": False}
    assert hasher._prompt("/v1/completions", body) == (body["prompt"], False)
    assert hasher._prompt("/v1/completions", {"prompt": "x"}) == ("x", True)
    ids = hasher.processor.tokenizer.encode(body["prompt"], add_special_tokens=False)
    assert hasher.block_hashes("/v1/completions", body, 16) == prompt_block_hashes(ids, 16)


def test_messages_that_are_not_plain_take_the_long_way_to_the_same_hashes(hasher):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "tell me about herons " * 6}]}]}
    named = {"messages": [{"role": "user", "content": "tell me about herons " * 6, "name": "ann"}]}
    for body in (parts, named):
        assert hasher._chat.render(body["messages"], True) is None
        flat = {"messages": [{"role": "user", "content": "tell me about herons " * 6}]}
        assert hasher.block_hashes(CHAT_PATH, body, 16) == _replica_hashes(hasher, flat, 16)


def test_a_template_that_renders_differently_is_not_taken_directly(hasher):
    class Lying:
        tokenizer = hasher.processor.tokenizer

        @staticmethod
        def render_chat(messages, add_generation_prompt=True):
            return "something else"

    assert DirectChatRenderer.create(Lying()) is None  # type: ignore[arg-type]


def _processor_with_template(hasher: PromptHasher, template: str) -> InputProcessor:
    tokenizer = copy.copy(hasher.processor.tokenizer)  # the session's tokenizer keeps its own template
    tokenizer.chat_template = template
    return InputProcessor(hasher.processor.model_config, tokenizer)


def test_a_template_that_refuses_some_conversations_is_still_taken_directly(hasher):
    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                 "{% endif %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
    processor = _processor_with_template(hasher, no_system)
    renderer = DirectChatRenderer.create(processor)
    assert renderer is not None
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    expected = "<user>Hi</s><assistant>Hello</s><assistant>"
    assert renderer.render(messages, True) == processor.render_chat(messages) == expected
    with pytest.raises(Exception, match="no system role"):
        renderer.render([{"role": "system", "content": "s"}, *messages], True)
    # a template that refuses every sample verifies nothing: not taken
    assert DirectChatRenderer.create(_processor_with_template(hasher, "{{ raise_exception('never') }}")) is None


def test_the_memo_is_bounded_and_starts_over(hasher):
    memo = PrefixHashMemo(hasher._segments, max_tokens=200)
    rng = random.Random(5)
    for _ in range(60):
        text = rng.choice(SYSTEMS) + "<|im_end|>" + " ".join(rng.choice(WORDS) for _ in range(20))
        ids = hasher._segments.encode(text)
        assert memo.block_hashes(text, 16, None) == prompt_block_hashes(ids, 16)
        assert memo._tokens <= 200 + len(ids)


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")


@pytest.mark.parametrize("template, expected", [
    (CHATML, True),
    ("{% for m in messages %}[{{ m.role }}]{{ m.content ~ '|' }}{% endfor %}", True),
    ("{% for m in messages %}{{ m['content'] | trim }}{% endfor %}", False),
    ("{% for m in messages %}{% if '</think>' in m['content'] %}x{% endif %}{{ m['content'] }}{% endfor %}", False),
    ("{% set first = messages[0]['content'] %}{{ first }}", False),
    ("{% for m in messages %}{{ m.get('content') }}{% endfor %}", False),
    ("{% for m in messages %}{{ m.content if m.role == 'user' else '' }}{% endfor %}", False),
    ("{% for m in messages %}{{ m.content.upper() }}{% endfor %}", False),
    ("{{ messages[0].content + messages[0].content|length|string }}", False),
    ("{% for m in", False),
    ("{% for m in messages[1:] %}{{ m.content }}{% endfor %}{{ messages[-1]['role'] }}", True),
    # what the review of the first version found: each of these changes or tests what it writes
    ("<s>Today is {{ strftime_now('%d %b %Y') }}.{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% for m in messages %}{% filter upper %}{{ m.content }}{% endfilter %}{% endfor %}", False),
    ("{% for m in messages %}{% set c %}{{ m.content }}{% endset %}{% if '<' in c %}T{% endif %}{% endfor %}",
     False),
    ("{% macro body(m) %}{{ m.content }}{% endmacro %}{% for m in messages %}{{ body(m)|length }}{% endfor %}",
     False),
    ("{% macro w() %}{{ caller() }}{% endmacro %}{% for m in messages %}{% call w() %}{{ m.content }}{% endcall %}"
     "{% endfor %}", False),
    ("{% for m in messages %}{% for k, v in m.items() %}{{ v }}{% endfor %}{% endfor %}", False),
    ("{% for m in messages %}{% for k, v in m|dictsort %}{{ v }}{% endfor %}{% endfor %}", False),
    ("{% for m in messages %}{% for k in m %}{{ m[k] }}{% endfor %}{% endfor %}", False),
    ("{% for m in messages %}{{ m['con' ~ 'tent'] }}{% endfor %}", False),
    ("{% if messages|tojson|length > 100 %}LONG{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}", False),
])
def test_only_templates_that_write_content_out_as_it_is_get_skeletons(template, expected):
    assert substitutes_content_only(template) is expected


def test_skeletons_render_as_the_template_does_and_fall_back_where_they_cannot(hasher):
    twice = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
             "{% if messages|length > 2 %}again: {{ messages[0]['content'] }}{% endif %}")
    rng = random.Random(11)
    for template in (CHATML, twice, hasher.processor.tokenizer.chat_template):
        processor = _processor_with_template(hasher, template)
        renderer = DirectChatRenderer.create(processor)
        assert renderer is not None and renderer._skeletons is not None
        for _ in range(60):
            messages = _conversation(rng)
            add_generation_prompt = rng.random() < 0.7
            assert renderer.render(messages, add_generation_prompt) == processor.render_chat(
                messages, add_generation_prompt=add_generation_prompt)
    # a conversation of three, whose first content the template writes twice, has no skeleton
    renderer = DirectChatRenderer.create(_processor_with_template(hasher, twice))
    three = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert renderer.render(three, False) == "<user>a</s><assistant>b</s><user>c</s>again: a"
    assert renderer._skeletons._shapes[(("user", "assistant", "user"), False)] is None
    assert renderer.render(three[:1], False) == "<user>a</s>"
    assert renderer._skeletons._shapes[(("user",), False)] is not None


def test_a_shape_whose_markers_do_not_come_back_is_always_rendered():
    calls = []

    def render(messages, add_generation_prompt):
        calls.append(messages)
        return "".join(m["content"].strip() for m in messages)  # changes what it is given: no skeleton holds

    skeletons = ChatSkeletons(render, max_shapes=2)
    messages = [{"role": "user", "content": "  padded  "}]
    assert skeletons.render(messages, True) == "padded"
    assert skeletons._shapes[(("user",), True)] is None
    calls.clear()
    assert skeletons.render(messages, True) == "padded" and len(calls) == 1  # rendered, not learnt again
    for roles in (("system",), ("assistant",), ("user", "user")):  # past max_shapes: starts over
        skeletons.render([{"role": role, "content": "x"} for role in roles], False)
        assert len(skeletons._shapes) <= 2


def test_a_learnt_shape_is_filled_in_without_the_template():
    calls = []

    def render(messages, add_generation_prompt):
        calls.append(len(messages))
        text = "".join(f"<{m['role']}>{m['content']}</s>" for m in messages)
        return text + ("<gen>" if add_generation_prompt else "")

    skeletons = ChatSkeletons(render)
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert skeletons.render(first, True) == "<system>be brief</s><user>hi</s><gen>"
    learnt = len(calls)  # the markers' renders
    for text in ("another question", " spaced\n", "{{ braces }}", ""):
        second = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
        assert skeletons.render(second, True) == render(second, True)
    assert len(calls) == learnt + 4  # only the reference renders above: the skeleton ran none


def test_templates_with_loop_controls_are_read_in_the_environment_they_were_compiled_in(hasher):
    template = ("{% for m in messages %}{% if loop.index > 8 %}{% break %}{% endif %}"
                "<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}")
    assert not substitutes_content_only(template)  # a plain environment cannot parse {% break %}
    processor = _processor_with_template(hasher, template)
    renderer = DirectChatRenderer.create(processor)
    assert renderer is not None and renderer._skeletons is not None
    messages = [{"role": "user", "content": "Hi"}]
    assert renderer.render(messages, False) == processor.render_chat(messages, add_generation_prompt=False)


def test_text_parts_are_rendered_one_a_line_as_vllm_does(hasher):
    """They were joined with nothing: "Translate to French:" and "Good morning" read "French:Good morning"."""
    parts = [{"type": "text", "text": "Translate to French:"}, {"type": "text", "text": "Good morning"}]
    rendered = hasher.processor.render_chat([{"role": "user", "content": parts}])
    assert "Translate to French:\nGood morning" in rendered
