"""`posttrain eval --n N` and in-run validation: verl's metric names, values recomputed here from the responses
(exact binomials for pass@k, verl's bootstrap loop written out with numpy's global generator as verl does),
the eval card's hashes against files and weights hashed here, seeds, greedy n, trainer.val_only."""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import textwrap
from collections import Counter, defaultdict
from fractions import Fraction

import numpy as np
import pytest
import torch

from posttrain.data.arithmetic import write_arithmetic_parquet
from posttrain.trainer.evaluate import main
from helpers.tiny_run import one_thread, tiny_model_dir, tiny_trainer

MAX_NEW = 6


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _first_char_scores(text: str) -> dict:
    """The scorer of these tests, as written into the reward file below: varied values and three answers."""
    first = ord(text[0]) if text else 0
    return {"score": float(first % 2 == 0), "acc": float(first % 2 == 0), "pred": str(first % 3)}


def _reward_file(tmp_path):
    path = tmp_path / "first_char_reward.py"
    path.write_text(textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            first = ord(solution_str[0]) if solution_str else 0
            return {"score": float(first % 2 == 0), "acc": float(first % 2 == 0), "pred": str(first % 3)}
    """))
    return path


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _weights_sha256(state_dict) -> str:
    """The card's documented hash: sha256 over name|dtype|shape| and the bytes of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _verl_bootstrap(values, preds, n, seed=42):
    """verl 0.9.1's best@n and maj@n for one prompt, written out: np.random.seed, np.random.choice, a Counter vote."""
    np.random.seed(seed)
    idx = np.random.choice(len(values), size=(1000, n), replace=True)
    best = [max(values[i] for i in row) for row in idx]
    maj = []
    for row in idx:
        votes = Counter(preds[i] for i in row)  # Counter keeps first-seen order; most_common(1) keeps the first of ties
        winner = votes.most_common(1)[0][0]
        maj.append(values[next(i for i in row if preds[i] == winner)])
    return float(np.mean(best)), float(np.mean(maj))


def _by_prompt(rows):
    grouped = defaultdict(list)
    for r in rows:
        grouped[r["uid"]].append(_first_char_scores(r["response"]))
    return list(grouped.values())


def test_eval_n8_reports_verl_metrics_and_unbiased_pass_at_k(tmp_path, capsys):
    model = tiny_model_dir(tmp_path)
    _, test = write_arithmetic_parquet(str(tmp_path / "data"), n_train=4, n_test=5, digits=1, ops=("+",), seed=0)
    reward = _reward_file(tmp_path)
    argv = ["--model", str(model), "--data", test, "--n", "8", "--max-response-length", str(MAX_NEW),
            "--output", str(tmp_path / "cards"), f"custom_reward_function.path={reward}"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    m, src = res["metrics"], "posttrain/arithmetic"

    prompts = _by_prompt(res["rows"])
    assert len(prompts) == 5 and all(len(p) == 8 for p in prompts)
    acc = [[s["acc"] for s in p] for p in prompts]
    assert 0 < np.mean(acc) < 1  # the scorer varies, so the checks below can fail
    assert m[f"val-core/{src}/acc/mean@8"] == pytest.approx(np.mean([np.mean(a) for a in acc]))
    for k in (1, 2, 4, 8):  # exact binomials, averaged over prompts
        want = np.mean([float(1 - Fraction(math.comb(8 - int(sum(a)), k), math.comb(8, k))) for a in acc])
        assert m[f"val-aux/{src}/acc/pass@{k}"] == pytest.approx(want, abs=1e-12)
    best, maj = zip(*(_verl_bootstrap([s["acc"] for s in p], [s["pred"] for s in p], 8) for p in prompts))
    assert m[f"val-core/{src}/acc/best@8/mean"] == pytest.approx(np.mean(best), abs=1e-12)
    assert m[f"val-core/{src}/acc/maj@8/mean"] == pytest.approx(np.mean(maj), abs=1e-12)
    assert f"val-aux/{src}/reward/mean@8" in m and f"val-aux/{src}/acc/maj@4/mean" in m  # verl's val-aux
    assert not [k for k in m if k.startswith("val-core/") and "@8" not in k]  # val-core: the largest N only

    for name in (f"val-core/{src}/acc/mean@8", f"val-core/{src}/acc/maj@8/mean", f"val-aux/{src}/acc/pass@8"):
        assert re.search(rf"^  {re.escape(name)} +{m[name]:.4f}$", printed, re.M), name  # the same seed, the same numbers
    assert "sampled: 8 responses per prompt, temperature 1, top_p 1, top_k -1, seed 1" in printed

    card_files = sorted((tmp_path / "cards").glob("*.json"))
    assert len(card_files) == 2 and f"eval card: {card_files[0]}" in printed
    card = json.loads(card_files[1].read_text())
    assert card == res["card"] and card["format"] == "posttrain.eval_card/1" and card["kind"] == "eval"
    assert card["metrics"] == pytest.approx(m)
    assert card["data"] == [{"path": test, "sha256": _sha256(tmp_path / "data" / "test.parquet"),
                             "bytes": (tmp_path / "data" / "test.parquet").stat().st_size}]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert card["model"]["weights_sha256"] == _weights_sha256(weights)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path, seed=1)).state_dict()
    assert _weights_sha256(other) != card["model"]["weights_sha256"]  # negative control: other weights, other hash
    template = AutoTokenizer.from_pretrained(model).chat_template
    assert card["chat_template"] == {"sha256": hashlib.sha256(template.encode()).hexdigest(), "chars": len(template),
                                     "source": "tokenizer"}
    assert card["sampling"] | {} == {"engine": "hf", "n_requested": 8, "n": 8, "do_sample": True, "temperature": 1.0,
                                     "top_p": 1.0, "top_k": -1, "max_response_length": MAX_NEW}
    assert card["seed"] == 1 and card["prompts"] == 5
    assert card["scorer"]["file"] == str(reward) and card["scorer"]["file_sha256"] == _sha256(reward)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), None)
    if model_name:
        assert card["machine"]["cpu"] == model_name
    assert set(card["machine"]["cpu_flags"]) <= set(open("/proc/cpuinfo").read().split())
    assert card["posttrain"]["version"] and "pass@k" in card["conventions"]


