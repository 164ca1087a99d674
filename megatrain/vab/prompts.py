"""Prompt text for the three VAB protocols and the two parsers of `BEST: X` / `WORST: Y` answers.

Where it sits: judges.py puts the prompt in every JudgeQuery; command_judge.py sends it to an external
command and parses the reply here; finetune.py pairs it with the expected answer. The wording follows the
official evaluation code (reference vab.md section 2.1); images are listed after the text as
`Image X: <path>`, where the official code interleaves the pictures themselves.

Two parse modes (base.ParseMode; docs/VAB.md "Parse modes"):
- official (the default): as `_find_answer` of the official eval.py, which runs
  `re.search(r"\\bBEST:\\s*([A-Za-z])\\b", text)` (the same for WORST) on the whole text. The first match
  anywhere wins, even an early mention in the reasoning; the tag is case-sensitive (`Best: A` does not
  match), the letter is not (`BEST: a` is A); the letter must stand alone (`BEST: A.` and `**BEST: A**`
  match, `BEST: **A**`, `**BEST:** A` and `BEST: Apple` do not, and the search goes on past them). A first
  match that is not a presented label is a parse failure (no later match is tried); best == worst is
  accepted.
- strict: the answer must end with the line(s) `BEST: X` (pick_best), `WORST: X` (pick_worst) or both
  (pick_best_and_worst, X != Y); nothing may follow them, each line is exactly `TAG: letter`, the letter
  is one of the presented labels (either case).
Anything else raises AnswerParseError.

Try it: `python -c "from megatrain.vab.prompts import parse_answer; print(parse_answer('hm\\nBEST: b',
'pick_best', ('A', 'B'), 'strict'))"`.
"""

from __future__ import annotations

import re

from .base import DEFAULT_PARSE, ParseMode, Protocol

_INTRO = ("You will be shown {n} images labeled {labels}. Evaluate the overall aesthetic quality of each image, "
          "considering composition, color, technique, and artistic expression.")

_QUESTION = {
    "pick_best": "Which image has the best overall aesthetic quality?",
    "pick_worst": "Which image has the worst overall aesthetic quality?",
    "pick_best_and_worst": "Which image has the best overall aesthetic quality, and which has the worst?",
}

_FORMAT = {
    "pick_best": ("You may reason step by step. Then, on the very last line of your response, write your final "
                  "answer in exactly this format:\nBEST: X\nwhere X is the letter label of the best image."),
    "pick_worst": ("You may reason step by step. Then, on the very last line of your response, write your final "
                   "answer in exactly this format:\nWORST: X\nwhere X is the letter label of the worst image."),
    "pick_best_and_worst": ("You may reason step by step. Then, on the very last lines of your response, write "
                            "your final answers in exactly this format:\nBEST: X\nWORST: Y\n"
                            "where X and Y are the letter labels."),
}

_LINE = re.compile(r"^(BEST|WORST):\s*([A-Za-z])\s*$")

# NOTE: the official eval.py builds rf'\b{tag.upper()}:\s*([A-Za-z])\b' and calls re.search with no flags.
OFFICIAL_PATTERNS = {tag: re.compile(rf"\b{tag}:\s*([A-Za-z])\b") for tag in ("BEST", "WORST")}


class AnswerParseError(ValueError):
    """A judge's text answer gives no usable `BEST:` / `WORST:` answer under the parse mode."""


def build_prompt(protocol: Protocol, labels: tuple[str, ...], images: tuple[str, ...]) -> str:
    """The full prompt for candidates `images` presented under `labels` (A, B, ... in order)."""
    options = "\n".join(f"{la}. Image {la}" for la in labels)
    header = "\n\n".join([
        _INTRO.format(n=len(labels), labels=", ".join(labels)),
        f"{_QUESTION[protocol]}\n{options}",
        _FORMAT[protocol],
    ])
    body = "\n".join(f"Image {la}: {img}" for la, img in zip(labels, images))
    return f"{header}\n\n{body}\n"


