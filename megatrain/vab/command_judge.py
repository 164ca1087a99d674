"""CommandJudge: an external program as a judge. The prompt goes to its stdin; its stdout is the answer.

Where it sits: built by specs.py from `--judge cmd:"..."`; called by protocol.py like any judge. The
command runs through the shell with a timeout, once per attempt; its answer is read under the query's parse
mode (prompts.parse_answer: official, the first `BEST: X` / `WORST: Y` anywhere, or strict, trailing lines).
A parse failure, a non-zero exit or a timeout is retried up to `attempts` times in all (with a delay only
after a command failure); after that the trial is recorded with `error` set and counts as wrong, with
`judge_failed` set when the last attempt failed as a command (the official code's API error) rather than
answering something unparseable.
Exit codes 126/127 (not executable, not found) stop the run at once: the judge spec is broken.

The command also sees these environment variables: VAB_TASK_ID, VAB_PROTOCOL, VAB_TRIAL, VAB_LABELS
(`A,B,C`) and VAB_IMAGES (a JSON list of image paths in presented order).

Try it: `megatrain vab run --tasks tasks.jsonl --judge 'cmd:echo BEST: A; echo WORST: B' --out r.jsonl`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence

from .errors import VabError
from .judges import JudgeAnswer, JudgeQuery
from .prompts import AnswerParseError, parse_answer

MAX_RESPONSE_CHARS = 20_000


class CommandJudge:
    """Runs `command` (a shell command line) per attempt; bounded retries; failures score as wrong."""

    def __init__(self, command: str, timeout_s: float = 300.0, attempts: int = 3,
                 retry_delays_s: Sequence[float] = (2.0, 5.0, 15.0)):
        if not command.strip():
            raise VabError("cmd judge has an empty command; write --judge 'cmd:python my_judge.py'")
        if attempts < 1:
            raise VabError(f"attempts is {attempts}; a judge needs at least 1 attempt")
        self.command = command
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.retry_delays_s = tuple(retry_delays_s)

    def _env(self, query: JudgeQuery) -> dict[str, str]:
        return {**os.environ, "VAB_TASK_ID": query.task_id, "VAB_PROTOCOL": query.protocol,
                "VAB_TRIAL": str(query.trial), "VAB_LABELS": ",".join(query.labels),
                "VAB_IMAGES": json.dumps(list(query.images))}

    def _attempt(self, query: JudgeQuery) -> tuple[JudgeAnswer | None, str, str | None, bool]:
        """(answer or None, problem, raw stdout, whether the command itself failed) of one run."""
        try:
            proc = subprocess.run(self.command, shell=True, input=query.prompt, capture_output=True,
                                  text=True, timeout=self.timeout_s, env=self._env(query))
        except subprocess.TimeoutExpired:
            return None, f"command timed out after {self.timeout_s:g} s", None, True
        text = proc.stdout[-MAX_RESPONSE_CHARS:]
        if proc.returncode in (126, 127):
            raise VabError(f"judge command {self.command!r} cannot run (exit {proc.returncode}: "
                           f"{proc.stderr.strip()[-200:]}); fix the command in --judge cmd:...")
        if proc.returncode != 0:
            return None, f"command exited {proc.returncode}: {proc.stderr.strip()[-200:]}", text, True
        try:
            best, worst = parse_answer(proc.stdout, query.protocol, query.labels, query.parse)
        except AnswerParseError as exc:
            return None, f"unparseable answer: {exc}", text, False
        return JudgeAnswer(best=best, worst=worst, response=text), "", text, False

    def __call__(self, query: JudgeQuery) -> JudgeAnswer:
        problem, raw, failed = "", None, False
        for attempt in range(self.attempts):
            answer, problem, text, failed = self._attempt(query)
            raw = text if text is not None else raw
            if answer is not None:
                return answer
            # NOTE: back off only when the command failed (a rate-limited API, say); a bad parse retries at once.
            if failed and attempt + 1 < self.attempts and self.retry_delays_s:
                time.sleep(self.retry_delays_s[min(attempt, len(self.retry_delays_s) - 1)])
        return JudgeAnswer(response=raw, error=f"no valid answer after {self.attempts} attempt(s); last: {problem}",
                           judge_failed=failed)
