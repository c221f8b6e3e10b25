"""State paged to a file between uses (``param_offload`` / ``optimizer_offload`` on a CPU run)."""

from __future__ import annotations

import copy
import dataclasses
import errno
import math
import os
import tempfile

import pytest
import torch

from posttrain.config.roles import RoleSpec, RoleSpecs
from posttrain.errors import ConfigError
from posttrain.host.paging import (IN_MEMORY_FILESYSTEMS, PagedTensors, _filesystem_type, offload_directory, one_pass,
                                   page_module, paged_weights, paging_directory)
from posttrain.optim.paged import PagedAdamW
from posttrain.distributed.placement import HostLevers, InProcess
from posttrain.host.resident import current_resident_bytes
from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs
from helpers.tokenizer import build_tiny_tokenizer


@pytest.fixture
def paging_dir(tmp_path, monkeypatch):
    """The temporary directory (where paged state goes) set to ``tmp_path``, which must be on a disk."""
    if _filesystem_type(str(tmp_path)) in IN_MEMORY_FILESYSTEMS:
        pytest.skip("the test folder is in memory (tmpfs): paging is refused there")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_paged_tensors_keep_their_values_and_leave_memory(tmp_path):
    like = [torch.empty(4096, 1024), torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(0)]  # 16 MB, odd, empty
    paged = PagedTensors(like, str(tmp_path))
    values = [torch.randn(t.shape).to(t.dtype) for t in like]
    before = current_resident_bytes()
    assert all(t.shape == l.shape and t.dtype == l.dtype and not t.any() for t, l in zip(paged.tensors, like))
    for t, v in zip(paged.tensors, values):
        t.copy_(v)
    touched = current_resident_bytes() - before
    paged.page_out()
    released = current_resident_bytes()
    assert touched > 14e6 and before + touched - released > 14e6  # the 16 MB came in, then left the process
    assert all(torch.equal(t, v) for t, v in zip(paged.tensors, values))  # and read back unchanged
    paged.tensors[1].add_(1)
    paged.page_out(1)  # one tensor's pages; its neighbours untouched
    assert torch.equal(paged.tensors[1], values[1] + 1) and torch.equal(paged.tensors[0], values[0])
    assert paged.holds(0, paged.tensors[0]) and not paged.holds(0, paged.tensors[0].clone())


def test_paged_module_computes_as_before(tmp_path):
    tok = build_tiny_tokenizer()
    model = tiny_llama(tok, tie_word_embeddings=True).eval()
    ids = torch.randint(0, len(tok), (2, 9))
    want = model(ids).logits
    paged = page_module(model, str(tmp_path))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    ptrs = {p.data_ptr() for t in paged.tensors for p in [t]}
    assert {p.data_ptr() for p in model.parameters()} <= ptrs  # every weight lives in the file now
    assert torch.equal(model(ids).logits, want)
    paged.page_out()
    assert torch.equal(model(ids).logits, want)


def test_in_memory_directory_refused():
    if _filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.ref\.fsdp_config\.param_offload.*tmpfs.*TMPDIR"):
        paging_directory("actor_rollout_ref.ref.fsdp_config.param_offload", "/dev/shm")


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s)) for s in [(300, 70), (70,), (5, 3, 2), (1,)]]


def _train(opt, params, steps, seed=1, skip=None):
    g = torch.Generator().manual_seed(seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # lr changes between steps
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (skip == i and step == 1) else torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()


@pytest.mark.parametrize("fused", [True, False])
def test_paged_adamw_equals_torch_adamw(tmp_path, fused):
    kw = dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1, fused=fused)
    want, got = _params(), _params()
    _train(torch.optim.AdamW(want, **kw), want, 4, skip=2)
    opt = PagedAdamW(got, directory=str(tmp_path), **kw)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    _train(opt, got, 4, skip=2)
    assert calls == ["pre", "post"] * 4  # once per step, not once per parameter
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    for i, p in enumerate(got):  # the moments live in the files
        assert opt._files["exp_avg"].holds(i, opt.state[p]["exp_avg"])
        assert opt._files["exp_avg_sq"].holds(i, opt.state[p]["exp_avg_sq"])
    control = _params()  # negative control: another weight decay moves the weights elsewhere
    _train(torch.optim.AdamW(control, **{**kw, "weight_decay": 0.0}), control, 4, skip=2)
    assert not torch.equal(control[0], got[0])


