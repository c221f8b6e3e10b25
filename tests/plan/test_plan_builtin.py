"""`posttrain plan` on the run `posttrain train` runs: overrides alone land on the built-in run, and
the built-in model's shape is read from its GGUF (the cached plain copy, else the file's header)."""

import importlib.util
import json

import numpy as np
import pytest

from posttrain.cli import main as cli
from posttrain.config import BUILTIN_CONFIG, load_config
from posttrain.models.model_path import ResolvedModel, gguf_cache_folder
from posttrain.plan.flow import build_flow

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="the gguf package is not installed")


def _plan_json(capsys, *argv):
    rc = cli(["plan", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_overrides_alone_plan_the_builtin_run_as_train_runs_it(capsys):
    rc, data = _plan_json(capsys, "actor_rollout_ref.rollout.n=8", "data.train_batch_size=4",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    # the reference: the config `posttrain train` builds from the same overrides
    train = load_config(overrides=["actor_rollout_ref.rollout.n=8", "data.train_batch_size=4",
                                   "actor_rollout_ref.actor.ppo_mini_batch_size=4"], base=BUILTIN_CONFIG)
    from posttrain.plan import cpu_terms, threads_per_process

    # the one thing the plan adds: on a CPU, the threads of each process (the header's terms)
    assert data["flow"].pop("cpu_threads") == (threads_per_process(1) if cpu_terms(train) else None)
    assert data["flow"] == {k: v for k, v in json.loads(json.dumps(build_flow(train).as_dict())).items()
                            if k != "cpu_threads"}
    assert data["flow"]["responses_per_step"] == 32 and "the built-in run" in data["source"]
    assert data["flow"]["steps_per_epoch"] == 1024 // 4  # the built-in task's 1024 questions, counted


def test_defaults_and_scripts_still_start_from_verls_defaults(capsys, grpo_script):
    rc, data = _plan_json(capsys, "defaults", "--params", "7e9")
    assert data["flow"]["responses_per_step"] == 1024 and data["source"] == "defaults"  # verl: 1024 prompts x 1
    rc, data = _plan_json(capsys, str(grpo_script), "--params", "7e9")
    assert data["flow"]["responses_per_step"] == 5120  # the script's own keys, over verl's defaults


def _write_gguf(path, *, with_shape=True, separate_head=False):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    if with_shape:
        w.add_block_count(2)
        w.add_embedding_length(64)
        w.add_feed_forward_length(160)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_context_length(512)
        w.add_vocab_size(100)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    if separate_head:
        w.add_tensor("output.weight", np.zeros((100, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _params(hidden, layers, kv_heads, head_dim, inter, vocab, tied):
    """A Llama model's parameter count by hand: attention q,o (h x h) and k,v (h x kv*d), the MLP's
    three matrices, two RMSNorm weights a layer, the final norm, the embedding and an untied head."""
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + hidden + vocab * hidden * (1 if tied else 2)


@needs_gguf
def test_gguf_shape_is_read_from_its_header(capsys, tmp_path):
    tied = _write_gguf(tmp_path / "tied.gguf")
    rc, data = _plan_json(capsys, f"actor_rollout_ref.model.path={tied}")
    dims = data["memory"]["dims"]
    assert (dims["hidden"], dims["layers"], dims["heads"], dims["kv_heads"], dims["vocab"], dims["intermediate"]) == \
        (64, 2, 4, 2, 100, 160)
    assert dims["tied_embeddings"] is True and "its header" in dims["source"]
    assert dims["params"] == pytest.approx(_params(64, 2, 2, 16, 160, 100, tied=True), rel=0.01)
    untied = _write_gguf(tmp_path / "untied.gguf", separate_head=True)  # negative control: a head of its own
    rc, data = _plan_json(capsys, f"actor_rollout_ref.model.path={untied}")
    assert data["memory"]["dims"]["tied_embeddings"] is False
    assert data["memory"]["dims"]["params"] == pytest.approx(_params(64, 2, 2, 16, 160, 100, tied=False), rel=0.01)


@needs_gguf
def test_a_gguf_without_a_shape_is_named_and_the_rest_is_planned(capsys, tmp_path):
    bare = _write_gguf(tmp_path / "bare.gguf", with_shape=False)
    rc, data = _plan_json(capsys, f"actor_rollout_ref.model.path={bare}")
    assert str(bare) in data["memory"]["skipped"] and "block_count" in data["memory"]["skipped"]
    assert data["flow"]["responses_per_step"] == 32  # the flow is still planned


@needs_gguf
def test_the_cached_plain_copy_wins_over_the_header(capsys, tmp_path):
    gguf = _write_gguf(tmp_path / "m.gguf")
    copy = gguf_cache_folder(ResolvedModel(str(tmp_path), "m.gguf"))  # under the tests' POSTTRAIN_CACHE_DIR
    copy.mkdir(parents=True)
    (copy / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 96, "num_hidden_layers": 3,
                                                  "num_attention_heads": 4, "vocab_size": 100,
                                                  "intermediate_size": 160, "tie_word_embeddings": True}))
    rc, data = _plan_json(capsys, f"actor_rollout_ref.model.path={gguf}")
    assert data["memory"]["dims"]["hidden"] == 96 and str(copy) in data["memory"]["dims"]["source"]
