"""`mixed_precision.param_dtype=auto`: the faster precision, measured once per machine and model, then cached."""

import json

import pytest
import torch

from posttrain.models.compute_dtype import choose_param_dtype, resolve_param_dtype, time_train_step


@pytest.fixture()
def model():
    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer

    return tiny_llama(build_tiny_tokenizer())


def fake_timer(seconds):
    calls = []

    def timer(module, device, dtype):
        calls.append(dtype)
        return seconds[dtype]

    timer.calls = calls
    return timer


@pytest.mark.parametrize("bf16_s, fp32_s, want", [(0.1, 0.3, "bf16"), (0.5, 0.2, "fp32")])
def test_auto_keeps_the_faster_precision_and_caches_it(model, tmp_path, bf16_s, fp32_s, want):
    timer = fake_timer({"bf16": bf16_s, "fp32": fp32_s})
    choice, why = choose_param_dtype(model, torch.device("cpu"), cache_dir=tmp_path, timer=timer)
    assert choice == want and sorted(timer.calls) == ["bf16", "fp32"]
    assert f"{bf16_s:.3f} s in bf16" in why and f"{fp32_s:.3f} s in fp32" in why
    assert list(json.loads((tmp_path / "precision.json").read_text()).values()) == [want]
    again = fake_timer({"bf16": fp32_s, "fp32": bf16_s})  # would now pick the other one
    assert choose_param_dtype(model, torch.device("cpu"), cache_dir=tmp_path, timer=again)[0] == want
    assert again.calls == []  # answered from the cache, nothing timed


def test_another_model_shape_is_measured_again(model, tmp_path):
    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer

    choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=fake_timer({"bf16": 1.0, "fp32": 2.0}))
    wider = tiny_llama(build_tiny_tokenizer(), hidden_size=96)
    timer = fake_timer({"bf16": 2.0, "fp32": 1.0})
    assert choose_param_dtype(wider, "cpu", cache_dir=tmp_path, timer=timer)[0] == "fp32" and timer.calls


def test_explicit_precisions_are_kept_without_measuring(model):
    for dtype in ("bf16", "fp32"):
        assert resolve_param_dtype(dtype, model, torch.device("cpu"), log=pytest.fail) == dtype


def test_the_real_timer_leaves_weights_and_gradients_untouched(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    for dtype in ("fp32", "bf16"):
        assert 0 < time_train_step(model, torch.device("cpu"), dtype, repeats=1) < 30
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_actor_and_reference_follow_one_auto_choice(tmp_path, monkeypatch):
    """The actor measures; the reference (and critic) compute in the actor's choice, not their own."""
    from helpers.tiny_run import tiny_trainer

    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    trainer = tiny_trainer(tmp_path, ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
                                      "actor_rollout_ref.actor.use_kl_loss=True",
                                      "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=auto",
                                      "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=auto",
                                      "critic.model.fsdp_config.mixed_precision.param_dtype=auto"])
    w = trainer.workers
    assert w.actor.param_dtype in ("bf16", "fp32")
    assert w.ref.param_dtype == w.critic.param_dtype == w.actor.param_dtype
    cached = json.loads((tmp_path / "cache" / "precision.json").read_text())
    assert list(cached.values()) == [w.actor.param_dtype]  # measured once, for the actor


def test_a_measurement_on_a_busy_machine_is_used_but_not_cached(model, tmp_path):
    """While timing, a process that gets little CPU (here: a timer that waits in sleep, as a thread
    descheduled by other jobs would) has measured the other jobs too: its answer is not cached, so
    the next run measures again. A timer that keeps its threads busy is cached (the control)."""
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def sleeping(module, device, dtype):
            time.sleep(0.15)
            return {"bf16": 1.0, "fp32": 2.0}[dtype]

        choice, why = choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=sleeping)
        assert choice == "bf16" and "not cached" in why and "busy" in why
        assert not (tmp_path / "precision.json").exists()

        def spinning(module, device, dtype):
            end = time.perf_counter() + 0.15
            while time.perf_counter() < end:
                pass
            return {"bf16": 1.0, "fp32": 2.0}[dtype]

        choice, why = choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=spinning)
        assert choice == "bf16" and "cached in" in why
        assert list(json.loads((tmp_path / "precision.json").read_text()).values()) == ["bf16"]
    finally:
        torch.set_num_threads(threads)
