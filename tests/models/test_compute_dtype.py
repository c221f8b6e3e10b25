"""`mixed_precision.param_dtype=auto`: the faster precision, measured once per machine and model, then cached."""

import json

import pytest
import torch

from posttrain.models import compute_dtype
from posttrain.models.compute_dtype import choose_param_dtype, cpu_bf16_support, resolve_param_dtype, time_train_step

CAPABLE = (True, "this CPU has avx512_bf16 (injected)")
"""Tests inject the CPU's capabilities and the timings: the answers must not depend on this machine."""


@pytest.fixture()
def model():
    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer

    return tiny_llama(build_tiny_tokenizer())


def fake_timer(seconds):
    calls = []

    def timer(module, device, dtype, give_up_after=float("inf"), deadline=None):
        calls.append(dtype)
        return seconds[dtype]

    timer.calls = calls
    return timer


@pytest.mark.parametrize("bf16_s, fp32_s, want", [(0.1, 0.3, "bf16"), (0.5, 0.2, "fp32")])
def test_auto_keeps_the_faster_precision_and_caches_it(model, tmp_path, bf16_s, fp32_s, want):
    timer = fake_timer({"bf16": bf16_s, "fp32": fp32_s})
    choice, why = choose_param_dtype(model, torch.device("cpu"), cache_dir=tmp_path, timer=timer, support=CAPABLE)
    assert choice == want and sorted(timer.calls) == ["bf16", "fp32"]
    assert f"{bf16_s:.3f} s in bf16" in why and f"{fp32_s:.3f} s in fp32" in why
    assert [e["choice"] for e in json.loads((tmp_path / "precision.json").read_text()).values()] == [want]
    again = fake_timer({"bf16": fp32_s, "fp32": bf16_s})  # would now pick the other one
    assert choose_param_dtype(model, torch.device("cpu"), cache_dir=tmp_path, timer=again, support=CAPABLE)[0] == want
    assert again.calls == []  # answered from the cache, nothing timed


def test_another_model_shape_is_measured_again(model, tmp_path):
    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer

    choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=fake_timer({"bf16": 1.0, "fp32": 2.0}), support=CAPABLE)
    wider = tiny_llama(build_tiny_tokenizer(), hidden_size=96)
    timer = fake_timer({"bf16": 2.0, "fp32": 1.0})
    assert choose_param_dtype(wider, "cpu", cache_dir=tmp_path, timer=timer, support=CAPABLE)[0] == "fp32" and timer.calls


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
    monkeypatch.setattr(compute_dtype, "cpu_bf16_support", lambda: CAPABLE)
    monkeypatch.setattr(compute_dtype, "time_train_step", fake_timer({"bf16": 1.0, "fp32": 2.0}))
    trainer = tiny_trainer(tmp_path, ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
                                      "actor_rollout_ref.actor.use_kl_loss=True",
                                      "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=auto",
                                      "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=auto",
                                      "critic.model.fsdp_config.mixed_precision.param_dtype=auto"])
    w = trainer.workers
    assert w.actor.param_dtype == "bf16"
    assert w.ref.param_dtype == w.critic.param_dtype == w.actor.param_dtype
    cached = json.loads((tmp_path / "cache" / "precision.json").read_text())
    assert [e["choice"] for e in cached.values()] == ["bf16"]  # measured once, for the actor
    assert compute_dtype.time_train_step.calls == ["fp32", "bf16"]


@pytest.mark.parametrize("share, busy", [(0.2, True), (0.9, False)])
def test_a_measurement_on_a_busy_machine_is_cached_and_says_so(model, tmp_path, monkeypatch, share, busy):
    """A process that got little CPU while timing (other jobs held the cores) has measured them too:
    the answer is cached all the same (a busy machine must not re-time at every start) but marked
    busy, and the message says how to measure again. The share is injected: the machine's real load
    must not decide this test; 0.9 is the control."""
    monkeypatch.setattr(compute_dtype, "_core_share", lambda wall_s, cpu_s: share)
    choice, why = choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=fake_timer({"bf16": 1.0, "fp32": 2.0}),
                                     support=CAPABLE)
    assert choice == "bf16" and ("a busy machine" in why) is busy and ("delete it" in why) is busy
    entry, = json.loads((tmp_path / "precision.json").read_text()).values()
    assert entry["busy"] is busy and entry["seconds"] == {"bf16": 1.0, "fp32": 2.0}
    again = fake_timer({"bf16": 2.0, "fp32": 1.0})
    assert choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=again, support=CAPABLE)[0] == "bf16"
    assert again.calls == []  # not re-timed


