"""MATH and arithmetic scorers, default_compute_score dispatch."""

import pytest

from posttrain.rewards import KNOWN_DATA_SOURCES, UnknownDataSourceError, default_compute_score
from posttrain.rewards import arithmetic, math


@pytest.mark.parametrize(
    "reply, truth, expected",
    [
        ("so the answer is \\boxed{2}", "2", 1.0),
        ("first \\boxed{3}, no wait \\boxed{2}", "2", 1.0),  # the last box counts
        ("\\boxed{2} was wrong, it is \\boxed{3}", "2", 0.0),
        ("the answer is 2", "2", 0.0),  # no box
        ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("$\\boxed{0.5}$", "\\frac{1}{2}", 1.0),  # equivalent value
        ("$\\boxed{\\dfrac12}$", "\\frac{1}{2}", 1.0),
        ("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}", 1.0),
        ("$\\boxed{x^2+2x}$", "2x+x^2", 1.0),
        ("$\\boxed{7}$", "\\frac{1}{2}", 0.0),
        ("\\fbox{10}", "10", 1.0),
        ("\\boxed{unclosed", "1", 0.0),
    ],
)
def test_math_scorer(reply, truth, expected):
    # what is equivalent, not how fast: the default 5 s bound scored a right answer 0 once on a machine
    # at load 17 (sympy's first parse), so the semantics are checked with room to spare
    assert math.compute_score(reply, truth, timeout_s=60) == expected


@pytest.mark.parametrize(
    "reply, truth, method, expected",
    [
        ("47 + 38 = 85\n#### 85", "85", "strict", 1.0),
        ("#### 85", 85, "strict", 1.0),
        ("####85", "85", "strict", 1.0),  # spacing after #### is free here (unlike gsm8k)
        ("#### 1,085", "1085", "strict", 1.0),
        ("#### 84", "85", "strict", 0.0),
        ("The answer is 85", "85", "strict", 0.0),  # no #### -> no credit
        ("The answer is 85", "85", "flexible", 1.0),
        ("#### 85\n#### 86", "85", "strict", 0.0),  # last #### wins
        ("#### -3", "-3", "strict", 1.0),
        ("#### 085", "85", "strict", 1.0),  # compared as integers
    ],
)
def test_arithmetic_scorer(reply, truth, method, expected):
    assert arithmetic.compute_score(reply, truth, method=method) == expected


def test_arithmetic_format_score():
    assert arithmetic.compute_score("#### 84", "85", format_score=0.1) == 0.1
    assert arithmetic.compute_score("84", "85", format_score=0.1) == 0.0
    assert arithmetic.extract_answer("7 + 8 = 15 #### 15.") == 15


def test_dispatch():
    assert default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0
    assert default_compute_score("openai/gsm8k", "72", "72") == 0.0
    for src in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(src, "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    both = {"score": 1.0, "acc": 1.0, "flexible_acc": 1.0, "pred": "9"}
    assert default_compute_score("posttrain/arithmetic", "#### 9", "9", extra_info={"index": 0}) == both
    assert isinstance(default_compute_score("openai/gsm8k", "#### 7", "72"), float)
    with pytest.raises(UnknownDataSourceError, match=r"data_source='my/data'; known: \['openai/gsm8k'") as e:
        default_compute_score("my/data", "x", "y")
    assert "custom_reward_function.path" in str(e.value)
    assert isinstance(e.value, NotImplementedError)
    assert "posttrain/arithmetic" in KNOWN_DATA_SOURCES


@pytest.mark.parametrize("reply,strict,flexible,pred", [
    ("4 + 5 = 9\n#### 9", 1.0, 1.0, "9"),
    ("4 + 5 = 9", 0.0, 1.0, "[INVALID]"),  # right answer, no format: only the flexible reading credits it
    ("#### 9 but really 8", 1.0, 0.0, "9"),  # strict reads after ####, flexible the last number
    ("4 + 5 = 8\n#### 8", 0.0, 0.0, "8"),
    ("no number", 0.0, 0.0, "[INVALID]"),
])
def test_builtin_task_reports_strict_and_flexible(reply, strict, flexible, pred):
    assert arithmetic.score_both(reply, "9") == {"score": strict, "acc": strict, "flexible_acc": flexible, "pred": pred}
