"""``python -m posttrain.trainer.main_generation_server`` (verl's ``verl.trainer.main_generation_server``, which generates responses for a parquet
file of prompts on rollout servers): posttrain has no module of that name. Running it prints what to use instead
and exits 2, so that a verl launch script never reports success having generated nothing."""

from __future__ import annotations

import sys

INSTEAD = ("posttrain has no {module}: to generate and score responses for a file of prompts use "
           "`posttrain eval --model MODEL --data FILE --n N` (it writes the responses, mean@N, maj@N, pass@k and an eval "
           "card); to serve a model to other programs use `posttrain serve MODEL` (an OpenAI-compatible server); to "
           "score a file of responses generated elsewhere use `python -m posttrain.trainer.main_eval data.path=FILE`")


def refuse(module: str) -> int:
    """Say what to use instead of verl's generation module ``module``; the exit code (2)."""
    print(f"error: {INSTEAD.format(module=module)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    return refuse("main_generation_server")


if __name__ == "__main__":
    sys.exit(main())
