"""Instruction data: chat templates rendered as transformers renders them, and assistant-only loss masks.

Where it sits: between instruction JSONL and token files. `read_examples(path)` checks and yields the records
of a chat (`{"messages": [...]}`) or Alpaca (`{"instruction", "input"?, "output"}`) file; `chat_example` and
`alpaca_example` turn one record into (token ids, loss mask) with a `Tokenizer` (tokenizer.py).
Try it: `.venv/bin/python -c "from megatrain.runtime import chat, tokenizer as t;
print(chat.chat_example(t.Tokenizer.from_dir('DIR'), [{'role': 'user', 'content': 'hi'},
{'role': 'assistant', 'content': 'hello'}]))"`. Run its tests: `.venv/bin/pytest tests/runtime/test_chat.py`.

- `render` is transformers' `apply_chat_template(..., tokenize=False)` (5.x): the same sandboxed jinja2
  environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, the `generation` tag,
  its `tojson`, `raise_exception`, `strftime_now`, `dict` and `namespace`), the special tokens as template
  variables, messages with None-valued keys dropped, rebuilt from plain JSON types, and reasoning aliased
  (`reasoning_content` / `thinking` / `reasoning`). Chat templates are untrusted code: only the sandbox runs them.
- `chat_example` tokenizes the whole rendered conversation in one call, so its ids equal
  `apply_chat_template(messages, tokenize=True)`. The mask is 1 on the tokens of assistant turns: with
  `{% generation %}` blocks, every token overlapping a block (transformers' `return_assistant_tokens_mask`);
  otherwise, for assistant message i, the text that rendering messages[:i+1] adds to rendering messages[:i]
  with the generation prompt: the assistant's content and the end-of-turn tokens after it (`<|im_end|>`,
  `<|eot_id|>`), less the whitespace a template writes after them between turns (ChatML's newline), which
  the model never emits. Each prefix render must be a prefix of the full render; a template that rewrites
  earlier turns (e.g. drops past reasoning) is refused, unless it marks its turns with `{% generation %}`.
- `alpaca_example` makes a user and an assistant message when the tokenizer has a chat template; without one
  it writes the Stanford Alpaca prompt and learns the output and a final eos.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from .chat_limits import MAX_RENDER_CHARS, RenderLimit, bounded_json_lines, render_limits
from .data import DataError

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' test for `{% generation %}`
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
ALPACA_PROMPT_INPUT = (  # Stanford Alpaca's PROMPT_DICT["prompt_input"]
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_PROMPT_NO_INPUT = (  # Stanford Alpaca's PROMPT_DICT["prompt_no_input"]
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# -- the jinja2 environment of transformers -----------------------------------------------------------------
@lru_cache(maxsize=32)
def compile_template(template: str):
    """The template compiled in transformers' sandboxed environment (cached by its text)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes

    from .chat_limits import BoundedEnvironment, bounded_filter, check_size

    if tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        raise DataError(f"chat templates need jinja2>=3.1.6 (older versions have sandbox escapes), found "
                        f"{jinja2.__version__}: pip install -U jinja2")

    class AssistantTracker(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span of each block while tracking."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._tracking = ContextVar("assistant_tracker", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller):
            rv = caller()
            if (tracking := self._tracking.get()) is not None:
                blocks, spans = tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(rv)))
            return rv

        @contextmanager
        def activate_tracker(self, blocks: list, spans: list):
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:  # `dict(...)` without the class itself: no attribute access to break out through
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # rejects underscore names, as transformers' does
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, check_size(value, f"namespace attribute {name!r}"))

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters.update({name: bounded_filter(name, f) for name, f in env.filters.items()})
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