def format_answer(protocol: Protocol, best: str | None, worst: str | None) -> str:
    """The answer lines a judge should end with (the fine-tuning target)."""
    lines = []
    if protocol in ("pick_best", "pick_best_and_worst"):
        lines.append(f"BEST: {best}")
    if protocol in ("pick_worst", "pick_best_and_worst"):
        lines.append(f"WORST: {worst}")
    return "\n".join(lines)


def _wanted(protocol: Protocol) -> tuple[str, ...]:
    return {"pick_best": ("BEST",), "pick_worst": ("WORST",), "pick_best_and_worst": ("BEST", "WORST")}[protocol]


def parse_answer(text: str, protocol: Protocol, labels: tuple[str, ...],
                 mode: ParseMode = DEFAULT_PARSE) -> tuple[str | None, str | None]:
    """(best, worst) presented labels of a text answer under `mode`; AnswerParseError when there is none.

    The tag(s) the protocol does not ask for are ignored and come back as None.
    """
    if mode == "official":
        return parse_official(text, protocol, labels)
    if mode == "strict":
        return parse_strict(text, protocol, labels)
    raise ValueError(f"unknown parse mode {mode!r}; use official or strict")


def parse_official(text: str, protocol: Protocol, labels: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(best, worst) as the official evaluator reads them: the first `TAG: X` match anywhere in `text`.

    X is upper-cased and must be one of `labels`; best == worst is allowed (module docstring).
    """
    found: dict[str, str] = {}
    for tag in _wanted(protocol):
        match = OFFICIAL_PATTERNS[tag].search(text)
        if match is None:
            raise AnswerParseError(f"no `{tag}: X` anywhere in the answer (official regex "
                                   f"{OFFICIAL_PATTERNS[tag].pattern}; the tag is case-sensitive)")
        letter = match.group(1).upper()
        if letter not in labels:
            raise AnswerParseError(f"the first {tag} match is {match.group(0)!r}: {letter} is not one of the "
                                   f"presented labels {', '.join(labels)} (the official parser takes only the "
                                   "first match)")
        found[tag] = letter
    return found.get("BEST"), found.get("WORST")


def parse_strict(text: str, protocol: Protocol, labels: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(best, worst) presented labels from the answer block that ends `text`; AnswerParseError if malformed.

    The answer block is the run of trailing non-empty lines that start with `BEST:` or `WORST:`. Each must
    be exactly `TAG: X`, no tag may repeat, and the block must hold the tag(s) the protocol asks for; a tag
    it does not ask for is ignored (a judge may always print both lines).
    """
    wanted = _wanted(protocol)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    block: list[str] = []
    while lines and lines[-1].startswith(("BEST:", "WORST:")):
        block.insert(0, lines.pop())
    if not block:
        last = repr(lines[-1][:80]) if lines else "nothing"
        raise AnswerParseError(f"expected the answer to end with {' and '.join(w + ': X' for w in wanted)}, "
                               f"got {last}")
    found: dict[str, str] = {}
    for line in block:
        match = _LINE.match(line)
        if match is None:
            raise AnswerParseError(f"malformed answer line {line[:80]!r}; write exactly `BEST: X` or `WORST: X`")
        tag, letter = match.group(1), match.group(2).upper()
        if tag in found:
            raise AnswerParseError(f"{tag} is answered twice")
        if letter not in labels:
            raise AnswerParseError(f"{tag}: {letter} is not one of the presented labels {', '.join(labels)}")
        found[tag] = letter
    missing = [w for w in wanted if w not in found]
    if missing:
        raise AnswerParseError(f"no {' or '.join(missing)} line at the end of the answer")
    if protocol == "pick_best_and_worst" and found["BEST"] == found["WORST"]:
        raise AnswerParseError(f"BEST and WORST both name {found['BEST']}; they must differ")
    best = found["BEST"] if "BEST" in wanted else None
    worst = found["WORST"] if "WORST" in wanted else None
    return best, worst