def test_paged_adamw_state_dict_interchangeable_with_torch(tmp_path):
    kw = dict(lr=0.01, weight_decay=0.1, fused=True)
    plain, paged = _params(), _params()
    a, b = torch.optim.AdamW(plain, **kw), PagedAdamW(paged, directory=str(tmp_path), **kw)
    _train(a, plain, 2)
    _train(b, paged, 2)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in paged]
    c = PagedAdamW(resumed, directory=str(tmp_path), **kw)
    c.load_state_dict(copy.deepcopy(a.state_dict()))  # a torch AdamW checkpoint into a paged one
    assert all(c._files["exp_avg"].holds(i, c.state[p]["exp_avg"]) for i, p in enumerate(resumed))
    torch.optim.AdamW(plain, **kw).load_state_dict(b.state_dict())  # and the other way round
    _train(a, plain, 2, seed=5)
    _train(c, resumed, 2, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(plain, resumed))


def test_offload_keys_page_the_reference_and_the_moments_on_cpu(paging_dir):
    from posttrain.workers import ActorWorker, RefWorker

    tok = build_tiny_tokenizer()
    prompts = tiny_prompt_batch(tok, ["1+1=", "hello 2*3=", "7-2=", "x"])
    plain_cfg = tiny_worker_configs()
    cfg = tiny_worker_configs(actor={"fsdp_config": dataclasses.replace(plain_cfg.actor.fsdp_config,
                                                                        optimizer_offload=True)})
    cfg.ref.fsdp_config.param_offload = True
    # the control: the reference kept in memory (auto would page it too; param_offload pages it whatever it says)
    place = InProcess("cpu", HostLevers({"actor_rollout_ref.ref": "off"}))  # the one-process placement decides
    actors = [ActorWorker(c.model, c.actor, c.rollout, device="cpu", module=tiny_llama(tok), tokenizer=tok, seed=3,
                          placement=place) for c in (plain_cfg, cfg)]
    assert type(actors[0].optimizer) is torch.optim.AdamW and isinstance(actors[1].optimizer, PagedAdamW)
    refs = [RefWorker(place.shard(tiny_llama(tok), c.ref.fsdp_config, "fp32", forward_only=True,
                                  fsdp_section="actor_rollout_ref.ref"), c.ref, c.rollout, device="cpu")
            for c in (plain_cfg, cfg)]
    assert paged_weights(refs[0].module) is None and paged_weights(refs[1].module) is not None
    batch = actors[0].generate_sequences(prompts)  # one batch for both (sampling draws from shared streams)
    batch.meta_info["temperature"] = 1.0
    torch.manual_seed(7)
    batch["advantages"] = torch.randn(len(batch), 1).expand_as(batch["response_mask"]) * batch["response_mask"]
    for actor in actors:
        for _ in range(3):
            batch["old_log_probs"], _ = actor.compute_log_prob(batch)
            with place.resident(actor, with_optimizer=True, phase="update_actor"):  # memory first when paged
                actor.update_policy(batch)
    moved = [(a - b).abs().max() for a, b in zip(tiny_llama(tok).parameters(), actors[1].module.parameters())]
    assert min(moved) > 0  # the steps changed every weight
    assert all(torch.equal(a, b) for a, b in zip(actors[0].module.parameters(), actors[1].module.parameters()))
    with place.resident(refs[1], phase="ref"):  # paged out after the pass
        paged_pass = refs[1].compute_ref_log_prob(batch)
    assert torch.equal(refs[0].compute_ref_log_prob(batch), paged_pass)


def _specs(cfg):
    """The actor and the reference of `tiny_worker_configs`, as the RL tree's roles hold them."""
    return RoleSpecs(RoleSpec(cfg.model, cfg.actor.fsdp_config, cfg.actor, cfg.rollout),
                     ref=RoleSpec(cfg.model, cfg.ref.fsdp_config, cfg.ref, cfg.rollout))


def test_full_disk_is_one_error_naming_the_folder(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=rf"cannot reserve 0\.01 GB in {tmp_path} to page AdamW's exp_avg.*TMPDIR"):
        PagedTensors([torch.empty(2_500_000)], str(tmp_path), what="AdamW's exp_avg")


