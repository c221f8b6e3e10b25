"""posttrain eval: the printed accuracy equals greedy `model.generate` + the scorer, computed here.

The model is a tiny Llama made into a bigram model (attention and MLP outputs zeroed, so the last
token alone picks the next one) whose greedy reply to any chat prompt is "12" then EOS: replies
are known, and a "flexible" scorer gives a nonzero accuracy that differs between data sources.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from posttrain.data.arithmetic import Problem, make_rows, write_arithmetic_parquet
from posttrain.data.schema import read_rows, write_rows
from posttrain.rewards import arithmetic
from posttrain.trainer.evaluate import main
from helpers.tiny_run import one_thread, tiny_model_dir

MAX_NEW = 8


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _bigram_model_dir(tmp_path):
    """A saved tiny model whose greedy continuation of '\\n' is '1', '2', EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(src)
    tok = AutoTokenizer.from_pretrained(src)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        chain = [tok.convert_tokens_to_ids(t) for t in ("\n", "1", "2")] + [tok.eos_token_id]
        for dim, (cur, nxt) in enumerate(zip(chain, chain[1:])):
            emb[cur] = 0.0
            emb[cur, dim] = 1.0
            head[nxt, dim] = 10.0
    out = tmp_path / "bigram"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, model.eval(), tok


def _flexible_reward_file(tmp_path):
    path = tmp_path / "flexible_reward.py"
    path.write_text(textwrap.dedent("""
        from posttrain.rewards import arithmetic

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return arithmetic.compute_score(solution_str, ground_truth, method="flexible")
    """))
    return path


def _datasets(tmp_path):
    """Two files: 4 rows of posttrain/arithmetic (2 answers are 12), 3 rows of other/arith (1 is 12)."""
    a = make_rows([Problem(5, "+", 7), Problem(3, "+", 4), Problem(8, "+", 4), Problem(1, "+", 1)], "test")
    b = make_rows([Problem(2, "+", 2), Problem(6, "+", 6), Problem(9, "+", 9)], "test")
    for row in b:
        row["data_source"] = "other/arith"
    paths = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_rows(a, str(paths[0]))
    write_rows(b, str(paths[1]))
    return [str(p) for p in paths]


def independent(model, tok, files, score_fn) -> dict[str, tuple[int, float]]:
    """{data_source: (n, mean score)} and 'overall', from HF generate (one prompt at a time) + score_fn."""
    per: dict[str, list[float]] = {}
    for f in files:
        for row in read_rows(f):
            text = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            per.setdefault(row["data_source"], []).append(score_fn(reply, row["reward_model"]["ground_truth"]))
    result = {s: (len(v), sum(v) / len(v)) for s, v in per.items()}
    every = [x for v in per.values() for x in v]
    result["overall"] = (len(every), sum(every) / len(every))
    return result


