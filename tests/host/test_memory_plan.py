"""The memory plan's choices (`posttrain.host.memory_plan`), the optimizer key, and the process-tree peak."""

import copy
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from posttrain.optim import native
from posttrain.optim.adamw8bit import AdamW8bit, state_bytes
from posttrain.host.memory_plan import MIN_PARAMS_8BIT, MemoryPlan, machine_ram
from posttrain.distributed.placement import InProcess
from posttrain.host.process_tree import TreePeak, descendants, tree_resident_bytes
from posttrain.optim.build import build_optimizer, optimizer_kind


def _optim(name="auto"):
    return SimpleNamespace(lr=1e-3, betas=[0.9, 0.999], weight_decay=0.01, optimizer=name)


def _fsdp(offload=False):
    return SimpleNamespace(optimizer_offload=offload)


@pytest.mark.parametrize("name,kind", [("AdamW", "adamw"), ("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw"),
                                       ("posttrain_adamw_8bit", "adamw_8bit"), ("AdamW8bit", "adamw_8bit"), ("adamw_8bit", "external"), ("adamw_torch_8bit", "external"), ("auto", "auto")])
def test_optimizer_names_in_verls_and_trls_spelling(name, kind):
    assert optimizer_kind(_optim(name)) == kind


def test_an_unknown_optimizer_name_says_what_is_valid():
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.optim.optimizer='lion'.*adamw_8bit"):
        optimizer_kind(_optim("lion"), "actor_rollout_ref.actor.optim.optimizer")


def test_auto_is_8bit_on_a_cpu_for_a_real_model_only():
    cpu, gpu = MemoryPlan(torch.device("cpu")), MemoryPlan(torch.device("cuda"))
    big = 135_000_000
    assert cpu.optimizer("auto", paged=False, trained_params=big) == "adamw_8bit"
    # negative controls: a GPU run, moments already paged, a tiny model, an explicit choice
    assert gpu.optimizer("auto", paged=False, trained_params=big) == "adamw"
    assert cpu.optimizer("auto", paged=True, trained_params=big) == "adamw"
    assert cpu.optimizer("auto", paged=False, trained_params=MIN_PARAMS_8BIT - 1) == "adamw"
    assert cpu.optimizer("adamw", paged=False, trained_params=big) == "adamw"


def test_placement_builds_8bit_state_a_quarter_the_size(tmp_path):
    """The lever's memory claim on a module of MIN_PARAMS_8BIT parameters: the 8-bit moments hold ~2 bytes a
    parameter against AdamW's 8 (the negative control: the same module with optimizer=AdamW)."""
    place = InProcess("cpu")
    sizes = {}
    for name in ("auto", "AdamW"):
        module = torch.nn.Linear(4000, MIN_PARAMS_8BIT // 4000, bias=False)
        opt = place.optimizer(module, _optim(name), _fsdp(), "actor_rollout_ref.actor")
        module.weight.grad = torch.ones_like(module.weight)
        opt.step()
        sizes[name] = state_bytes(opt)
        assert isinstance(opt, AdamW8bit) == (name == "auto")
    assert sizes["AdamW"] == 8 * MIN_PARAMS_8BIT + 4  # m and v in float32, and the step counter
    assert sizes["auto"] < 0.27 * sizes["AdamW"]
    line = place.plan.line()
    update = "updated in C" if native.load("adamw8bit") else "updated by torch ops: no C kernel"
    assert line.startswith("memory plan: CPU, ") and "actor: AdamW moments 8-bit (posttrain_adamw_8bit, chosen: 0.02 GB " \
        f"instead of 0.08 GB, paged to a file between steps (host_paging), {update})" in line and "actor: AdamW moments fp32 (0.08 GB; asked)" in line


def test_8bit_with_offload_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"actor.optim.optimizer=posttrain_adamw_8bit and .*actor.fsdp_config.optimizer_offload"):
        InProcess("cpu").optimizer(torch.nn.Linear(2, 2), _optim("posttrain_adamw_8bit"), SimpleNamespace(
            optimizer_offload=True, offload_policy=False), "actor_rollout_ref.actor")


def test_build_optimizer_reads_the_key():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(build_optimizer(params, _optim("posttrain_adamw_8bit")), AdamW8bit)
    assert type(build_optimizer(params, _optim("auto"))) is torch.optim.AdamW  # nothing chose: plain AdamW


