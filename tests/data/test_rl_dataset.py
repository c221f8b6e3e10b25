"""RLHFDataset: schema reading (parquet/jsonl), chat-template tokenization, collate, bad input."""

import json
import logging

import pytest
import torch

from posttrain.data import DataError, RLHFDataset, collate_prompts, render_prompt, write_rows
from helpers.data import make_data_config
from helpers.tokenizer import build_tiny_tokenizer


def row(q="What is 1 + 2?", gt="3", i=0, **over):
    r = {
        "data_source": "posttrain/arithmetic",
        "prompt": [{"role": "user", "content": q}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "train", "index": i},
    }
    r.update(over)
    return r


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_tiny_tokenizer(tok):
    assert len(tok) == 106
    assert tok.pad_token_id == 0 and tok.eos_token == "<|im_end|>" and tok.bos_token == "<s>"
    text = render_prompt(tok, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # <|im_start|> user \n hi <|im_end|> \n <|im_start|> assistant \n
    assert len(ids) == 1 + 4 + 1 + 2 + 1 + 1 + 1 + 9 + 1
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


def test_parquet_and_jsonl_give_same_items(tmp_path, tok):
    rows = [row("What is 1 + 2?", "3", 0), row("What is 10 + 20?", "30", 1)]
    pq, js = str(tmp_path / "a.parquet"), str(tmp_path / "a.jsonl")
    write_rows(rows, pq)
    write_rows(rows, js)
    cfg = make_data_config(max_prompt_length=64, return_raw_chat=True)
    a, b = RLHFDataset(pq, tok, cfg), RLHFDataset([js], tok, cfg)
    assert len(a) == len(b) == 2
    for i in range(2):
        assert a[i]["input_ids"].tolist() == b[i]["input_ids"].tolist()
        assert a[i]["reward_model"] == b[i]["reward_model"]
    item = a[1]
    # chat template rendering of "What is 10 + 20?": 1 + 4 + 1 + 16 + 1 + 1 + 1 + 9 + 1 = 35 tokens
    assert item["input_ids"].shape == (35,)
    assert item["raw_prompt"] == [{"role": "user", "content": "What is 10 + 20?"}]
    assert item["index"] == 1 and item["data_source"] == "posttrain/arithmetic"
    expected = tok.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert item["input_ids"].tolist() == list(expected)


def test_collate_left_pads(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [row("ab", "1", 0), row("abcd", "2", 1)])
    ds = RLHFDataset(path, tok, make_data_config(max_prompt_length=64, return_raw_chat=True))
    b = ds.collate_fn([ds[0], ds[1]])
    # lengths: 21 tokens for "ab", 23 for "abcd"
    assert b["input_ids"].shape == (2, 23)
    assert b["attention_mask"][0].tolist() == [0, 0] + [1] * 21
    assert b["input_ids"][0, :2].tolist() == [0, 0]  # pad id 0 on the left
    assert b["position_ids"][0].tolist() == [0, 0] + list(range(21))
    assert b["position_ids"][1].tolist() == list(range(23))
    assert b["reward_model"][1]["ground_truth"] == "2"
    assert b["index"].tolist() == [0, 1]
    assert b["raw_prompt"][0] == [{"role": "user", "content": "ab"}]
    assert set(b.non_tensor_batch) == {"data_source", "reward_model", "extra_info", "index", "ability", "raw_prompt"}
    ds2 = RLHFDataset(path, tok, make_data_config(max_prompt_length=64, return_raw_chat=False))
    assert "raw_prompt" not in ds2.collate_fn([ds2[0]]).non_tensor_batch


def test_collate_hand_built():
    b = collate_prompts([{"input_ids": [5, 6, 7], "x": "a"}, {"input_ids": [9], "x": "b"}], pad_token_id=1)
    assert b["input_ids"].tolist() == [[5, 6, 7], [1, 1, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert b["x"].tolist() == ["a", "b"]


def test_fallback_without_chat_template(tmp_path):
    tok = build_tiny_tokenizer(chat_template=None)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert render_prompt(tok, msgs) == "system: be brief\nuser: 2+2?\nassistant:"
    path = write_jsonl(tmp_path / "d.jsonl", [row(gt="4", prompt=msgs)])
    ds = RLHFDataset(path, tok, make_data_config(max_prompt_length=64))
    assert tok.decode(ds[0]["input_ids"]) == "system: be brief\nuser: 2+2?\nassistant:"


@pytest.mark.parametrize(
    "bad, pattern",
    [
        ({"prompt": None}, r"row 1: missing field 'prompt' \(data.prompt_key\)"),
        ({"prompt": "What is 1 + 2?"}, r"row 1: field 'prompt' must be a list of .* messages, got str"),
        ({"prompt": []}, r"row 1: field 'prompt' is an empty list"),
        ({"prompt": [{"role": "user", "content": "  "}]}, r"row 1: field 'prompt' has only empty message contents"),
        ({"prompt": [{"role": "user"}]}, r"row 1: field 'prompt' message 0 must be a dict"),
        ({"reward_model": {"style": "rule"}}, r"row 1: missing field 'reward_model.ground_truth'"),
        ({"data_source": None}, r"row 1: missing field 'data_source'"),
    ],
)
def test_bad_rows_name_file_row_field(tmp_path, tok, bad, pattern):
    r = row(i=1)
    r.update(bad)
    path = write_jsonl(tmp_path / "bad.jsonl", [row(), r])
    with pytest.raises(DataError, match=pattern) as e:
        RLHFDataset(path, tok, make_data_config())
    assert "bad.jsonl" in str(e.value)


def test_bad_files(tmp_path, tok):
    cfg = make_data_config()
    with pytest.raises(DataError, match=r"nope.parquet: file not found"):
        RLHFDataset(str(tmp_path / "nope.parquet"), tok, cfg)
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=r"d.csv: unsupported file type; expected one of .parquet, .jsonl, .json"):
        RLHFDataset(str(csv), tok, cfg)
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DataError, match=r"fake.parquet: not a readable parquet file"):
        RLHFDataset(str(fake), tok, cfg)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(row()) + "\n{oops\n")
    with pytest.raises(DataError, match=r"broken.jsonl: line 2 is not valid JSON"):
        RLHFDataset(str(broken), tok, cfg)


