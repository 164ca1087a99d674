"""Judge specs: the `--judge` strings of the CLI, parsed into a judge and its canonical name.

Where it sits: cli.py calls `make_judge`; the canonical name is stored in every result line so that a
resumed run refuses to mix judges. Specs:

    oracle              ground truth (tests, sanity checks)
    random[:SEED]       uniform choice, reproducible (default seed 0)
    position[:INDEX]    always the candidate at INDEX (default 0) as best, the last one as worst
    scores:FILE.jsonl   scalar scores per candidate: {"task_id": ..., "scores": {"A": 0.7, ...}}
    cmd:COMMAND         external command: prompt on stdin, `BEST: X` / `WORST: Y` on stdout

Try it: `python -c "from megatrain.vab.specs import make_judge; print(make_judge('random:3', [])[1])"`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .command_judge import CommandJudge
from .errors import VabError
from .judges import (
    Judge,
    OracleJudge,
    PositionJudge,
    RandomJudge,
    ScoreJudge,
    load_scores,
    table_scorer,
)
from .tasks import Task

SPEC_HELP = "oracle, random[:SEED], position[:INDEX], scores:FILE.jsonl or cmd:COMMAND"


def _int_arg(spec: str, kind: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise VabError(f"judge spec {spec!r}: {text!r} is not an integer; write {kind}:N") from None


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def make_judge(spec: str, tasks: list[Task], *, timeout_s: float = 300.0, attempts: int = 3,
               retry_delays_s: Sequence[float] = (2.0, 5.0, 15.0)) -> tuple[Judge, str]:
    """(judge, canonical name) for a spec string; a VabError naming the accepted forms otherwise."""
    kind, sep, arg = spec.strip().partition(":")
    if kind == "oracle" and not sep:
        return OracleJudge(tasks), "oracle"
    if kind == "random":
        seed = _int_arg(spec, kind, arg) if sep else 0
        return RandomJudge(seed), f"random:{seed}"
    if kind == "position":
        index = _int_arg(spec, kind, arg) if sep else 0
        return PositionJudge(index), f"position:{index}"
    if kind == "scores" and arg.strip():
        path = _unquote(arg)
        return ScoreJudge(table_scorer(load_scores(path, tasks))), f"scores:{path}"
    if kind == "cmd" and arg.strip():
        command = _unquote(arg)
        judge = CommandJudge(command, timeout_s=timeout_s, attempts=attempts, retry_delays_s=retry_delays_s)
        return judge, f"cmd:{command}"
    raise VabError(f"unknown judge spec {spec!r}; use {SPEC_HELP}")
