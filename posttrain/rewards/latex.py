"""Finding the final ``\\boxed{...}`` answer in a LaTeX solution (MATH-style data and replies)."""

from __future__ import annotations

__all__ = ["last_boxed", "boxed_content", "last_boxed_answer"]


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, or ``\\boxed <x>`` up to the next
    ``$`` (verl's ``last_boxed_only_string`` rules); ``None`` when there is none or it never closes."""
    if "\\boxed " in text:
        # "\boxed 5$" form: everything after the last "\boxed " up to a dollar sign
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def boxed_content(boxed: str) -> str:
    """``\\boxed{x}`` / ``\\fbox{x}`` / ``\\boxed x`` -> ``x``."""
    for head in ("\\boxed ",):
        if boxed.startswith(head):
            return boxed[len(head) :]
    for head in ("\\boxed{", "\\fbox{"):
        if boxed.startswith(head) and boxed.endswith("}"):
            return boxed[len(head) : -1]
    raise ValueError(f"not a boxed expression: {boxed[:80]!r}")


def last_boxed_answer(text: str) -> str | None:
    """The content of the last boxed expression in ``text``, or ``None``."""
    b = last_boxed(text)
    return None if b is None else boxed_content(b)
