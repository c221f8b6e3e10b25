"""`posttrain plan` as a user runs it: text, --json, every problem at once, file:line errors."""

import json

from posttrain.cli import main as cli


def _run(capsys, *argv):
    rc = cli(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_grpo_script_text(capsys, grpo_script, deepseek_dir):
    rc, out, _ = _run(capsys, str(grpo_script), "--model-config", str(deepseek_dir))
    assert rc == 0
    assert "responses               5120  = 1024 prompts x rollout.n=5" in out
    assert ("one vllm engine per rank (8 ranks, each with the full weights): 640 responses each (128 prompts x 5)"
            in out)
    assert ("tensor_model_parallel_size=2 requested; this build runs each vllm engine with TP 1 on its own rank, "
            "so the key is not applied") in out
    assert "tensor-parallel size 2" not in out and "/ TP" not in out
    assert "4 rounds of 160 responses per rank" in out
    assert "each: 2 micro-batches of 80 (gradient accumulation 2)" in out
    assert "105 training steps in total" in out and "420 actor optimizer steps" in out
    assert "because actor.use_kl_loss=True" in out and "grpo is critic-free" in out
    assert "verdict: fits: peak 60.2 GiB of 80.0 GiB in actor update" in out and "Problems: 0 errors, 0 warnings" in out


def test_json_matches_the_text(capsys, ppo_script, deepseek_dir):
    rc, out, _ = _run(capsys, "--script", str(ppo_script), "--model-config", str(deepseek_dir), "--json")
    data = json.loads(out)
    assert rc == 0 and set(data) == {"source", "flow", "models", "memory", "reward", "errors", "warnings"}
    assert data["flow"]["critic"]["micro_batch"] == 32 and data["flow"]["total_steps"] == 105
    assert data["memory"]["level"] == "fits" and data["memory"]["roles"]["critic"]["gradient_checkpointing"] is True
    assert [m["role"] for m in data["models"] if m["loaded"]] == ["actor", "critic"]


def test_overrides_apply_after_the_script(capsys, grpo_script):
    rc, out, _ = _run(capsys, str(grpo_script), "actor_rollout_ref.rollout.n=8", "--params", "7e9", "--json")
    data = json.loads(out)
    assert data["flow"]["responses_per_step"] == 8192 and data["memory"]["dims"]["params"] == 7e9


def test_all_problems_are_listed_not_just_the_first(capsys, grpo_script):
    rc, out, _ = _run(capsys, str(grpo_script), "data.truncation=sideways", "actor_rollout_ref.rollout.top_p=2",
                      "actor_rollout_ref.actor.entropy_coeff=0.01", "algorithm.use_kl_in_reward=True")
    assert rc == 1
    assert "Problems: 2 errors, 2 warnings" in out
    assert "error: data.truncation='sideways' is not one of" in out
    assert "error: actor_rollout_ref.rollout.top_p=2" in out
    assert "warning: KL is used twice" in out and "warning: actor_rollout_ref.actor.entropy_coeff=0.01 with grpo" in out
    assert "skipped: the model's shape is unknown" in out  # the hub id is not a local folder here


def test_plan_specific_checks(capsys, grpo_script):
    rc, out, _ = _run(capsys, str(grpo_script), "actor_rollout_ref.rollout.name=sglang",
                      "actor_rollout_ref.actor.kl_loss_coef=0", "--json")
    data = json.loads(out)
    assert rc == 1 and any("rollout.name=sglang: posttrain has no SGLang engine" in e for e in data["errors"])
    reference = next(m for m in data["models"] if m["role"] == "reference")
    assert not reference["loaded"] and "kl_loss_coef=0" in reference["why"]  # a zero KL weight loads no reference


def test_a_zero_kl_coefficient_loads_no_reference(capsys, grpo_script):
    """The lever's memory claim in the plan: no reference row's parameters (a negative control: coef 0.001)."""
    sizes = {}
    for coef in ("0", "0.001"):
        rc, out, _ = _run(capsys, str(grpo_script), f"actor_rollout_ref.actor.kl_loss_coef={coef}",
                          "actor_rollout_ref.model.path=HuggingFaceTB/SmolLM2-135M-Instruct", "--json")
        data = json.loads(out)
        sizes[coef] = [m["loaded"] for m in data["models"] if m["role"] == "reference"]
    assert sizes == {"0": [False], "0.001": [True]}


def test_unapplied_tensor_parallel_size_is_a_note_not_an_error(capsys, grpo_script):
    # TP 3 does not divide 8 GPUs; in verl that is an error, here the key is not applied, so nothing breaks.
    rc, out, _ = _run(capsys, str(grpo_script), "actor_rollout_ref.rollout.tensor_model_parallel_size=3")
    assert rc == 0 and "Problems: 0 errors" in out
    assert "tensor_model_parallel_size=3 requested; this build runs each vllm engine with TP 1" in out
    # negative control: the hf engine ignores the key in verl too, so no note
    rc, out, _ = _run(capsys, str(grpo_script), "actor_rollout_ref.rollout.name=hf")
    assert rc == 0 and "tensor_model_parallel_size" not in out
    assert "hf on each of the 8 ranks (the actor's own weights): 640 responses each (128 prompts x 5)" in out


def test_bad_script_names_file_and_line(capsys, tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\npython3 -m verl.trainer.main_ppo \\\n    data.train_batch_size=64 \\\n"
                      "    actor_rollout_ref.actor.ppo_mini_batchsize=8 \\\n    trainer.nnodes=1\n")
    rc, _, err = _run(capsys, "--script", str(script))
    assert rc == 2 and f"{script}:4" in err and "unknown config key 'actor_rollout_ref.actor.ppo_mini_batchsize'" in err
    assert "did you mean actor_rollout_ref.actor.ppo_mini_batch_size" in err
    script.write_text("python3 -m verl.trainer.main_ppo \\\n    data.train_batch_size=many\n")
    rc, _, err = _run(capsys, str(script))
    assert rc == 2 and f"{script}:2" in err and "wrong type: expected int" in err
    script.write_text("python3 -m verl.trainer.main_ppo \\\n    trainer.project_name='open\n")
    rc, _, err = _run(capsys, str(script))
    assert rc == 2 and f"{script}:1: cannot parse shell line" in err


def test_bad_yaml_names_file_and_line(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("data:\n  train_batch_size: 64\nalgorithm:\n  adv_estimatr: grpo\n")
    rc, _, err = _run(capsys, "--config", str(cfg))
    assert rc == 2 and f"{cfg}:4" in err and "unknown config key 'algorithm.adv_estimatr'" in err


def test_grpo_pitfalls_are_reported(capsys, grpo_script):
    # n=1 gives GRPO groups of one; temperature 0 makes the n samples identical
    rc, out, _ = _run(capsys, str(grpo_script), "actor_rollout_ref.rollout.n=1", "--json")
    assert rc == 1 and any("rollout.n=1 gives groups of one" in e for e in json.loads(out)["errors"])
    rc, out, _ = _run(capsys, str(grpo_script), "actor_rollout_ref.rollout.temperature=0", "--json")
    assert rc == 1 and any("temperature=0 with do_sample=True" in e for e in json.loads(out)["errors"])
    rc, out, _ = _run(capsys, str(grpo_script), "actor_rollout_ref.rollout.do_sample=False", "--json")
    assert rc == 0 and any("greedy samples are identical" in w for w in json.loads(out)["warnings"])


def test_only_a_one_process_cpu_run_counts_its_reference_in_bf16(capsys, grpo_script, deepseek_dir):
    """store_frozen_in_bf16 is the one-process placement's lever: a bf16 CPU keeps the reference in 2 bytes a
    parameter there; CPU ranks (FSDP2) keep it in model_dtype (4 bytes), as does any run on a CPU without bf16."""
    from posttrain.models.compute_dtype import cpu_bf16_support

    per_param = {}
    for ranks in (1, 2):
        rc, out, _ = _run(capsys, str(grpo_script), f"trainer.n_gpus_per_node={ranks}", "trainer.device=cpu",
                          "--model-config", str(deepseek_dir), "--json")
        memory = json.loads(out)["memory"]
        per_param[ranks] = memory["roles"]["reference"]["params"] * ranks / memory["dims"]["params"]
    assert per_param == {1: 2.0 if cpu_bf16_support()[0] else 4.0, 2: 4.0}


def test_a_cpu_run_is_planned_in_cpu_terms(capsys, grpo_script, deepseek_dir):
    from posttrain.host.memory_plan import machine_ram
    from posttrain.models.compute_dtype import cpu_bf16_support

    def plan(device: str, *options: str) -> tuple[int, dict]:
        rc, out, _ = _run(capsys, str(grpo_script), "trainer.n_gpus_per_node=1", f"trainer.device={device}",
                          "--model-config", str(deepseek_dir), "--json", *options)
        return rc, json.loads(out)["memory"]

    rc, cpu = plan("cpu")
    assert rc in (0, 1) and cpu["unit"] == "process"
    assert abs(cpu["gpu_memory"] - machine_ram()[0] * 2**30) < 2**20  # the budget: this machine's RAM
    bf16 = cpu_bf16_support()[0]
    assert ("bf16 compute" if bf16 else "fp32 compute") in cpu["assumptions"][0]
    # negative controls: the same run on a GPU, or with --gpu-memory, is planned per GPU in bf16
    gpu = plan("cuda")[1]
    assert gpu["unit"] == "GPU" and gpu["gpu_memory"] == 80 * 2**30
    assert gpu["roles"]["rollout"]["weights"] <= cpu["roles"]["rollout"]["weights"]
    assert plan("cpu", "--gpu-memory", "40GiB")[1]["unit"] == "GPU"
    if not bf16:  # fp32 compute doubles the rollout weights' bytes against the GPU's bf16
        assert cpu["roles"]["rollout"]["weights"] == 2 * gpu["roles"]["rollout"]["weights"]


def test_a_model_folder_that_does_not_exist_is_a_problem(capsys, tmp_path):
    """Issue 59: a missing model folder was planned with 0 problems (only its shape unknown) and exit 0."""
    missing = tmp_path / "no_such_model"
    rc, out, _ = _run(capsys, f"actor_rollout_ref.model.path={missing}", "--json")
    errors = json.loads(out)["errors"]
    assert rc == 1 and f"actor_rollout_ref.model.path={missing}: {missing} does not exist" in errors[0], errors
    # the critic's too, when a critic is used; a hub id is no problem (it is read from the hub at train time)
    rc, out, _ = _run(capsys, "algorithm.adv_estimator=gae", f"critic.model.path={missing}", "--json")
    assert rc == 1 and any(e.startswith(f"critic.model.path={missing}: ") for e in json.loads(out)["errors"])
    rc, out, _ = _run(capsys, "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "--json")
    assert not any("model.path" in e for e in json.loads(out)["errors"])


def test_a_model_config_that_is_not_text_is_named(capsys, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x80\x04\x95\xff\xfe" * 40)
    rc, _, err = _run(capsys, "--model-config", str(weights))
    assert rc == 2
    assert err.strip() == (f"error: {weights} is not a JSON/YAML text config (it holds binary data); give a model "
                           "folder or its config.json")
    broken = tmp_path / "config.json"
    broken.write_text('{"hidden_size": 576,\n "num_hidden_layers": }\n')
    rc, _, err = _run(capsys, "--model-config", str(broken))
    assert rc == 2 and err.startswith(f"error: {broken}:2: not a JSON config (")


def test_an_absurd_model_dimension_names_the_key_and_the_range(capsys, tmp_path):
    """`hidden_size: 1e308` was an OverflowError traceback; any dimension that is not a whole number in range is
    refused naming its key."""
    for key, value in [("hidden_size", "1e308"), ("hidden_size", "576.5"), ("num_hidden_layers", "-3"),
                       ("vocab_size", "true"), ("intermediate_size", str(2**40)), ("num_attention_heads", '"9"')]:
        config = tmp_path / "config.json"
        config.write_text('{"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, '
                          f'"vocab_size": 49152, "intermediate_size": 1536, "{key}": {value}}}')
        rc, _, err = _run(capsys, "--model-config", str(config))
        assert rc == 2 and "Traceback" not in err
        assert err.startswith(f"error: {config}: {key}=") and err.rstrip().endswith(
            "is not a model dimension: it must be a whole number from 1 to 16,777,216"), err
    rc, _, err = _run(capsys, "--hidden", str(10**400), "--layers", "3")
    assert rc == 2 and "error: --hidden=1000" in err and "must be a whole number from 1 to 16,777,216" in err


def test_only_keys_the_user_set_are_warned_about(capsys, tmp_path):
    """Issue 59: the built-in run (no arguments) warned that critic.* keys are set: its base sets them, for
    adv_estimator=gae, not the user. A key the user sets (command line, YAML, script) is still named."""
    rc, out, _ = _run(capsys, "--json")
    assert not [w for w in json.loads(out)["warnings"] if "critic" in w or "ref." in w]
    rc, out, _ = _run(capsys, "critic.optim.lr=3e-5", "--json")
    assert ("critic.optim.lr is set but no critic is used (adv_estimator=grpo is critic-free)"
            in json.loads(out)["warnings"])
    config = tmp_path / "run.yaml"
    config.write_text("algorithm:\n  adv_estimator: grpo\ncritic:\n  ppo_micro_batch_size_per_gpu: 4\n  optim:\n"
                      "    lr: 1.0e-5\n")
    rc, out, _ = _run(capsys, str(config), "--json")
    assert ("critic.optim.lr, critic.ppo_micro_batch_size_per_gpu are set but no critic is used (adv_estimator=grpo "
            "is critic-free)") in json.loads(out)["warnings"]
    # the reference's micro-batch size: the base's is not blamed when the user turns the KL loss off
    rc, out, _ = _run(capsys, "actor_rollout_ref.actor.use_kl_loss=False", "--json")
    assert not [w for w in json.loads(out)["warnings"] if "log_prob_micro_batch_size_per_gpu" in w]
    rc, out, _ = _run(capsys, "actor_rollout_ref.actor.use_kl_loss=False",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "--json")
    assert [w for w in json.loads(out)["warnings"] if "ref.log_prob_micro_batch_size_per_gpu is set" in w]


def test_a_cpu_run_is_placed_in_processes_and_threads(capsys, monkeypatch):
    """Issue 59: on a CPU the plan said "1 node x 1 GPUs"."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    rc, out, _ = _run(capsys, "trainer.device=cpu")
    assert "Batch flow per training step (1 process on CPU, 3 threads; 1 data-parallel)" in out
    assert "GPU" not in out.split("Problems:")[0].replace("gpu_", ""), out
    rc, out, _ = _run(capsys, "trainer.device=cpu", "trainer.n_gpus_per_node=2")
    assert "Batch flow per training step (2 processes on CPU, 3 threads each; 2 data-parallel)" in out
    rc, out, _ = _run(capsys, "trainer.device=cuda")  # planned for a GPU, in a GPU's terms
    assert "Batch flow per training step (1 node x 1 GPUs = 1 ranks; 1 data-parallel)" in out
