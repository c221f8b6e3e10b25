"""The final ``\\boxed{...}`` answer of a LaTeX solution (the MATH scorer's and `prep math`'s reader)."""

from posttrain.rewards.latex import last_boxed, last_boxed_answer


def test_last_boxed():
    assert last_boxed_answer("so \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed_answer("answer: \\boxed 5$ done") == "5"
    assert last_boxed_answer("\\fbox{x^{2}}") == "x^{2}"
    assert last_boxed_answer("\\boxed{unclosed {") is None
    assert last_boxed_answer("no box") is None
    assert last_boxed("a \\boxed{\\{1,2\\}} b") == "\\boxed{\\{1,2\\}}"