def test_core_share_is_cpu_seconds_per_wall_second_per_thread(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert compute_dtype._core_share(1.0, 1.5) == pytest.approx(0.75)
    assert compute_dtype._core_share(0.1, 0.2) is None  # too short to judge


X86_NO_BF16 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 avx512f\n"
X86_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("cpuinfo, capable, names", [(X86_NO_BF16, False, "no bf16 instructions"),
                                                     (X86_AMX, True, "amx_bf16 and avx512_bf16"),
                                                     (ARM_BF16, True, "this CPU has bf16"),
                                                     ("", True, "unknown")])
def test_cpu_capabilities_are_read_from_the_flags(cpuinfo, capable, names):
    got, why = cpu_bf16_support(cpuinfo)
    assert got is capable and names in why


def test_a_cpu_without_bf16_gets_fp32_at_once_with_nothing_timed(model, tmp_path):
    timer = fake_timer({"bf16": 0.1, "fp32": 9.0})  # would say bf16: it must not be asked
    choice, why = choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=timer,
                                     support=cpu_bf16_support(X86_NO_BF16))
    assert choice == "fp32" and timer.calls == [] and "emulated" in why
    assert not (tmp_path / "precision.json").exists()


def test_bf16_timing_stops_once_clearly_slower(model):
    """The real timer: a timed pass slower than ``give_up_after``, or a deadline already passed, ends
    the timing after the warm-up and one timed pass (never on the warm-up alone, whose one-time costs
    would bias the comparison); without a bound every pass runs (the control)."""
    import time

    passes = []
    real = compute_dtype._forward

    def counting(module, ids):
        passes.append(1)
        return real(module, ids)

    compute_dtype._forward, before = counting, compute_dtype._forward
    try:
        time_train_step(model, torch.device("cpu"), "fp32", repeats=3, give_up_after=0.0)
        assert len(passes) == 2
        passes.clear()
        seconds = time_train_step(model, torch.device("cpu"), "fp32", repeats=3, deadline=time.perf_counter())
        assert len(passes) == 2 and 0 < seconds < 30
        passes.clear()
        time_train_step(model, torch.device("cpu"), "fp32", repeats=3)
        assert len(passes) == 4
    finally:
        compute_dtype._forward = before


def test_the_measurement_is_bounded_and_ordered(model, tmp_path, monkeypatch):
    """fp32 first with half the budget as its deadline, then bf16 bounded by 1.3x fp32's time."""
    seen = []

    def timer(module, device, dtype, give_up_after=float("inf"), deadline=None):
        seen.append((dtype, give_up_after, deadline is not None))
        return {"bf16": 3.0, "fp32": 1.0}[dtype]

    choice, why = choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=timer, support=CAPABLE)
    assert choice == "fp32"
    assert seen == [("fp32", float("inf"), True), ("bf16", pytest.approx(compute_dtype.CLEARLY_SLOWER), True)]


def test_the_first_cache_form_is_still_read(model, tmp_path):
    """Caches written before the measurements were kept hold the bare answer."""
    key = compute_dtype._machine_key(model)
    (tmp_path / "precision.json").write_text(json.dumps({key: "fp32"}))
    timer = fake_timer({"bf16": 0.1, "fp32": 1.0})
    assert choose_param_dtype(model, "cpu", cache_dir=tmp_path, timer=timer, support=CAPABLE)[0] == "fp32"
    assert timer.calls == []