def test_eval_sampling_follows_the_seed(tmp_path, capsys):
    model = tiny_model_dir(tmp_path)
    _, test = write_arithmetic_parquet(str(tmp_path / "data"), n_train=4, n_test=3, digits=1, ops=("+",), seed=0)

    def responses(seed):
        assert main(["--model", str(model), "--data", test, "--n", "4", "--seed", str(seed), "--json",
                     "--max-response-length", str(MAX_NEW), "--output", str(tmp_path / "cards")]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["card"]["seed"] == seed
        return [r["response"] for r in res["rows"]]

    first = responses(3)
    assert len(first) == 12 and responses(3) == first
    assert responses(4) != first  # negative control: another seed, other samples


def test_eval_greedy_n_is_one_response_and_says_so(tmp_path, capsys):
    """n=4 with do_sample=False given: one greedy response per prompt, the metrics named @1, the card says both."""
    model = tiny_model_dir(tmp_path)
    _, test = write_arithmetic_parquet(str(tmp_path / "data"), n_train=4, n_test=3, digits=1, ops=("+",), seed=0)
    assert main(["--model", str(model), "--data", test, "--n", "4", "--max-response-length", str(MAX_NEW),
                 "--output", str(tmp_path / "cards"), "actor_rollout_ref.rollout.val_kwargs.do_sample=False"]) == 0
    out = capsys.readouterr().out
    assert "greedy, 1 response per prompt (val_kwargs.n=4: one greedy response serves for all)" in out
    assert "val-core/posttrain/arithmetic/acc/mean@1" in out and "@4" not in out
    card = json.loads(next((tmp_path / "cards").glob("*.json")).read_text())
    assert (card["sampling"]["n_requested"], card["sampling"]["n"], card["sampling"]["do_sample"]) == (4, 1, False)


def test_eval_refuses_bad_counts_in_python_too():
    from posttrain.config import ConfigError
    from posttrain.trainer.evaluate import evaluate

    for kwargs, message in (({"limit": 0}, "limit=0: the number of prompts"), ({"n": -2}, "n=-2: the number of responses"),
                            ({"temperature": 0.0}, "temperature=0.0: must be > 0"), ({"top_p": 1.5}, "top_p=1.5")):
        with pytest.raises(ConfigError, match=message):
            evaluate("/no/such/model", **kwargs)


def test_in_run_validation_reports_verl_names_writes_its_card_and_val_only_stops(tmp_path):
    """val_kwargs n=4 sampled, trainer.val_only: one validation (step 0), verl's names for the built-in scorer
    (acc is its core field, pred its vote), and a card whose weights hash is the initial model's."""
    vk = "actor_rollout_ref.rollout.val_kwargs"
    trainer = tiny_trainer(tmp_path, ["trainer.val_only=True", f"{vk}.n=4", f"{vk}.do_sample=True",
                                      f"{vk}.temperature=1.0", "trainer.total_training_steps=2"])
    history = trainer.fit()
    assert len(history) == 1 and history[0]["step"] == 0 and trainer.global_step == 0  # validated, trained nothing
    val, src = history[0], "posttrain/arithmetic"
    for name in ("acc/mean@4", "acc/best@4/mean", "acc/best@4/std", "acc/maj@4/mean", "acc/maj@4/std"):
        assert f"val-core/{src}/{name}" in val, name
    for name in ("reward/mean@4", "flexible_acc/mean@4", "acc/pass@1", "acc/pass@4", "acc/std@4", "acc/worst@4/mean"):
        assert f"val-aux/{src}/{name}" in val, name
    assert val[f"val-aux/{src}/acc/pass@1"] == pytest.approx(val[f"val-core/{src}/acc/mean@4"])  # pass@1 = mean
    card = json.loads((tmp_path / "run" / "eval_cards" / "step_0.json").read_text())
    assert card["kind"] == "validation" and card["step"] == 0 and card["prompts"] == 8
    assert card["metrics"][f"val-core/{src}/acc/mean@4"] == val[f"val-core/{src}/acc/mean@4"]
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path)).state_dict()
    assert card["model"]["weights_sha256"] == _weights_sha256(initial)
    assert card["sampling"]["n"] == 4 and card["sampling"]["temperature"] == 1.0 and card["seed"] == 1
    test_file = tmp_path / "data" / "test.parquet"
    assert card["data"][0]["sha256"] == _sha256(test_file)