def test_machine_ram_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  1 kB\nMemAvailable:   12288000 kB\n")
    total, free = machine_ram(str(meminfo))
    assert total == pytest.approx(24576000 / 1024**2) and free == pytest.approx(12288000 / 1024**2)
    assert machine_ram(str(tmp_path / "missing")) == (None, None)


CHILD = "import time; b = bytearray(400 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(30)"


def test_tree_peak_counts_a_child_process():
    """A child holding 400 MiB: the tree's resident set grows by about that; this process's own (the
    negative control) does not."""
    base_tree, base_own = tree_resident_bytes(), TreePeak(interval=0.01)
    base_own.sample()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in descendants(TreePeak().root)
        peak = TreePeak(interval=0.01, rescan=0.01).start()
        time.sleep(0.1)
        grown = peak.stop() - base_tree
        own_now = tree_resident_bytes(child.pid)
    finally:
        child.kill()
        child.wait()
    assert 380 * 2**20 < own_now < 480 * 2**20  # the child alone: its 400 MiB and an interpreter
    assert grown > 380 * 2**20
    from posttrain.host.resident import current_resident_bytes
    assert current_resident_bytes() < base_own.sampled + 100 * 2**20  # this process did not grow by it


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_a_frozen_role_computing_in_bf16_keeps_its_weights_in_bf16():
    """The lever's claim: a frozen bf16-compute role (the reference) holds half an fp32 copy's bytes and scores
    its responses as the fp32 copy under bf16 autocast does (every matmul reads bf16-rounded weights either way);
    rotary buffers stay float32. Negative control: the same role computing in fp32 keeps fp32 weights."""
    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.models import autocast_context
    from posttrain.models.logprobs import response_logprobs

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    original = tiny_llama(tok)
    fsdp = SimpleNamespace(param_offload=False)
    kept = {dtype: InProcess("cpu").shard(copy.deepcopy(original), fsdp, dtype, forward_only=True)
            for dtype in ("bf16", "fp32")}
    assert _param_bytes(kept["bf16"]) * 2 == _param_bytes(kept["fp32"]) == _param_bytes(original)
    assert {p.dtype for p in kept["bf16"].parameters()} == {torch.bfloat16}
    assert {b.dtype for b in kept["bf16"].buffers()} == {b.dtype for b in original.buffers()}
    ids = torch.randint(3, len(tok), (2, 12), generator=torch.Generator().manual_seed(1))
    mask, pos = torch.ones_like(ids), torch.arange(12).expand(2, 12)
    with torch.no_grad(), autocast_context(torch.device("cpu"), "bf16"):
        stored_bf16, _ = response_logprobs(kept["bf16"], ids, mask, pos, ids[:, -4:])
        autocast_fp32, _ = response_logprobs(original, ids, mask, pos, ids[:, -4:])
    torch.testing.assert_close(stored_bf16, autocast_fp32, atol=0.01, rtol=0)  # measured 0.002 on log-probs ~ -4.7


def test_host_memory_auto_is_glibcs_own_policy():
    cpu = MemoryPlan(torch.device("cpu"))
    assert cpu.host_memory("auto") == "balanced"
    assert [cpu.host_memory(m) for m in ("speed", "memory", "balanced")] == ["speed", "memory", "balanced"]