def test_offload_keys_change_nothing_off_a_one_process_cpu_run():
    cfg = tiny_worker_configs()
    cfg.ref.fsdp_config.param_offload = True
    module = torch.nn.Linear(2, 2)
    assert offload_directory(cfg.ref.fsdp_config, "param_offload", "x", module, torch.device("cuda")) is None
    module.posttrain_fsdp = object()  # sharded on ranks: posttrain.distributed.fsdp's business
    assert offload_directory(cfg.ref.fsdp_config, "param_offload", "x", module, torch.device("cpu")) is None
    cfg.ref.fsdp_config.param_offload = False
    assert offload_directory(cfg.ref.fsdp_config, "param_offload", "x", torch.nn.Linear(2, 2), "cpu") is None


PAGED = ["actor_rollout_ref.ref.fsdp_config.param_offload=True",
         "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"]
RUN = ["actor_rollout_ref.actor.use_kl_loss=True", "trainer.save_freq=2", "trainer.resume_mode=auto"]


def test_paged_run_equals_the_plain_run_and_resumes_exactly(paging_dir):
    """A tiny GRPO run with the reference and AdamW's moments paged: the same metrics as without
    paging, and stopped after step 2 then resumed (checkpoint of the paged optimizer), the same steps 3-4."""
    from helpers.tiny_run import one_thread, tiny_overrides
    from posttrain.config import load_config
    from posttrain.trainer.trainer import RLTrainer

    def fit(folder, extra, steps):
        overrides = tiny_overrides(paging_dir / folder, RUN + extra + [f"trainer.total_training_steps={steps}"])
        trainer = RLTrainer(load_config(overrides=overrides))
        return trainer, trainer.fit()

    with one_thread():
        _, plain = fit("plain", [], 4)
        trainer, paged = fit("paged", PAGED, 4)
        assert isinstance(trainer.workers.actor.optimizer, PagedAdamW) and paged_weights(trainer.workers.ref.module) is not None
        fit("split", PAGED, 2)
        _, resumed = fit("split", PAGED, 4)
    assert [r["step"] for r in resumed] == [3, 4] and paged[2]["actor/kl_loss"] > 0
    for a, b in [*zip(plain, paged), *zip(paged[2:], resumed)]:
        keys = [k for k in a if k.startswith(("actor/", "response_length/"))]
        assert len(keys) > 10
        bad = {k: (a[k], b[k]) for k in keys if not math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-7)}
        assert bad == {}, f"step {a['step']}: {bad}"


def test_the_one_process_group_pages_out_after_each_call_and_updates_memory_first(paging_dir, monkeypatch):
    """The placement, not the roles, decides residency: through the one-process group, the paged
    reference is paged out after its pass and the actor's rollout and update run memory-first."""
    import contextlib

    from helpers.tiny_run import one_thread, tiny_overrides
    from posttrain.config import load_config
    from posttrain.distributed import placement
    from posttrain.trainer.trainer import RLTrainer

    entered, whole_page_outs = [], []
    real_memory_first, real_page_out = placement.memory_first, PagedTensors.page_out

    @contextlib.contextmanager
    def memory_first():
        entered.append(1)
        with real_memory_first():
            yield

    def page_out(self, index=None):
        if index is None:  # a whole file: the reference's weights (AdamW's moments go one parameter at a time)
            whole_page_outs.append(1)
        real_page_out(self, index)

    monkeypatch.setattr(placement, "memory_first", memory_first)
    monkeypatch.setattr(PagedTensors, "page_out", page_out)
    overrides = tiny_overrides(paging_dir / "run", RUN + PAGED + ["trainer.total_training_steps=1",
                                                                  "trainer.val_before_train=False"])
    with one_thread():
        trainer = RLTrainer(load_config(overrides=overrides))
        assert whole_page_outs == [1]  # paged once as it was placed
        trainer.fit()
    assert len(entered) >= 2  # the rollout and the update
    assert len(whole_page_outs) >= 2  # and again after the reference's pass


def _two_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(1024, 512, generator=g)), torch.nn.Parameter(torch.randn(64, generator=g))]