def test_run_validation_groups_by_prompt_by_hand():
    """Two batches; each prompt answered twice (the generate below repeats rows as an engine with n=2 does).
    Batch 1: prompt val-0-0 acc (1, 0), val-0-1 acc (1, nan: the scorer left it empty, so left out).
    Batch 2 adds a field, `len`, unknown to batch 1. Multi-turn turn counts become verl's (+1: the prompt)."""
    from posttrain.batch import Batch
    from posttrain.trainer.validation import run_validation

    def generate(prompts):
        out = prompts.repeat(2, interleave=True)
        out.non_tensor_batch["multi_turn/turns"] = np.array([1, 3, 1, 1][:len(out)])
        return out

    scores = iter([
        (torch.tensor([[1.0], [0.0], [1.0], [0.0]]), {"acc": np.array([1.0, 0.0, 1.0, np.nan])}),
        (torch.tensor([[0.0], [1.0]]), {"acc": np.array([0.0, 1.0]), "len": np.array([3.0, 5.0])}),
    ])
    batches = [Batch.from_single_dict({"input_ids": torch.zeros(k, 2, dtype=torch.long),
                                       "data_source": np.array(["s"] * k, dtype=object)}) for k in (2, 1)]
    metrics, samples = run_validation(batches, generate, lambda out: next(scores), n=2)
    # acc per prompt: (1, 0) -> 0.5; (1) -> 1.0 (one value: mean@1); (0, 1) -> 0.5
    assert metrics["val-core/s/acc/mean@2"] == pytest.approx(0.5)  # the prompts with 2 values: (0.5 + 0.5) / 2
    assert metrics["val-aux/s/acc/mean@1"] == 1.0  # n_max is 2, so @1 is val-aux
    assert metrics["val-aux/s/len/mean@2"] == 4.0  # only the prompt that has it
    assert metrics["val-aux/s/reward/mean@2"] == pytest.approx((0.5 + 0.5 + 0.5) / 3)
    # pass@1 over all three prompts (0.5, 1, 0.5); pass@2 needs k <= n for every prompt: the one-response prompt stops it
    assert metrics["val-aux/s/acc/pass@1"] == pytest.approx(2 / 3) and "val-aux/s/acc/pass@2" not in metrics
    assert (metrics["val-aux/num_turns/min"], metrics["val-aux/num_turns/max"]) == (2.0, 4.0)
    assert [len(s["scores"]) for s in samples] == [4, 2]
