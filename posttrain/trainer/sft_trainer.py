"""The supervised fine-tuning loop (verl's `fsdp_sft_trainer`), on the RL trainer's workers.

One step reads top to bottom: the next ``data.train_batch_size`` rows (RL layout, `posttrain.data.sft`)
-> ``workers.update_actor(batch, SFT())`` (one optimizer step of token-mean NLL over the batch's
trained tokens, split over the ranks) -> validation loss every ``trainer.test_freq`` -> checkpoint every
``trainer.save_freq``. The workers are the RL actor's (`posttrain.workers.group` in one process,
`posttrain.distributed.RankWorkerGroup` on Ray ranks), so checkpoints are RL checkpoints
(``global_step_N/actor``, the tracker, the data loader's position): an exported SFT model starts an
RL run, and a resumed run continues exactly where the stopped one was, at an epoch boundary too
(the loader's state always names the next batch).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from posttrain.algorithms.objectives import SFT
from posttrain.batch import Batch
from posttrain.checkpoint import CheckpointManager
from posttrain.config.sft import SFTConfig
from posttrain.config.sft_load import rl_config_for, validate_sft_config
from posttrain.data.loader import PromptLoader
from posttrain.errors import ConfigError
from posttrain.trainer import preflight, resume, setup

__all__ = ["SFTTrainer"]


class SFTTrainer:
    """SFT on one process or ``trainer.nnodes x trainer.n_gpus_per_node`` Ray ranks.

    Args:
        config: `posttrain.config.sft_load.load_sft_config(...)`.
        model, tokenizer: use these instead of loading ``model.partial_pretrain`` (tests; one process).
    """

    stage = "sft"

    def __init__(self, config: SFTConfig, *, model: Any = None, tokenizer: Any = None):
        from posttrain.distributed.torchrun import launched_by_torchrun, torchrun_world_size

        validate_sft_config(config)
        self.config = config
        t = config.trainer
        self.torchrun = launched_by_torchrun()  # every process a rank (module docstring of distributed.torchrun)
        world = torchrun_world_size() if self.torchrun else t.nnodes * t.n_gpus_per_node
        if model is not None and world > 1:
            raise ConfigError(f"an in-memory model trains in one process, and this run has trainer.nnodes x "
                              f"trainer.n_gpus_per_node = {world} ranks: save it to a folder and set "
                              "model.partial_pretrain")
        self._preflight(model, tokenizer)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.train_data, self.val_data = self._build_datasets()
        rows = len(self.train_data)
        if rows < config.data.train_batch_size:
            raise ConfigError(f"data.train_batch_size={config.data.train_batch_size} is larger than the {rows} "
                              "training rows; lower it")
        seed = config.data.seed if config.data.seed is not None else t.seed
        self.train_loader = PromptLoader(self.train_data, config.data.train_batch_size, shuffle=config.data.shuffle,
                                         seed=seed, drop_last=True, collate_fn=self.collate)
        self.total_steps = t.total_training_steps or t.total_epochs * len(self.train_loader)
        self.rl = rl_config_for(config, self.total_steps, reference=self._needs_reference())
        self.rl.algorithm.adv_estimator = "grpo"  # no critic
        self.rank = self._join_torchrun(world)
        self.device = setup.resolve_device(self.rl)
        self.checkpoints = CheckpointManager(Path(self.rl.trainer.default_local_dir).expanduser(),
                                             t.max_ckpt_to_keep)
        self._claim_checkpoint_folder()
        try:
            self.workers = self._build_workers(model)
        except BaseException:
            self._unlock()
            raise
        self.global_step = 0
        self.history: list[dict[str, float]] = []
        self.stopped_by: int | None = None
        self._stop_signal: int | None = None
        self._saved_step: int | None = None

    def _join_torchrun(self, world: int) -> int:
        """This process's rank: 0 in one process or as the Ray driver; under torchrun, its rank in the
        process group it joins now (the RL config then names torchrun's world as its ranks)."""
        if not self.torchrun:
            return 0
        from posttrain.distributed.torchrun import join

        rank, _ = join(self.config.trainer.device, self.rl.actor_rollout_ref.nccl_timeout)
        self.rl.trainer.nnodes, self.rl.trainer.n_gpus_per_node = 1, world
        return rank

    def _build_workers(self, model: Any) -> Any:
        """The RL worker group: in this process, on Ray ranks, or this torchrun rank's share."""
        from posttrain.trainer.trainer import seed_everything

        seed = self.config.trainer.seed
        seed_everything(seed)
        if self.torchrun:
            from posttrain.distributed.torchrun import TorchrunGroup

            return TorchrunGroup(self.rl, seed, self.tokenizer, self.config.trainer.device)
        return setup.build_workers(self.rl, self.rl, self.device, seed, model, None, self.tokenizer)

    def _claim_checkpoint_folder(self) -> None:
        """Lock ``trainer.default_local_dir`` and apply its rule (`resume.prepare_folder`): rank 0's job
        under torchrun, whose verdict every rank then shares (one error, on every rank)."""
        problem = None
        if self.rank == 0:
            try:
                preflight.claim_checkpoint_folder(self.rl, self.checkpoints)
            except Exception as err:  # ConfigError, CheckpointError: shared with the other ranks as text
                problem = err
        if self.torchrun:
            message = self._rank0_value(None if problem is None else f"{problem}")
            if problem is None and message is not None:
                raise ConfigError(f"rank 0: {message}")
        if problem is not None:
            raise problem

    @staticmethod
    def _rank0_value(value: Any) -> Any:
        """Rank 0's ``value`` on every torchrun rank (before the worker group exists)."""
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _unlock(self) -> None:
        if self.rank == 0:
            self.checkpoints.unlock()

    def _should_stop(self) -> bool:
        """A signal arrived (on any torchrun rank: the ranks stop after the same step)."""
        stop = self._stop_signal is not None
        if self.torchrun and self.workers.any_rank(stop) and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM
        return self._stop_signal is not None

    def _preflight(self, model: Any, tokenizer: Any) -> None:
        """The model path and the data files, checked before anything loads (one error listing all)."""
        from posttrain.data.schema import SUPPORTED_SUFFIXES

        d, problems = self.config.data, []
        if model is None or tokenizer is None:
            problem = preflight.model_path_problem(self.config.model.partial_pretrain)
            if problem:
                problems.append(f"model.partial_pretrain: {problem}")
        for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
            for file in [] if files is None else files if isinstance(files, (list, tuple)) else [files]:
                path = Path(str(file)).expanduser()
                if not path.is_file():
                    problems.append(f"{key}: {path} {'is a folder' if path.is_dir() else 'does not exist'}")
                elif not str(path).endswith(SUPPORTED_SUFFIXES):
                    problems.append(f"{key}: {path} is not a {'/'.join(SUPPORTED_SUFFIXES)} file")
        problems += preflight.check_run_dir(self.config)  # the same keys as an RL run (trainer.run_dir)
        if problems:
            raise ConfigError("; ".join(problems))

    # ------------------------------------------------------------------ parts (overridden by DPO)
    def _needs_reference(self) -> bool:
        return False

    def _dataset(self, files: Any, max_samples: int) -> Any:
        from posttrain.data.sft import SFTDataset

        return SFTDataset(files, self.tokenizer, self.config.data, max_samples=max_samples)

    def collate(self, examples: list) -> Batch:
        return self.train_data.collate_fn(examples)

    def _load_tokenizer(self) -> Any:
        from posttrain.models import load_tokenizer

        m = self.config.model
        try:
            return load_tokenizer(m.partial_pretrain, trust_remote_code=m.trust_remote_code,
                                  custom_chat_template=self.config.data.chat_template)
        except (OSError, ValueError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"model.partial_pretrain={m.partial_pretrain}: cannot load its tokenizer ({reason})") from err

    def _build_datasets(self) -> tuple[Any, Any]:
        d = self.config.data
        train_files, val_files = d.train_files, d.val_files
        if train_files is None:
            train_files, builtin_val = builtin_sft_files(self.config)
            val_files = builtin_val if val_files is None else val_files
        train = self._dataset(train_files, d.train_max_samples)
        val = self._dataset(val_files, d.val_max_samples) if val_files is not None else None
        return train, val

    # ------------------------------------------------------------------ one step
    def train_step(self, batch: Batch) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.workers.update_actor(batch, SFT())
        tokens = float(batch["response_mask"].sum())
        metrics.update({"train/trained_tokens": tokens, "timing_s/step": time.perf_counter() - start})
        return metrics

    def validate(self) -> dict[str, float]:
        """``val/loss``: NLL per trained token over the whole validation set."""
        if self.val_data is None:
            return {}
        nll = tokens = 0.0
        for batch in self._batches(self.val_data):
            sums = self.workers.compute_sequence_logps(batch).to(torch.float64)  # [N, 2]: log-prob sum, tokens
            nll, tokens = nll - float(sums[:, 0].sum()), tokens + float(sums[:, 1].sum())
        return {"val/loss": nll / max(tokens, 1.0)}

    def _batches(self, dataset: Any) -> Iterator[Batch]:
        """``dataset`` in order, collated ``data.micro_batch_size_per_gpu`` rows per rank at a time
        (validation; DPO's reference log-probs computed once)."""
        size = self.config.data.micro_batch_size_per_gpu * self.workers.world_size
        for begin in range(0, len(dataset), size):
            yield dataset.collate_fn([dataset[i] for i in range(begin, min(len(dataset), begin + size))])

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, float]]:
        """Train until `total_steps` (resuming per ``trainer.resume_mode``); returns per-step metrics."""
        from posttrain.tracking import Tracking
        from posttrain.trainer.trainer import _config_dict, _stop_on_signals

        t = self.config.trainer
        tracker = Tracking(t.logger if self.rank == 0 else [], setup.run_dir(self.rl), t.project_name,
                           t.experiment_name, _config_dict(self.config), self.total_steps)
        self._phase = "resume"
        try:
            with _stop_on_signals(self):
                self._resume()
                self._phase = "train"
                self._loop(tracker)
        finally:
            self.workers.shutdown()
            self._unlock()
        if t.save_freq > 0 and self.global_step == self.total_steps and self.stopped_by is None and self.rank == 0:
            resume.export_final(self.checkpoints)
        tracker.finish()
        return self.history

    def _loop(self, tracker: Any) -> None:
        t = self.config.trainer
        while self.global_step < self.total_steps and not self._should_stop():
            epoch = self.train_loader.epoch
            metrics = self.train_step(self.train_loader.next_batch())
            self.global_step += 1
            metrics.update({"train/epoch": epoch, "train/global_step": self.global_step})
            last = self.global_step == self.total_steps
            if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                metrics.update(self.validate())
            if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or last):
                self.save_checkpoint()
            tracker.log(metrics, step=self.global_step)
            self.history.append({"step": self.global_step, **metrics})
        if self._stop_signal is not None:
            self.stopped_by = self._stop_signal
            if self.global_step > 0 and self._saved_step != self.global_step:
                path = self.save_checkpoint()
                resume.report_signal_stop(self._stop_signal, self.global_step, path)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """``global_step_N/actor`` (weights, optimizer, schedule) + the loader's position and RNG."""
        if self.rank != 0:  # torchrun: rank 0 seals the folder; this rank writes its shards into it
            self.workers.follow_save()
            self._saved_step = self.global_step
            return self.checkpoints.step_dir(self.global_step)
        run = resume.RunState(self.global_step)
        path = resume.save_run(self.checkpoints, self.workers, run, self.train_loader, None, self._fingerprint())
        self._saved_step = self.global_step
        return path

    def _resume(self) -> None:
        run = resume.restore_run(self.rl.trainer, self.workers, self.train_loader, None, self._fingerprint())
        if run is None:
            return
        self.global_step = run.global_step
        if self.global_step >= self.total_steps:
            print(f"the checkpoint is at step {self.global_step} and this run has {self.total_steps} steps: nothing "
                  "left to train (raise trainer.total_training_steps or trainer.total_epochs to continue)", flush=True)

    def _fingerprint(self) -> dict:
        """What a resumed run must share with the one that saved: model, LoRA, batch size, stage."""
        fp = resume.config_fingerprint(self.rl, vocab_size=len(self.tokenizer))
        fp["adv_estimator"] = self.stage  # the RL key names the stage, so an RL run will not resume an SFT one
        return fp


def builtin_sft_files(config: SFTConfig) -> tuple[str, str]:
    """The built-in arithmetic task as SFT rows (``posttrain prep arithmetic-sft``), written once into a cache."""
    from posttrain.data.prep_sft import default_arithmetic_sft_files

    a = config.data.arithmetic
    return default_arithmetic_sft_files(digits=a.digits, n_train=a.n_train, n_test=a.n_test, seed=a.seed,
                                        prompt_style=a.prompt_style)
