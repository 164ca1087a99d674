"""Prompts and the two answer parsers: strict (trailing lines) and official (first match anywhere, as eval.py).

Each case of the forms real judges write states what both modes give, so where they differ the test says so.
"""

from __future__ import annotations

import re

import pytest

from megatrain.vab.prompts import (
    OFFICIAL_PATTERNS,
    AnswerParseError,
    build_prompt,
    format_answer,
    parse_answer,
)

ABC = ("A", "B", "C")


def test_prompt_names_labels_images_and_format():
    text = build_prompt("pick_best_and_worst", ABC, ("x.jpg", "y.jpg", "z.jpg"))
    assert "3 images labeled A, B, C" in text
    assert "composition, color, technique, and artistic expression" in text
    assert "Image B: y.jpg" in text
    assert "BEST: X\nWORST: Y" in text
    assert "WORST" not in build_prompt("pick_best", ABC, ("x", "y", "z"))


@pytest.mark.parametrize("text, protocol, expected", [
    ("I like B.\nBEST: B", "pick_best", ("B", None)),
    ("BEST: c  \n\n", "pick_best", ("C", None)),
    ("meh\nWORST: A", "pick_worst", (None, "A")),
    ("reasoning\nBEST: A\nWORST: C", "pick_best_and_worst", ("A", "C")),
    ("WORST: C\nBEST: A", "pick_best_and_worst", ("A", "C")),
    ("BEST: A\nWORST: C", "pick_best", ("A", None)),  # an unasked tag is ignored
])
def test_parse_good_answers(text, protocol, expected):
    assert parse_answer(text, protocol, ABC, "strict") == expected
    assert parse_answer(text, protocol, ABC, "official") == expected  # well-formed answers agree


@pytest.mark.parametrize("text, protocol, reason", [
    ("", "pick_best", "got nothing"),
    ("I think B is best.", "pick_best", "expected the answer to end with BEST: X"),
    ("BEST: B\nthat is my answer", "pick_best", "expected the answer to end with"),
    ("BEST: D", "pick_best", "not one of the presented labels A, B, C"),
    ("BEST: B because", "pick_best", "malformed answer line"),
    ("BEST: AB", "pick_best", "malformed answer line"),
    ("best: B", "pick_best", "expected the answer to end with"),
    ("BEST: A\nBEST: B", "pick_best", "answered twice"),
    ("WORST: A", "pick_best", "no BEST line"),
    ("BEST: A", "pick_best_and_worst", "no WORST line"),
    ("BEST: A\nWORST: a", "pick_best_and_worst", "both name A"),
])
def test_strict_parse_rejects_malformed_answers(text, protocol, reason):
    with pytest.raises(AnswerParseError, match=reason):
        parse_answer(text, protocol, ABC, "strict")


def test_format_answer_round_trips_through_parser():
    for protocol in ("pick_best", "pick_worst", "pick_best_and_worst"):
        text = format_answer(protocol, "B", "C")
        for mode in ("strict", "official"):
            best, worst = parse_answer(text, protocol, ABC, mode)
            assert best in ("B", None) and worst in ("C", None)
            assert (best is not None) == (protocol != "pick_worst")


