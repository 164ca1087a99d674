"""Instruction data: chat templates rendered and tokenized exactly as transformers' apply_chat_template, the
assistant-only loss mask (prefix renders, or `{% generation %}` blocks as return_assistant_tokens_mask), the
Alpaca format with and without a chat template, the sandbox, and one-line errors for malformed JSONL."""

import json

import pytest

from megatrain.runtime import chat
from megatrain.runtime.data import DataError
from megatrain.runtime.tokenizer import Tokenizer

# Qwen2.5-Instruct's template: a default system prompt, tools, tool calls and tool responses
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-3-Instruct's template: bos_token first, header ids, <|eot_id|> after every turn, contents trimmed
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# ChatML with {% generation %} around what the assistant writes (as in TRL's training templates)
GENERATION = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
              "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Zephyr-style, written with plain block tags on their own lines (trim_blocks and lstrip_blocks tidy them),
# strftime_now and dict() as Llama 3.1 uses them, and an optional key (None-valued keys must be absent)
ZEPHYR = """{% set meta = dict(year=strftime_now('%Y')) %}
<|system|>
Knowledge up to {{ meta.year }}.<|im_end|>
{% for message in messages %}
    {% if message['role'] == 'user' %}
<|user|>
{{ message['content'] }}<|im_end|>
    {% elif message['role'] == 'assistant' %}
<|assistant|>{% if message.name is defined %} ({{ message.name }}){% endif %}

{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""

# Qwen3-style: reasoning shown only after the last user turn, so earlier turns are rewritten (not prefix-stable)
REWRITES = ("{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
            "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
            "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}"
            "{%- if m.role == 'assistant' and m.reasoning_content is defined and loop.index0 > ns.last_user %}"
            "{{ '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{%- endif %}"
            "{{ m.content + '<|im_end|>\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")

TWO_TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And naïve 東京?"},
    {"role": "assistant", "content": "  Spaces kept\n", "name": None},  # None-valued keys are dropped
]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *TWO_TURNS[:2]]
TOOL_CALL = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "18°C"},
    {"role": "assistant", "content": "18°C in Zürich."},
]
CONVERSATIONS = {"two turns": TWO_TURNS, "system": WITH_SYSTEM, "one turn": TWO_TURNS[:2]}
TEMPLATES = {"qwen2.5": QWEN25, "llama3": LLAMA3, "generation": GENERATION, "zephyr": ZEPHYR}
# what the mask must cover, decoded: each assistant turn's content and its end-of-turn token
EXPECTED_MASKED = {
    ("qwen2.5", "two turns"): ["It is 4.<|im_end|>", "  Spaces kept\n<|im_end|>"],
    ("qwen2.5", "system"): ["It is 4.<|im_end|>"],
    ("llama3", "two turns"): ["It is 4.<|eot_id|>", "Spaces kept<|eot_id|>"],  # the template trims contents
    ("llama3", "system"): ["It is 4.<|eot_id|>"],
    ("generation", "two turns"): ["It is 4.<|im_end|>", "  Spaces kept\n<|im_end|>"],
    ("zephyr", "two turns"): ["It is 4.<|im_end|>", "  Spaces kept\n<|im_end|>"],
}


@pytest.fixture
def folder_for(hf_folder):
    """make(template) -> (our Tokenizer, transformers' tokenizer) of one folder with that chat template."""

    def make(template, name="chat"):
        folder, hf = hf_folder(name, chat_template=template, bos_token="<|begin_of_text|>",
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
        return Tokenizer.from_dir(folder), hf

    return make


def hf_ids(hf, messages, **kwargs):
    out = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return out if isinstance(out, list) else out["input_ids"]  # v5 returns a BatchEncoding


def masked_runs(tok, ids, mask):
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


# -- rendering and ids as transformers ----------------------------------------------------------------------
@pytest.mark.parametrize("template", TEMPLATES)
def test_render_and_ids_equal_transformers(template, folder_for):
    tok, hf = folder_for(TEMPLATES[template])
    for messages in [*CONVERSATIONS.values(), TOOL_CALL] if template == "qwen2.5" else CONVERSATIONS.values():
        for prompt in (False, True):
            text = chat.render(tok.chat_template, messages, tok.special_tokens, add_generation_prompt=prompt)
            assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        ids, mask = chat.chat_example(tok, messages)
        assert ids == hf_ids(hf, messages)
        assert len(mask) == len(ids) and set(mask) == {0, 1}


@pytest.mark.parametrize("template, conversation", EXPECTED_MASKED)
def test_mask_covers_assistant_contents_and_end_of_turn(template, conversation, folder_for):
    tok, _ = folder_for(TEMPLATES[template])
    ids, mask = chat.chat_example(tok, CONVERSATIONS[conversation])
    assert masked_runs(tok, ids, mask) == EXPECTED_MASKED[template, conversation]


def test_zephyr_layout_and_none_valued_keys(folder_for):
    tok, _ = folder_for(ZEPHYR)
    text = chat.render(tok.chat_template, TWO_TURNS, tok.special_tokens, add_generation_prompt=True)
    assert text.startswith("<|system|>\nKnowledge up to 2") and "None" not in text
    assert text.endswith("<|assistant|>\n  Spaces kept\n<|im_end|>\n<|assistant|>\n")  # trim_blocks ate a newline
    named = [TWO_TURNS[0], {**TWO_TURNS[1], "name": "bot"}]
    assert "<|assistant|> (bot)\nIt is 4." in chat.render(tok.chat_template, named, {})


def test_tool_call_turns_are_learned_whole(folder_for):
    tok, _ = folder_for(QWEN25)
    ids, mask = chat.chat_example(tok, TOOL_CALL)
    assert masked_runs(tok, ids, mask) == [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>',  # tojson
        "18°C in Zürich.<|im_end|>",
    ]


def test_generation_blocks_mask_equals_return_assistant_tokens_mask(folder_for):
    tok, hf = folder_for(GENERATION)
    for messages in CONVERSATIONS.values():
        ids, mask = chat.chat_example(tok, messages)
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == out["input_ids"] and mask == out["assistant_masks"]


def test_reasoning_aliases_and_prefix_stability(folder_for):
    tok, hf = folder_for(REWRITES)
    one = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning": "greet"}]
    assert chat.render(tok.chat_template, one, tok.special_tokens) == hf.apply_chat_template(one, tokenize=False)
    ids, mask = chat.chat_example(tok, one)  # one turn: the reasoning stays, so the template is prefix-stable
    assert ids == hf_ids(hf, one)
    assert masked_runs(tok, ids, mask) == ["<think>\ngreet\n</think>\n\nHello<|im_end|>"]
    with pytest.raises(DataError) as e:  # a later user turn hides the earlier reasoning: refused, not mis-masked
        chat.chat_example(tok, [*one, {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Hi"}])
    message = str(e.value)
    assert "\n" not in message and "not prefix-stable" in message and "{% generation %}" in message
    assert "chat_template.jinja" in message


# -- Alpaca -------------------------------------------------------------------------------------------------
def test_alpaca_through_the_chat_template(folder_for):
    tok, hf = folder_for(QWEN25)
    record = {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}
    ids, mask = chat.alpaca_example(tok, record)
    messages = [{"role": "user", "content": "Translate to French.\n\nGood morning"},
                {"role": "assistant", "content": "Bonjour"}]
    assert ids == hf_ids(hf, messages) and masked_runs(tok, ids, mask) == ["Bonjour<|im_end|>"]
    ids, _ = chat.alpaca_example(tok, {"instruction": "Say hi.", "input": "", "output": "hi"})
    assert ids == hf_ids(hf, [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize("kind", ["bytes", "hf without a template"])
def test_alpaca_without_a_template_is_the_stanford_prompt(kind, hf_folder):
    if kind == "bytes":
        tok, bos = Tokenizer.bytes(), ""
    else:
        tok, bos = Tokenizer.from_dir(hf_folder(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")[0]), \
            "<|begin_of_text|>"
    eos = tok.decode([tok.eos_id])
    ids, mask = chat.alpaca_example(tok, {"instruction": "Name a color.", "output": "Blue."})
    assert tok.decode(ids) == (f"{bos}Below is an instruction that describes a task. Write a response that "
                               "appropriately completes the request.\n\n### Instruction:\nName a color.\n\n"
                               f"### Response:Blue.{eos}")
    assert masked_runs(tok, ids, mask) == [f"Blue.{eos}"] and ids[-1] == tok.eos_id
    ids, mask = chat.alpaca_example(tok, {"instruction": "Add.", "input": "2 3", "output": "5"})
    assert tok.decode(ids).startswith(
        f"{bos}Below is an instruction that describes a task, paired with an input that provides further context.")
    assert "### Instruction:\nAdd.\n\n### Input:\n2 3\n\n### Response:5" in tok.decode(ids)
    assert masked_runs(tok, ids, mask) == [f"5{eos}"]


# -- templates a user must fix, and the sandbox -------------------------------------------------------------
@pytest.mark.parametrize("template, expected", [
    ("{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}",
     "rendering failed: Conversations must start with user"),
    ("{% for m in messages %}{{ m.content }", "line 1:"),
    ("{{ ''.__class__.__mro__ }}", "rendering failed: access to attribute '__class__'"),
    ("{% set ns = namespace(_x=1) %}", "underscore-prefixed"),
    ("{{ messages | attr('append') }}{% set x = messages.append(1) %}", "rendering failed"),
])
def test_template_errors_and_sandbox_escapes_are_one_line(template, expected):
    messages = [{"role": "system", "content": "s\nx"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError) as e:
        chat.render(template, messages, {}, source="t.jinja")
    assert "\n" not in str(e.value) and str(e.value).startswith("t.jinja: ") and expected in str(e.value)


def test_chat_example_needs_a_template_and_assistant_text(hf_folder, folder_for):
    with pytest.raises(DataError, match="bytes has no chat template"):
        chat.chat_example(Tokenizer.bytes(), TWO_TURNS)
    tok, _ = folder_for(GENERATION)
    with pytest.raises(DataError, match="no assistant text"):
        chat.chat_example(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(DataError, match="opens with an assistant turn"):
        chat.chat_example(folder_for(QWEN25, "q")[0], [{"role": "assistant", "content": "hi"}])


# -- reading JSONL ------------------------------------------------------------------------------------------
def write_lines(path, *lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_read_examples_yields_records_with_line_numbers(tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", {"messages": TWO_TURNS}, "", "   ", {"messages": TOOL_CALL})
    assert [(kind, n) for kind, _, n in chat.read_examples(path)] == [("chat", 1), ("chat", 4)]
    path = write_lines(tmp_path / "alpaca.jsonl", {"instruction": "a", "output": "b"},
                       {"instruction": "a", "input": None, "output": "b"}, {"instruction": "a", "input": "i", "output": "b"})
    records = list(chat.read_examples(path))
    assert [kind for kind, _, _ in records] == ["alpaca"] * 3 and records[2][1]["input"] == "i"


MALFORMED = {
    "not JSON": ('{"messages": [', "data.jsonl:2: not valid JSON"),
    "not an object": ("[1, 2]", "data.jsonl:2: expected a JSON object with \"messages\""),
    "messages not a list": ({"messages": "hi"}, "data.jsonl:2: messages: expected a list"),
    "empty conversation": ({"messages": []}, "data.jsonl:2: messages: an empty conversation"),
    "message not an object": ({"messages": ["hi"]}, "data.jsonl:2: messages[0]: expected an object"),
    "role missing": ({"messages": [{"content": "x"}]}, "data.jsonl:2: messages[0].role: missing"),
    "role not a string": ({"messages": [{"role": "user", "content": "x"}, {"role": 3, "content": "y"},
                                        {"role": "assistant", "content": "z"}]},
                          "data.jsonl:2: messages[1].role: expected a string"),
    "content missing": ({"messages": [{"role": "user"}]}, "data.jsonl:2: messages[0].content: missing"),
    "content not a string": ({"messages": [{"role": "user", "content": 5}]},
                             "data.jsonl:2: messages[0].content: expected a string"),
    "no assistant turn": ({"messages": [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}]},
                          "data.jsonl:2: messages: no assistant turn"),
    "instruction missing": ({"output": "x"}, "data.jsonl:2: instruction: missing"),
    "output missing": ({"instruction": "x"}, "data.jsonl:2: output: missing"),
    "output not a string": ({"instruction": "x", "output": ["y"]}, "data.jsonl:2: output: expected a string"),
    "input not a string": ({"instruction": "x", "input": 1, "output": "y"}, "data.jsonl:2: input: expected a string"),
    "mixed formats": ({"instruction": "x", "output": "y"}, "data.jsonl:2: an alpaca record in a file of chat records"),
    "nested too deeply": ("[" * 100_000 + "]" * 100_000, "data.jsonl:2: not valid JSON (RecursionError"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_lines_give_one_line_naming_file_line_and_field(case, tmp_path):
    line, expected = MALFORMED[case]
    first = {"messages": TWO_TURNS} if case == "mixed formats" or "messages" in str(line) else \
        {"instruction": "ok", "output": "ok"}
    path = write_lines(tmp_path / "data.jsonl", first, line)
    with pytest.raises(DataError) as e:
        list(chat.read_examples(path))
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path / expected)), str(e.value)


def test_read_examples_refuses_missing_files_and_bad_utf8(tmp_path):
    with pytest.raises(DataError, match="instruction file not found"):
        list(chat.read_examples(tmp_path / "none.jsonl"))
    (tmp_path / "bad.jsonl").write_bytes(b'{"instruction": "\xff", "output": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: not UTF-8"):
        list(chat.read_examples(tmp_path / "bad.jsonl"))