def _printed(out: str) -> dict[str, tuple[int, float]]:
    """The table rows `source  n  accuracy [flexible]` of the plain output."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) in (3, 4) and parts[1].isdigit():
            rows[parts[0]] = (int(parts[1]), float(parts[2]))
    return rows


def test_eval_matches_independent_greedy_scoring(tmp_path, capsys):
    model_dir, model, tok = _bigram_model_dir(tmp_path)
    files = _datasets(tmp_path)
    reward = _flexible_reward_file(tmp_path)
    want = independent(model, tok, files, lambda s, gt: arithmetic.compute_score(s, gt, method="flexible"))
    assert want["posttrain/arithmetic"] == (4, 0.5) and want["other/arith"] == (3, pytest.approx(1 / 3))

    argv = ["--model", str(model_dir), "--data", *files, "--max-response-length", str(MAX_NEW),
            "--batch-size", "3", "--output", str(tmp_path / "cards"), f"custom_reward_function.path={reward}"]
    assert main(argv) == 0
    printed = _printed(capsys.readouterr().out)
    assert set(printed) == set(want)
    for source, (n, acc) in want.items():
        assert printed[source] == (n, round(acc, 4))

    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["overall"] == {"n": 7, "responses": 7, "accuracy": pytest.approx(want["overall"][1])}
    for source, (n, acc) in want.items():
        if source != "overall":
            assert res["per_source"][source] == {"n": n, "responses": n, "accuracy": pytest.approx(acc)}
            # greedy: one response a prompt, so verl's mean@1 of the reward (no acc from this scorer) is the accuracy
            assert res["metrics"][f"val-core/{source}/reward/mean@1"] == pytest.approx(acc)
    assert {r["response"] for r in res["rows"]} == {"12"}


def test_eval_default_scorer_and_builtin_style_data(tmp_path, capsys):
    """The built-in arithmetic scorer (strict: needs '#### 12'), on a written arithmetic split; the
    tiny random model's replies, scored here, give the same accuracy."""
    model_dir = tiny_model_dir(tmp_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    _, test = write_arithmetic_parquet(str(tmp_path / "data"), n_train=8, n_test=6, digits=1, ops=("+",), seed=0)
    want = independent(model, tok, [test], arithmetic.compute_score)
    assert main(["--model", str(model_dir), "--data", test, "--max-response-length", str(MAX_NEW), "--json",
                 "--output", str(tmp_path / "cards")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["overall"]["n"] == 6 and res["overall"]["accuracy"] == pytest.approx(want["overall"][1])
    assert res["per_source"]["posttrain/arithmetic"]["accuracy"] == pytest.approx(want["posttrain/arithmetic"][1])
    flexible = independent(model, tok, [test], lambda s, gt: arithmetic.compute_score(s, gt, method="flexible"))
    assert res["per_source"]["posttrain/arithmetic"]["flexible_accuracy"] == pytest.approx(flexible["overall"][1])


def test_eval_a_checkpoint_equals_its_model(tmp_path, capsys):
    """A global_step_N folder is evaluated through its actor/huggingface config + weights; `--limit` limits."""
    from posttrain.checkpoint import CheckpointManager, RoleState

    model_dir, model, tok = _bigram_model_dir(tmp_path)
    files = _datasets(tmp_path)
    reward = _flexible_reward_file(tmp_path)
    root = tmp_path / "ckpt"
    CheckpointManager(root).save(3, {"actor": RoleState(model=model.state_dict(), hf_config=model.config,
                                                        tokenizer=tok)}, {"step": 3})
    common = ["--data", *files, "--max-response-length", str(MAX_NEW), "--limit", "2", "--json",
              "--output", str(tmp_path / "cards"), f"custom_reward_function.path={reward}"]
    assert main(["--model", str(root / "global_step_3"), *common]) == 0
    from_ckpt = json.loads(capsys.readouterr().out)
    assert main(["--model", str(model_dir), *common]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert from_ckpt["overall"]["n"] == 2  # --limit: the first 2 prompts (of the first file)
    assert from_ckpt["per_source"] == from_dir["per_source"] == {"posttrain/arithmetic": {"n": 2, "responses": 2,
                                                                                          "accuracy": 0.5}}
    # the same weights, so the same hash on both cards (the checkpoint is exported to a temporary folder first)
    assert from_ckpt["card"]["model"]["weights_sha256"] == from_dir["card"]["model"]["weights_sha256"]
    assert [r["response"] for r in from_ckpt["rows"]] == [r["response"] for r in from_dir["rows"]]


def test_eval_errors_are_reported(tmp_path, capsys):
    assert main(["--model", str(tiny_model_dir(tmp_path)), "--data", str(tmp_path / "missing.parquet"),
                 "--output", str(tmp_path / "cards")]) == 2
    assert "error:" in capsys.readouterr().err


def test_eval_a_model_path_that_does_not_exist_names_it(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--output", str(tmp_path / "cards")]) == 2
    err = capsys.readouterr().err
    assert f"error: --model {tmp_path / 'nope'}: {tmp_path / 'nope'} does not exist" in err and "Traceback" not in err


def test_eval_of_a_data_source_without_a_scorer_stops_before_generating(tmp_path, capsys, monkeypatch):
    """Issue 59: other/arith has no built-in scorer; without a custom reward it is named (file, row, value) before
    any response is generated."""
    import posttrain.trainer.evaluate as evaluate

    files = _datasets(tmp_path)
    monkeypatch.setattr(evaluate, "_load_policy", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(["--model", str(tiny_model_dir(tmp_path)), "--data", *files, "--output", str(tmp_path / "cards")]) == 2
    err = capsys.readouterr().err
    assert f"error: {files[1]} row 0: data_source='other/arith' has no built-in scorer (known: " in err, err


def test_eval_data_that_is_not_a_prompt_file_is_named_before_anything_loads(tmp_path, capsys, monkeypatch):
    """A folder, a missing file, another kind of file: one line naming ``--data`` before the model or its tokenizer
    loads; the control: a prompt file gets as far as the tokenizer."""
    import posttrain.trainer.evaluate as evaluate

    monkeypatch.setattr(evaluate, "_load_tokenizer", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    (tmp_path / "notes.txt").write_text("1+1=2")
    model = str(tiny_model_dir(tmp_path))
    for given, problem in ((tmp_path, "is a folder; give .parquet/.jsonl/.json files"),
                           (tmp_path / "gone.parquet", "does not exist"),
                           (tmp_path / "notes.txt", "is not a .parquet/.jsonl/.json file")):
        assert main(["--model", model, "--data", str(given)]) == 2
        assert f"error: --data {given} {problem}" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="loaded"):
        main(["--model", model, "--data", _datasets(tmp_path)[0]])