# (text, protocol, official result or the error it raises, strict result or the error it raises)
REAL_JUDGE_ANSWERS = [
    # markdown bold around the whole answer: the official regex still finds it; strict needs a bare last line
    ("Composition wins.\n**BEST: A**", "pick_best", ("A", None), "expected the answer to end with"),
    # bold around the letter or the tag only: `\s*` cannot skip `*`, so nothing matches in either mode
    ("Composition wins.\nBEST: **A**", "pick_best", "no `BEST: X` anywhere", "malformed answer line"),
    ("Composition wins.\n**BEST:** A", "pick_best", "no `BEST: X` anywhere", "expected the answer to end with"),
    # restated: an early different mention in the reasoning, the final line at the end. The modes differ:
    # official takes the first match (B), strict the trailing line (A).
    ("One could argue BEST: B for its color, but the light in A is better.\nBEST: A", "pick_best", ("B", None),
     ("A", None)),
    ("Early guess -> WORST: A.\nOn reflection:\nBEST: B\nWORST: C", "pick_best_and_worst", ("B", "A"), ("B", "C")),
    # lowercase: the letter's case does not matter, the tag's does (the official regex has no IGNORECASE)
    ("I choose\nBEST: c", "pick_best", ("C", None), ("C", None)),
    ("I choose\nbest: C", "pick_best", "no `BEST: X` anywhere", "expected the answer to end with"),
    ("I choose\nBest: C", "pick_best", "no `BEST: X` anywhere", "expected the answer to end with"),
    # trailing punctuation or words after the letter: `\b` holds after a lone letter
    ("BEST: A.", "pick_best", ("A", None), "malformed answer line"),
    ("BEST: A (the sunset)", "pick_best", ("A", None), "malformed answer line"),
    # `Apple` fails `\b`, so official goes on to the next match; strict sees a malformed trailing block
    ("BEST: Apple is not a label.\nBEST: C", "pick_best", ("C", None), "malformed answer line"),
    # an answer inside the reasoning and no final line at all
    ("I'd say BEST: A because of the light, and WORST: C for the blur; done.", "pick_best_and_worst",
     ("A", "C"), "expected the answer to end with"),
    ("BEST:\nB", "pick_best", ("B", None), "expected the answer to end with"),  # `\s*` crosses the line break
    # best == worst: official accepts it (scored as usual, so one side is wrong); strict refuses it
    ("BEST: B\nWORST: B", "pick_best_and_worst", ("B", "B"), "both name B"),
    # labels not in the set: official stops at the first match, even when a later one is a real label
    ("BEST: D", "pick_best", "D is not one of the presented labels A, B, C", "not one of the presented labels"),
    ("BEST: D\nsorry, there is no D\nBEST: A", "pick_best", "the first BEST match is 'BEST: D'", ("A", None)),
    # empty answers
    ("", "pick_best", "no `BEST: X` anywhere", "got nothing"),
    ("  \n\n", "pick_best_and_worst", "no `BEST: X` anywhere", "got nothing"),
    # the tag the protocol asks for is missing
    ("BEST: A", "pick_best_and_worst", "no `WORST: X` anywhere", "no WORST line"),
    ("BEST: A\nWORST: C", "pick_worst", (None, "C"), (None, "C")),  # an unasked tag is ignored
]


@pytest.mark.parametrize("text, protocol, official, strict", REAL_JUDGE_ANSWERS)
def test_official_and_strict_on_answers_real_judges_write(text, protocol, official, strict):
    for mode, expected in (("official", official), ("strict", strict)):
        if isinstance(expected, tuple):
            assert parse_answer(text, protocol, ABC, mode) == expected, mode
        else:
            with pytest.raises(AnswerParseError, match=re.escape(expected)):
                parse_answer(text, protocol, ABC, mode)


def test_modes_differ_where_the_first_match_is_not_the_last():
    text = "Tempting: BEST: C.\n...\nBEST: A\nWORST: B"
    assert parse_answer(text, "pick_best_and_worst", ABC, "official") == ("C", "B")
    assert parse_answer(text, "pick_best_and_worst", ABC, "strict") == ("A", "B")
    assert parse_answer(text, "pick_best_and_worst", ABC) == ("C", "B")  # official is the default


def test_official_regex_is_the_one_documented():
    assert OFFICIAL_PATTERNS["BEST"].pattern == r"\bBEST:\s*([A-Za-z])\b"
    assert OFFICIAL_PATTERNS["WORST"].pattern == r"\bWORST:\s*([A-Za-z])\b"
    assert OFFICIAL_PATTERNS["BEST"].flags & re.IGNORECASE == 0
    with pytest.raises(ValueError, match="unknown parse mode 'loose'"):
        parse_answer("BEST: A", "pick_best", ABC, "loose")
