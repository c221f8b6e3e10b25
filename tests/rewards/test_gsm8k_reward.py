"""GSM8K scorer: verl 0.9 semantics, edge cases computed by hand."""

import pytest

from posttrain.rewards.gsm8k import compute_score, extract_solution

STRICT = [
    # (reply, extracted answer)
    ("Natalia sold 72 clips.\n#### 72", "72"),
    ("#### 1,234", "1234"),  # commas removed
    ("####72", None),  # exactly one space is required
    ("####  72", None),  # ... and only one
    ("#### -5", "-5"),
    ("#### 72.5", "72.5"),
    ("#### 72.", "72."),  # a trailing period stays attached
    ("#### 3 then #### 4", "4"),  # the last one wins
    ("#### $72", None),  # '$' before the number: no match
    ("#### -", None),
    ("#### ,5", "5"),
    ("#### 0.5 dollars", "0.5"),
    ("The answer is 72", None),
    ("", None),
]


@pytest.mark.parametrize("reply, expected", STRICT)
def test_strict_extraction(reply, expected):
    assert extract_solution(reply, "strict") == expected


FLEXIBLE = [
    ("The answer is 42", "42"),
    ("The answer is 42.", "42."),  # the period is part of the match: "42." != "42"
    ("She has 1,000 apples", "1,000"),  # commas are NOT removed in flexible mode
    ("so 3 then 5 .", "5"),  # a lone "." is skipped
    ("...", "..."),  # a run of dots is not a lone "."
    (".", "."),  # only lone dots: verl's loop leaves the first one
    ("no numbers here", None),
    ("5-3=2", "2"),
    ("it is -3", "-3"),
    ("#### 12", "12"),
]


@pytest.mark.parametrize("reply, expected", FLEXIBLE)
def test_flexible_extraction(reply, expected):
    assert extract_solution(reply, "flexible") == expected


def test_scores():
    assert compute_score("#### 72", "72") == 1.0
    assert compute_score("#### 71", "72") == 0.0
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score("no answer", "72", format_score=0.1) == 0.0  # nothing extracted: 0, not format_score
    assert compute_score("#### 72", "72", score=2.0) == 2.0
    assert compute_score("The answer is 42.", "42", method="flexible", format_score=0.1) == 0.1
    assert compute_score("The answer is 42", "42", method="flexible") == 1.0
    assert compute_score(".", "1", method="flexible", format_score=0.5) == 0.5
    assert compute_score("#### 1,000", "1000") == 1.0
    assert compute_score("She has 1,000", "1000", method="flexible") == 0.0
    assert compute_score("#### 72", "72.0") == 0.0  # string comparison, not numeric


def test_only_last_300_characters_are_searched():
    assert compute_score("#### 72" + "x" * 293, "72") == 1.0  # 300 characters: all searched
    assert compute_score("#### 72" + "x" * 294, "72") == 0.0  # 301: the leading '#' is cut, no match
    assert compute_score("#### 5 " + "y" * 400 + " #### 72", "72") == 1.0
    # clipping can cut a number: only "34" of "1234" is inside the window
    assert extract_solution("1234" + "z" * 298, "flexible") == "34"
    assert extract_solution("#### 1" + "q" * 400, "strict") is None


def test_bad_method():
    with pytest.raises(ValueError, match="method must be 'strict' or 'flexible'"):
        extract_solution("#### 1", "loose")