def _steps(opt, params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()


def test_paged_8bit_moments_equal_the_in_memory_ones_and_leave_memory(tmp_path):
    """host_paging's claim for a trained role: the same updates, bit for bit, as 8-bit moments in memory, and
    after a step the codes (2 bytes a parameter) are out of the process (the control: in memory, they stay)."""
    from posttrain.optim.adamw8bit import AdamW8bit

    plain_params, paged_params = _two_params(), _two_params()
    plain = AdamW8bit(plain_params, lr=1e-2)
    paged = AdamW8bit(paged_params, lr=1e-2, directory=str(tmp_path))
    _steps(plain, plain_params, 3)
    _steps(paged, paged_params, 3)
    assert all(torch.equal(a, b) for a, b in zip(plain_params, paged_params))
    codes = 2 * plain_params[0].numel()  # int8 m and uint8 v; the scales are 1/64 of that
    for opt, params, held in ((plain, plain_params, True), (paged, paged_params, False)):
        before = current_resident_bytes()
        for t in opt.state[params[0]].values():
            t.mul_(1)  # touch every state page: in memory already, or mapped back in from the page cache
        touched = current_resident_bytes() - before
        assert (touched < 0.2 * codes) == held, (touched, codes)
    paged.page_out()  # as after a checkpoint read them all


def test_paged_8bit_state_dict_resumes_exactly(tmp_path):
    """A paged optimizer's state dict loads into a paged optimizer (codes copied into its file) and into an
    in-memory one; both continue exactly as the uninterrupted run."""
    from posttrain.optim.adamw8bit import AdamW8bit

    straight = _two_params()
    opt = AdamW8bit(straight, lr=1e-2, directory=str(tmp_path))
    _steps(opt, straight, 2)
    state = copy.deepcopy(opt.state_dict())
    _steps(opt, straight, 2, seed=5)
    for directory in (str(tmp_path), None):
        resumed = _two_params()
        with torch.no_grad():
            for a, b in zip(resumed, _two_params()):
                a.copy_(b)
        first = AdamW8bit(resumed, lr=1e-2, directory=str(tmp_path))
        _steps(first, resumed, 2)  # the same two steps, then a restart from their state dict
        again = AdamW8bit(resumed, lr=1e-2, directory=directory)
        again.load_state_dict(copy.deepcopy(state))
        if directory is not None:
            held = again.state[resumed[0]]
            assert again._paged.file.holds(0, held["exp_avg_q"])  # moved into the file, not left a copy
        _steps(again, resumed, 2, seed=5)
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_host_paging_auto_pages_the_reference_and_the_8bit_moments(paging_dir):
    """The default (host_paging=auto, TMPDIR on a disk) on a one-process CPU run: the frozen reference's
    weights are paged, and a trained role's 8-bit moments; off keeps both in memory."""
    from posttrain.optim.adamw8bit import AdamW8bit
    from posttrain.host.memory_plan import MIN_PARAMS_8BIT

    cfg = tiny_worker_configs()
    for mode, paged in (("auto", True), ("off", False)):
        cfg.ref.fsdp_config.host_paging = cfg.actor.fsdp_config.host_paging = mode
        specs = _specs(cfg)
        place = InProcess("cpu", HostLevers.of(specs))  # the levers read from the roles' config
        ref = place.shard(tiny_llama(build_tiny_tokenizer()), cfg.ref.fsdp_config, "fp32", forward_only=True,
                          fsdp_section="actor_rollout_ref.ref")
        assert (paged_weights(ref) is not None) == paged
        module = torch.nn.Linear(4000, MIN_PARAMS_8BIT // 4000, bias=False)
        opt = place.optimizer(module, cfg.actor.optim, cfg.actor.fsdp_config, "actor_rollout_ref.actor")
        assert isinstance(opt, AdamW8bit) and (opt._paged is not None) == paged


def test_host_paging_on_with_an_in_memory_temporary_directory_names_the_key(monkeypatch):
    from posttrain.host.memory_plan import MemoryPlan

    monkeypatch.setattr("posttrain.host.paging._filesystem_type", lambda path: "tmpfs")
    plan = MemoryPlan(torch.device("cpu"))
    assert plan.idle_state_directory("auto", "actor_rollout_ref.ref.fsdp_config.host_paging") is None
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.ref.fsdp_config.host_paging=True .* tmpfs"):
        plan.idle_state_directory("on", "actor_rollout_ref.ref.fsdp_config.host_paging")


class _Stack(torch.nn.Module):
    """Six 1024 x 1024 float32 layers (4 MiB each) in a ModuleList, like a decoder's layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("per_layer", [True, False])
def test_a_paged_pass_holds_one_layer_at_a_time(tmp_path, per_layer):
    """page_out_after_each_layer: when the last layer starts, the five before it are out of memory again
    (the control, paged after the whole pass only, holds all five); the outputs are the same."""
    from posttrain.host.paging import page_out_after_each_layer

    plain, paged = _Stack(), _Stack()
    page_module(paged, str(tmp_path), "a test stack")
    if per_layer:
        page_out_after_each_layer(paged, paged.layers)
    held = {}
    start = current_resident_bytes()

    def measure(*_):  # returns None: the layer's input stays as it is
        held["bytes"] = current_resident_bytes() - start

    paged.layers[-1].register_forward_pre_hook(measure)
    x = torch.randn(4, 1024)
    with torch.no_grad(), one_pass(paged_weights(paged)):
        out = paged(x)
    assert torch.equal(out, plain(x))
    layer = 1024 * 1024 * 4
    assert (held["bytes"] < 2.5 * layer) == per_layer, held["bytes"] / layer


def test_host_paging_auto_keeps_state_in_memory_when_the_disk_is_full(paging_dir, monkeypatch, capsys):
    """auto never stops a run: a file that cannot be reserved leaves the reference and the moments in memory,
    said in the plan line; `on` (the user asked) is the full-disk error (the control)."""
    from posttrain.optim.adamw8bit import AdamW8bit
    from posttrain.host.memory_plan import MIN_PARAMS_8BIT

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    cfg = tiny_worker_configs()
    place = InProcess("cpu")
    ref = place.shard(tiny_llama(build_tiny_tokenizer()), cfg.ref.fsdp_config, "fp32", forward_only=True,
                      fsdp_section="actor_rollout_ref.ref")
    assert paged_weights(ref) is None
    module = torch.nn.Linear(4000, MIN_PARAMS_8BIT // 4000, bias=False)
    opt = place.optimizer(module, cfg.actor.optim, cfg.actor.fsdp_config, "actor_rollout_ref.actor")
    assert isinstance(opt, AdamW8bit) and opt._paged is None
    line = place.plan.line()
    assert "actor_rollout_ref.ref: kept in memory, not paged (host_paging=auto: cannot reserve" in line
    assert "actor_rollout_ref.actor: kept in memory, not paged" in line and "between steps" not in line
    asked = InProcess("cpu", HostLevers({"actor_rollout_ref.ref": "on"}))
    with pytest.raises(OSError, match="cannot reserve"):
        asked.shard(tiny_llama(build_tiny_tokenizer()), cfg.ref.fsdp_config, "fp32", forward_only=True,
                    fsdp_section="actor_rollout_ref.ref")


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_host_paging_reaches_the_placement_from_the_config_where_the_roles_are_built(paging_dir, mode):
    """The key's whole path in a one-process run: the roles' config -> `build_local_group` -> the placement's
    levers -> the reference's weights in a file (auto) or in memory (off, the control); the workers never see it."""
    from posttrain.trainer.setup import build_local_group

    tok = build_tiny_tokenizer()
    cfg = tiny_worker_configs()
    cfg.ref.fsdp_config.host_paging = mode
    group = build_local_group(_specs(cfg), torch.device("cpu"), 0,
                              actor_module=tiny_llama(tok), tokenizer=tok)
    assert group.placement.levers.host_paging("actor_rollout_ref.ref") == mode
    assert (paged_weights(group.ref.module) is not None) == (mode == "auto")


def test_the_placement_reads_its_own_levers_not_the_section_a_worker_hands_it(paging_dir):
    """A worker hands the placement its module and fsdp_config; ``host_paging`` in that section is not read there
    (it reached the placement when it was made): levers off with the handed section saying on keeps the weights in
    memory, and the reverse pages them."""
    cfg = tiny_worker_configs()
    for levers, handed, paged in (("off", "on", False), ("on", "off", True)):
        place = InProcess("cpu", HostLevers({"actor_rollout_ref.ref": levers}))
        fsdp = dataclasses.replace(cfg.ref.fsdp_config, host_paging=handed)
        ref = place.shard(tiny_llama(build_tiny_tokenizer()), fsdp, "fp32", forward_only=True,
                          fsdp_section="actor_rollout_ref.ref")
        assert (paged_weights(ref) is not None) == paged