@pytest.mark.parametrize("mode,expected,kept", [("memory", True, True), ("speed", False, True), ("auto", False, False)])
def test_the_actors_rollout_and_update_run_memory_first_when_chosen(mode, expected, kept, tmp_path, monkeypatch,
                                                                    capsys):
    """memory: the rollout and the update run memory-first; speed: freed memory kept for reuse (glibc told so);
    auto (balanced): neither; the update's large buffers from the heap, and the heap's free pages returned
    after the rollout, before each optimizer step and after the update."""
    import contextlib
    import sys

    from helpers.tiny_run import one_thread, tiny_overrides
    from posttrain.config import load_config
    from posttrain.distributed import placement
    from posttrain.trainer.trainer import RLTrainer

    phases, real = [], placement.memory_first

    @contextlib.contextmanager
    def memory_first():
        phases.append(1)
        with real():
            yield

    monkeypatch.setattr(placement, "memory_first", memory_first)
    keeps = []  # not the real call: it would change this test process's allocator for the tests after it
    monkeypatch.setattr(placement, "keep_freed_memory", lambda: keeps.append(1))
    trims = []  # balanced's trims (after the rollout, before each optimizer step, after the update: the caller's
    # phase, "step" from the optimizer's hook), and memory_first's after each of its phases
    def release():  # True, as glibc's answer can be: a hook that passed it on to torch would fail the step
        trims.append(sys._getframe(1).f_locals.get("phase", "step"))
        return True

    monkeypatch.setattr(placement, "release_freed_memory", release)
    heaps = []  # balanced's update: its large buffers from the heap (posttrain.host.allocator.heap_allocations)

    @contextlib.contextmanager
    def heap_allocations():
        heaps.append(1)
        yield

    monkeypatch.setattr(placement, "heap_allocations", heap_allocations)
    overrides = tiny_overrides(tmp_path, ["trainer.total_training_steps=1", "trainer.val_before_train=False",
                                      f"actor_rollout_ref.actor.fsdp_config.host_memory={mode}"])
    with one_thread():
        RLTrainer(load_config(overrides=overrides)).fit()
    assert (len(phases) >= 2) is expected and (len(phases) == 0) is not expected  # the rollout and the update
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory plan:"))
    assert ("returned to the kernel (host_memory=memory, asked" in line) is expected
    assert ("kept for reuse (host_memory=speed, asked" in line) is (mode == "speed")
    assert ("the update's reused from the heap, the heap's free pages returned after each rollout and update "
            "(host_memory=balanced, chosen" in line) is (mode == "auto")
    assert bool(keeps) is kept
    assert len(heaps) == (mode == "auto")  # one step: one update
    if mode == "auto":  # one step: its rollout, its update's optimizer steps, the end of its update
        assert trims[0] == "gen" and trims[-1] == "update_actor" and set(trims[1:-1]) == {"step"}, trims
    else:
        assert len(trims) == {"speed": 0, "memory": len(phases)}[mode]


def test_a_host_memory_value_that_is_not_a_mode_is_refused_naming_the_key():
    from posttrain.config import load_config
    from posttrain.config.sft_load import load_sft_config
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.fsdp_config.host_memory='fast' is not one of: "
                                          r"auto, balanced, speed, memory"):
        load_config(overrides=["actor_rollout_ref.actor.fsdp_config.host_memory=fast"])
    with pytest.raises(ConfigError, match=r"model.fsdp_config.host_memory='fast'; valid: auto, balanced, speed, memory"):
        load_sft_config(overrides=["model.fsdp_config.host_memory=fast"])


def test_a_critic_host_memory_other_than_the_actors_is_refused_naming_both_keys():
    """The freed-memory policy is one for the process (the actor's key sets it): a different critic value would be
    silently unused, so it is refused; the critic at auto or at the actor's value passes (the controls)."""
    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.errors import ConfigError

    gae = ["algorithm.adv_estimator=gae"]
    with pytest.raises(ConfigError, match=r"critic.model.fsdp_config.host_memory=speed: .* set by "
                                          r"actor_rollout_ref.actor.fsdp_config.host_memory \(now auto\)"):
        load_config(str(BUILTIN_CONFIG), overrides=[*gae, "critic.model.fsdp_config.host_memory=speed"])
    for critic, actor in (("auto", "speed"), ("speed", "speed")):
        load_config(str(BUILTIN_CONFIG), overrides=[*gae, f"critic.model.fsdp_config.host_memory={critic}",
                                                    f"actor_rollout_ref.actor.fsdp_config.host_memory={actor}"])


def test_the_placement_chooses_before_it_builds(tmp_path, monkeypatch):
    """`InProcess.choose_optimizer` decides (kind, what was asked, where moments are paged) and builds nothing;
    `InProcess.optimizer` then builds that choice. The control: a tiny module under MIN_PARAMS_8BIT gets AdamW."""
    import tempfile

    from posttrain.host import paging

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if paging._filesystem_type(str(tmp_path)) in paging.IN_MEMORY_FILESYSTEMS:
        pytest.skip("the test folder is in memory (tmpfs): host_paging=auto keeps state in memory there")
    place = InProcess("cpu")
    big = torch.nn.Linear(4000, MIN_PARAMS_8BIT // 4000, bias=False)
    params = list(big.parameters())
    choice = place.choose_optimizer(big, params, _optim(), _fsdp(), "actor_rollout_ref.actor")
    assert (choice.kind, choice.requested, choice.trained_params) == ("adamw_8bit", "auto", MIN_PARAMS_8BIT)
    assert choice.offload_dir is None and choice.idle_dir is not None and big.weight.grad is None
    assert isinstance(place.optimizer(big, _optim(), _fsdp(), "actor_rollout_ref.actor"), AdamW8bit)
    small = torch.nn.Linear(4, 4)
    assert place.choose_optimizer(small, list(small.parameters()), _optim(), _fsdp(), "critic.model").kind == "adamw"
