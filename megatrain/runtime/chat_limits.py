"""Bounds on what instruction data and chat templates may cost: time, output and record size.

Where it sits: under chat.py. A chat template is code from a model folder, and a JSONL record is a user's
data; neither may hang, abort or exhaust the process. `BoundedEnvironment` is transformers' sandbox
(ImmutableSandboxedEnvironment) that also refuses values past MAX_RENDER_CHARS (string and list
repetition, `**`, concatenation, macro arguments, namespace attributes); `render_limits()` bounds one render
in time (RENDER_SECONDS) and checks the output as it is produced; `bounded_json_lines` reads a JSONL file a
line at a time, refusing a line past MAX_EXAMPLE_BYTES by its number before it is parsed or tokenized.
Run its tests: `.venv/bin/pytest tests/runtime/test_chat_limits.py`.

The limits are far above any real conversation (a 128k-token example is about half a MiB of text) and far
below what breaks the process: the tokenizers library needs about 150 bytes of memory per character it
encodes with offsets, so a 16 MiB example takes gigabytes, and an allocation it cannot make aborts.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

from megatrain.files import json_lines

MAX_EXAMPLE_BYTES = 4 << 20  # one JSONL record (one example)
MAX_RENDER_CHARS = 6 << 20  # one rendered conversation: the largest record plus the template's own text
RENDER_SECONDS = 10.0  # one render of a chat template


class RenderLimit(Exception):
    """A chat template went past a limit (time or size); the message says which."""


def _size(value) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


def check_size(value, what: str):
    """`value`, unless it is a string or container longer than MAX_RENDER_CHARS."""
    if _size(value) > MAX_RENDER_CHARS:
        raise RenderLimit(f"{what} would hold {_size(value):,} items, more than the {MAX_RENDER_CHARS:,} a chat "
                          "template may produce")
    return value


_deadline = threading.local()


def check_time() -> None:
    end = getattr(_deadline, "end", None)
    if end is not None and time.monotonic() > end:
        raise RenderLimit(f"rendering took longer than {RENDER_SECONDS:g} s (a loop that does not end soon)")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with sizes checked where a template can grow a value fast, and the clock checked at every
    call (a template's loops call something, or they are caught by the timer of `render_limits`)."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, operator, left, right):
        check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int) and _size(seq) * n > MAX_RENDER_CHARS:
                    raise RenderLimit(f"a repetition would hold {_size(seq) * n:,} items, more than the "
                                      f"{MAX_RENDER_CHARS:,} a chat template may produce")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and abs(left).bit_length() * right > 8 * MAX_RENDER_CHARS:
            raise RenderLimit(f"a power of {right:,} would be a number too large for a chat template")
        return check_size(super().call_binop(context, operator, left, right), "a value")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja2's own signature)
        check_time()
        for value in (*args, *kwargs.values()):
            check_size(value, "an argument")
        if isinstance(getattr(__obj, "__self__", None), str):  # 'x'.center(10**9) allocates before returning
            check_widths(getattr(__obj, "__name__", "a string method"), args, kwargs)
        return check_size(ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs),
                          "a call's result")


def check_widths(name: str, args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and value > MAX_RENDER_CHARS:
            raise RenderLimit(f"{name}({value:,}) would produce more than the {MAX_RENDER_CHARS:,} characters a "
                              "chat template may produce")


_WIDTH_FILTERS = frozenset({"center", "indent", "truncate", "wordwrap", "batch", "slice"})


def bounded_filter(name: str, f):
    """A jinja2 filter whose arguments and result are held to the limits (`center(10**9)`, `replace` that
    multiplies a string)."""

    @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        check_time()
        if name in _WIDTH_FILTERS:
            check_widths(name, args, kwargs)
        return check_size(f(*args, **kwargs), f"the {name} filter's result")

    return bounded


@contextmanager
def render_limits():
    """Bound the render run inside it to RENDER_SECONDS: in the main thread a timer signal interrupts even a
    loop that calls nothing; elsewhere a tracer checks the clock on each line of template code."""
    start = time.monotonic()
    _deadline.end = start + RENDER_SECONDS
    main = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if main:
        def on_alarm(signum, frame):
            raise RenderLimit(f"rendering took longer than {RENDER_SECONDS:g} s (a loop that does not end soon)")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        old_timer = signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS)
    else:
        def local(frame, event, arg):
            check_time()
            return local

        def tracer(frame, event, arg):
            return local if frame.f_code.co_filename == "<template>" else None

        old_trace = sys.gettrace()
        sys.settrace(tracer)
    try:
        yield
    finally:
        _deadline.end = None
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if old_timer[0]:  # someone else's timer was running: it gets what was left of it
                left = old_timer[0] - (time.monotonic() - start)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), old_timer[1])
        else:
            sys.settrace(old_trace)


def bounded_json_lines(path: Path, error: type[Exception], cap: int | None = None) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line of a JSONL file, a line of more than `cap` bytes
    (MAX_EXAMPLE_BYTES) refused by its number before it is held whole, parsed or tokenized."""
    cap = MAX_EXAMPLE_BYTES if cap is None else cap
    yield from json_lines(path, "an instruction JSONL file", error, line_cap=cap,
                          too_long=f"above the {cap >> 20} MiB an example may hold; split the conversation or drop "
                          "the line")