# -- rendering ----------------------------------------------------------------------------------------------
def _plain(value):
    """Template data rebuilt from plain JSON types (transformers' `_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _normalize(messages, source: str) -> list[dict]:
    if not isinstance(messages, list | tuple):
        raise DataError(f"{source}: messages must be a list of {{\"role\", \"content\"}} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{source}: messages[{i}]: expected an object, got {type(message).__name__}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_spans(template: str, messages: list[dict], special_tokens: dict, add_generation_prompt: bool = False,
                 *, source: str = "chat template") -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of its `{% generation %}` blocks (empty without them)."""
    import jinja2

    try:
        compiled = compile_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"{source}: line {e.lineno}: {_one_line(e)}; fix the chat template") from None
    except jinja2.TemplateError as e:
        raise DataError(f"{source}: {_one_line(e)}; fix the chat template") from None
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    variables = {**_plain(dict(special_tokens)), "messages": _normalize(messages, source), "tools": None,
                 "documents": None, "add_generation_prompt": bool(add_generation_prompt)}
    size = 0
    try:
        with render_limits(), compiled.environment.activate_tracker(blocks, spans):
            for block in compiled.generate(**variables):
                blocks.append(block)
                size += len(block)
                if size > MAX_RENDER_CHARS:
                    raise RenderLimit(f"the rendered conversation passed {MAX_RENDER_CHARS:,} characters, the most "
                                      "a chat template may produce")
    except RenderLimit as e:
        raise DataError(f"{source}: rendering stopped: {e}; fix the chat template, or shorten the conversation"
                        ) from None
    except MemoryError:
        raise DataError(f"{source}: rendering stopped: it ran out of memory; fix the chat template") from None
    except jinja2.TemplateError as e:
        raise DataError(f"{source}: rendering failed: {_one_line(e)}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
            RecursionError) as e:
        raise DataError(f"{source}: rendering failed: {type(e).__name__}: {_one_line(e)}") from None
    return "".join(blocks), spans