def test_overlong_error_filter_truncate(tmp_path, tok, caplog):
    # "ab" renders to 21 tokens, "a"*30 to 49
    path = write_jsonl(tmp_path / "d.jsonl", [row("ab", "1", 0), row("a" * 30, "2", 1), row("abc", "3", 2)])
    with pytest.raises(DataError, match=r"d.jsonl row 1: prompt is 49 tokens, longer than data.max_prompt_length=30"):
        RLHFDataset(path, tok, make_data_config(max_prompt_length=30))
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(path, tok, make_data_config(max_prompt_length=30, filter_overlong_prompts=True))
    assert len(ds) == 2 and ds.num_filtered == 1
    assert [ds[i]["reward_model"]["ground_truth"] for i in range(2)] == ["1", "3"]
    assert "filtered 1 of 3 prompts longer than data.max_prompt_length=30" in caplog.text
    full = RLHFDataset(path, tok, make_data_config(max_prompt_length=64))[1]["input_ids"].tolist()
    for mode, expect in [
        ("left", full[-30:]),
        ("right", full[:30]),
        ("middle", full[:15] + full[-15:]),
    ]:
        ds = RLHFDataset(path, tok, make_data_config(max_prompt_length=30, truncation=mode))
        assert ds[1]["input_ids"].tolist() == expect and ds.num_truncated == 1
    with pytest.raises(ValueError, match=r"data.truncation='cut'"):
        RLHFDataset(path, tok, make_data_config(truncation="cut"))


def test_missing_index_uses_position(tmp_path, tok):
    r = row()
    del r["extra_info"]
    path = write_jsonl(tmp_path / "d.jsonl", [row(i=7), r])
    ds = RLHFDataset(path, tok, make_data_config())
    assert ds[0]["index"] == 7 and ds[1]["index"] == 1 and ds[1]["extra_info"] == {}
    assert isinstance(ds[0]["input_ids"], torch.Tensor)


@pytest.mark.parametrize("column, key", [("images", "image_key"), ("videos", "video_key"), ("audios", "audio_key")])
def test_media_columns_are_refused_before_any_model_loads(tmp_path, tok, column, key):
    """verl's multimodal keys: a row holding images (videos, audio) stops with one line naming the file, the row and
    the key; the same rows without the column, or with an empty one, load (the keys have no effect)."""
    path = tmp_path / "mm.parquet"
    write_rows([row(i=0), {**row(i=1), column: [{"image": "x.png"}]}], str(path))
    with pytest.raises(DataError, match=rf"mm.parquet row 1: column '{column}' \(data.{key}\) holds .* not supported"):
        RLHFDataset(str(path), tok, make_data_config())
    write_rows([row(i=0), {**row(i=1), column: []}], str(path))
    assert len(RLHFDataset(str(path), tok, make_data_config())) == 2
    write_rows([row(i=0), {**row(i=1), column: [{"image": "x.png"}]}], str(path))
    assert len(RLHFDataset(str(path), tok, make_data_config(**{key: "no_such_column"}))) == 2


def test_write_rows_keeps_a_column_only_later_rows_have(tmp_path):
    """pyarrow infers a table's columns from its first row: a column that only row 2 has must still be written."""
    from posttrain.data.schema import read_rows

    for name in ("r.parquet", "r.jsonl"):
        write_rows([{"a": 1}, {"a": 2, "b": [1, 2]}], str(tmp_path / name))
        rows = read_rows(str(tmp_path / name))
        assert rows[1]["b"] == [1, 2] and rows[0].get("b") is None
