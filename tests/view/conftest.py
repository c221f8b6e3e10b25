"""Finished tiny runs for the viewer's tests, built once per session: two single-turn GRPO runs laid out as
`posttrain compare` lays them out (``<compare>/A/seed1``, ``<compare>/B/seed1``), and one multi-turn run with
the calculator tool whose scripted model makes a failed call, a good call, then answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.tiny_run import digit_count_reward, one_thread, tiny_trainer

FAILED_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
GOOD_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
EVAL_CARD = {"model": {"path": "tiny", "sha256": "ab12"}, "sampling": {"n": 4, "temperature": 1.0}, "seed": 1}


def group_reward(batch):
    """Prompt p0 of every step all right (1), p1 all wrong (0), the others by their tokens (mixed)."""
    base = digit_count_reward(batch)
    out = []
    for uid, b in zip(batch.non_tensor_batch["uid"], base.tolist()):
        out.append(1.0 if str(uid).endswith("p0") else 0.0 if str(uid).endswith("p1") else float(b > 0.12))
    return torch.tensor(out)


def _tiny_run(folder: Path, run: Path, extra: list[str]):
    """The tiny trainer (its data and model written in ``folder``) with its run folder ``run`` and both dumps in it."""
    return tiny_trainer(folder, [f"trainer.run_dir={run}", f"trainer.rollout_data_dir={run / 'rollouts'}",
                                 f"trainer.validation_data_dir={run / 'validation'}", *extra])


@pytest.fixture(scope="session")
def view_runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("view_runs")
    compare = base / "compare"
    runs = {}
    for side, lr in (("A", "1e-3"), ("B", "3e-3")):
        trainer = _tiny_run(base / f"model_{side}", compare / side / "seed1", [
            "trainer.total_training_steps=3", "trainer.val_before_train=True", "trainer.test_freq=2",
            "actor_rollout_ref.rollout.n=4", f"actor_rollout_ref.actor.optim.lr={lr}"])
        trainer.reward_fn = group_reward
        with one_thread():
            trainer.fit()
        runs[side] = compare / side / "seed1"
        runs[f"{side}_last_batch"] = trainer.last_batch  # the last step's batch, to check its file against
    (runs["A"] / "eval_card.json").write_text(json.dumps(EVAL_CARD))
    runs["compare"] = compare
    runs["multi_turn"] = _multi_turn_run(base / "multi_turn")
    return runs


def _multi_turn_run(folder: Path) -> Path:
    from posttrain.rollout import hf as hf_module

    tools = folder / "tools.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    tools.write_text("tools:\n  - class_name: posttrain.tools.calculator_tool.CalculatorTool\n    config: {type: native}\n")
    trainer = _tiny_run(folder, folder / "run", [
        "trainer.total_training_steps=2", "data.max_response_length=320", "trainer.val_before_train=False",
        "actor_rollout_ref.rollout.multi_turn.enable=True", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4"])
    tok = trainer.tokenizer
    script = [t for turn in (FAILED_CALL, GOOD_CALL, "#### 5") for t in tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id]]
    state = {"i": 0}

    def sample(logits, sampling, want_log_probs):  # every row writes the same turns in lock-step
        token = torch.full((logits.shape[0],), script[state["i"] % len(script)])
        state["i"] += 1
        lp = torch.log_softmax(logits.float() / sampling.temperature, -1).gather(-1, token[:, None]).squeeze(-1)
        return token, (lp if want_log_probs else None)

    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.setattr(hf_module, "_sample", sample)
        trainer.fit()
    return folder / "run"