def render(template: str, messages: list[dict], special_tokens: dict, add_generation_prompt: bool = False,
           *, source: str = "chat template") -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` of transformers,
    given the tokenizer's template and `special_tokens_map`. Errors are one-line DataErrors naming `source`."""
    return render_spans(template, messages, special_tokens, add_generation_prompt, source=source)[0]


# -- examples: ids and loss masks ---------------------------------------------------------------------------
def spans_to_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 on every token whose character span overlaps one of `spans` (sorted), as transformers marks them."""
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


def _template_of(tok: Tokenizer) -> tuple[str, str]:
    if tok.chat_template is None:
        named = f" (it has only templates named {', '.join(sorted(tok.chat_templates))})" if tok.chat_templates else ""
        raise DataError(f"tokenizer {tok.name} has no chat template{named}; use a model folder with "
                        "chat_template.jinja or a \"chat_template\" in tokenizer_config.json")
    return tok.chat_template, f"{tok.chat_template_source or tok.name} (chat template)"


def assistant_spans(template: str, messages: list[dict], special_tokens: dict, *, source: str = "chat template"
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (see the module docstring)."""
    full, blocks = render_spans(template, messages, special_tokens, source=source)
    if GENERATION_TAG.search(template):
        return full, blocks
    spans = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") == "assistant"):
            continue
        if i == 0:
            raise DataError(f"{source}: the conversation opens with an assistant turn, so no prompt precedes it; "
                            "start it with a system or user message")
        before = render(template, messages[:i], special_tokens, add_generation_prompt=True, source=source)
        after = render(template, messages[:i + 1], special_tokens, source=source)
        if not (full.startswith(after) and after.startswith(before)):
            raise DataError(f"{source}: not prefix-stable: rendering the conversation up to message {i} "
                            f"({'with the generation prompt' if not after.startswith(before) else 'alone'}) is "
                            "not a prefix of rendering it whole (the template rewrites earlier turns); mark the "
                            "assistant turns with {% generation %}...{% endgeneration %} in the template")
        end = len(after)
        while end > len(before) and after[end - 1].isspace():
            end -= 1
        if end > len(before):
            spans.append((len(before), end))
    return full, spans


def chat_example(tok: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation: ids as `apply_chat_template(messages, tokenize=True)`,
    mask 1 on the assistant turns' tokens."""
    template, source = _template_of(tok)
    if not messages:
        raise DataError(f"{source}: an empty conversation; give at least one user and one assistant message")
    text, spans = assistant_spans(template, messages, tok.special_tokens, source=source)
    if not spans:
        raise DataError(f"{source}: the rendered conversation has no assistant text, so nothing to learn; "
                        "check the messages' roles (\"assistant\") and the template's {% generation %} blocks")
    ids, offsets = tok.encode_offsets(text)
    return ids, spans_to_mask(offsets, spans)


def alpaca_messages(record: dict) -> list[dict]:
    """An Alpaca record as a user message (instruction, then input after a blank line) and an assistant one."""
    user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


def alpaca_example(tok: Tokenizer, record: dict) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one Alpaca record: through the chat template when the tokenizer has one,
    else the Stanford Alpaca prompt (mask 0), the output and eos (mask 1), after a bos when the tokenizer
    has one distinct from its eos (Llama's; GPT-2 and Qwen name <|endoftext|> for both and get none)."""
    if tok.chat_template is not None:
        return chat_example(tok, alpaca_messages(record))
    if tok.eos_id is None:
        raise DataError(f"tokenizer {tok.name} names no eos token to end an Alpaca example; set \"eos_token\" in "
                        "its tokenizer_config.json or give it a chat template")
    if record.get("input"):
        prompt = ALPACA_PROMPT_INPUT.format(instruction=record["instruction"], input=record["input"])
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=record["instruction"])
    bos = [tok.bos_id] if tok.bos_id is not None and tok.bos_id != tok.eos_id else []
    prompt_ids = bos + tok.encode(prompt)
    output_ids = tok.encode(record["output"]) + [tok.eos_id]
    return prompt_ids + output_ids, [0] * len(prompt_ids) + [1] * len(output_ids)


def example(tok: Tokenizer, kind: str, record: dict) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a record that `read_examples` yielded."""
    return chat_example(tok, record["messages"]) if kind == "chat" else alpaca_example(tok, record)


# -- reading instruction files ------------------------------------------------------------------------------
def _check_chat(record: dict) -> str | None:
    """The first problem with a chat record, as 'field: problem', or None."""
    messages = record["messages"]
    if not isinstance(messages, list):
        return f"messages: expected a list of {{\"role\", \"content\"}} objects, got {type(messages).__name__}"
    if not messages:
        return "messages: an empty conversation"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}]: expected an object with \"role\" and \"content\", got {type(message).__name__}"
        if "role" not in message:
            return f"messages[{i}].role: missing"
        if not isinstance(message["role"], str):
            return f"messages[{i}].role: expected a string"
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            return f"messages[{i}].content: {'missing' if 'content' not in message else 'expected a string'}"
        if content is not None and not isinstance(content, str | list):
            return f"messages[{i}].content: expected a string (or a list of content parts)"
    if not any(m["role"] == "assistant" for m in messages):
        return "messages: no assistant turn, so nothing to learn (the loss covers role \"assistant\" only)"
    return None


def _check_alpaca(record: dict) -> str | None:
    for key in ("instruction", "output"):
        if key not in record:
            return f"{key}: missing (an Alpaca record has \"instruction\", \"output\" and optionally \"input\")"
        if not isinstance(record[key], str):
            return f"{key}: expected a string"
    if record.get("input") is not None and not isinstance(record["input"], str):
        return "input: expected a string"
    return None


def read_examples(path: str | Path) -> Iterator[tuple[str, dict, int]]:
    """(kind, record, line number) of each record of an instruction JSONL file, kind "chat" or "alpaca".

    A line is `{"messages": [{"role", "content"}, ...]}` (chat) or `{"instruction", "input"?, "output"}`
    (Alpaca); blank lines are skipped; one format per file. A malformed line raises a DataError naming the
    file, the line and the field (`data.jsonl:17: messages[2].role: expected a string`).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: instruction file not found; pass a JSONL file of chat or Alpaca records")
    first: tuple[str, int] | None = None
    for n, record in bounded_json_lines(path, DataError):
        where = f"{path}:{n}"
        if not isinstance(record, dict) or not ("messages" in record or "instruction" in record
                                                or "output" in record):
            raise DataError(f"{where}: expected a JSON object with \"messages\" (chat) or \"instruction\" "
                            "and \"output\" (Alpaca)")
        kind = "chat" if "messages" in record else "alpaca"
        problem = _check_chat(record) if kind == "chat" else _check_alpaca(record)
        if problem:
            raise DataError(f"{where}: {problem}")
        if first is None:
            first = (kind, n)
        elif kind != first[0]:
            raise DataError(f"{where}: {'an' if kind == 'alpaca' else 'a'} {kind} record in a file of "
                            f"{first[0]} records (line {first[1]} is {first[0]}); keep one format per file")
        yield kind, record, n
