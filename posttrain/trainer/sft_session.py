"""What an SFT or a DPO run trains with, shared by both trainers (each composes one `SFTSession`).

The session is also the stage the run loop (`posttrain.trainer.run.RunLoop`) runs: it holds the run's
state (global step, history, the signal that stopped it) and draws each batch, while the trainer
supplies its ``train_step`` and ``validate``; the trainer reads that state through the session.

Built in order, every check before a model loads: the model path and the data files, the
tokenizer, the rows (``read_rows``: SFT rows or preference pairs), the loader, the role specs the
workers are built from and the RL config the driver's parts read (`posttrain.config.sft_roles`), the
checkpoint folder (locked, its rule applied), then the RL worker group: in this process, on Ray
ranks, or, when ``torchrun`` started this process as one of several ranks, this rank's share
(`posttrain.distributed.torchrun`).
Under torchrun rank 0 alone locks the folder, and every rank shares its verdict.

Checkpoints are RL checkpoints (``global_step_N/actor``, the loader's position), fingerprinted with
the stage's name in the RL key that names the algorithm, so an RL run will not resume an SFT one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

from posttrain.batch import Batch
from posttrain.checkpoint import CheckpointManager
from posttrain.config.sft import SFTConfig
from posttrain.config.sft_roles import sft_role_specs
from posttrain.data.loader import PromptLoader
from posttrain.errors import ConfigError
from posttrain.launch import launched_by_torchrun, torchrun_world_size
from posttrain.trainer import preflight, resume, setup
from posttrain.trainer.run import NonFiniteGuard, RunLoop

__all__ = ["SFTSession", "builtin_sft_files", "read_sft_rows", "sft_fingerprint"]

ReadRows = Callable[[Any, Any, SFTConfig, int], Any]
"""``read_rows(files, tokenizer, config, max_samples)`` -> a dataset with ``collate_fn``."""
DefaultFiles = Callable[[SFTConfig], tuple[Any, Any]]
"""The (train, val) files of a run whose ``data.train_files`` is null (or an error saying what to set)."""


class SFTSession:
    """The tokenizer, datasets, loader, workers and checkpoint folder of one SFT or DPO run, and the
    run loop's stage (`posttrain.trainer.run.Stage`) over the trainer's step and validation.

    Args:
        config: the SFT or DPO config (already validated).
        read_rows: reads a file (or files) of the stage's rows.
        default_files: the files when ``data.train_files`` is null.
        stage: ``sft`` or ``dpo`` (in the checkpoint's fingerprint).
        reference: build a frozen reference beside the actor.
        trainer: what steps and validates (its ``train_step(batch)`` and ``validate()``).
        model, tokenizer: use these instead of loading ``model.partial_pretrain`` (tests; one process).
        before_models: called once every check has passed and before any model loads (the command line's
            held-out evaluation of the starting model), so that a bad input costs no model load.
    """

    metric_prefix = "train"  # the run loop logs train/epoch and train/global_step
    saves_last_step = True  # verl's SFT trainer validates and saves at its last step, whatever the frequencies

    def __init__(self, config: SFTConfig, read_rows: ReadRows, default_files: DefaultFiles, *, stage: str,
                 reference: bool, trainer: Any, model: Any = None, tokenizer: Any = None,
                 before_models: Callable[[], None] | None = None):
        self.config, self.stage, self.trainer, t = config, stage, trainer, config.trainer
        self.global_step = 0
        self.history: list[dict[str, float]] = []
        self.first_validation: dict[str, float] | None = None  # the run loop's (SFT and DPO validate no step 0)
        self.stopped_by: int | None = None
        self.model_dir: Path | None = None  # hf_model/ of a finished run
        self.nonfinite = NonFiniteGuard(t.max_consecutive_nonfinite, "Lower optim.lr, or check the rows for "
                                        "empty or overlong responses.")
        self.torchrun = launched_by_torchrun()  # every process a rank (module docstring of distributed.torchrun)
        world = torchrun_world_size() if self.torchrun else t.nnodes * t.n_gpus_per_node
        if model is not None and world > 1:
            raise ConfigError(f"an in-memory model trains in one process, and this run has trainer.nnodes x "
                              f"trainer.n_gpus_per_node = {world} ranks: save it to a folder and set "
                              "model.partial_pretrain")
        check_paths(config, model, tokenizer)
        self.tokenizer = tokenizer if tokenizer is not None else load_sft_tokenizer(config)
        self.train_data, self.val_data = self._read(read_rows, default_files)
        rows = len(self.train_data)
        if rows < config.data.train_batch_size:
            raise ConfigError(f"data.train_batch_size={config.data.train_batch_size} is larger than the {rows} "
                              "training rows; lower it")
        seed = config.data.seed if config.data.seed is not None else t.seed
        self.train_loader = PromptLoader(self.train_data, config.data.train_batch_size, shuffle=config.data.shuffle,
                                         seed=seed, drop_last=True, collate_fn=self.train_data.collate_fn)
        self.total_steps = t.total_training_steps or t.total_epochs * len(self.train_loader)
        self.specs, self.rl = sft_role_specs(config, self.total_steps, reference=reference)
        self.rank = self._join_torchrun(world)
        self.device = setup.resolve_device(self.rl)
        self.checkpoints = CheckpointManager(Path(self.rl.trainer.default_local_dir).expanduser(), t.max_ckpt_to_keep)
        self._claim_checkpoint_folder()
        try:
            if before_models is not None:
                before_models()
            self.workers = self._build_workers(model)
        except BaseException:
            if self.rank == 0:
                self.checkpoints.unlock()
            raise

    def _read(self, read_rows: ReadRows, default_files: DefaultFiles) -> tuple[Any, Any]:
        d = self.config.data
        train_files, val_files = d.train_files, d.val_files
        if train_files is None:
            train_files, default_val = default_files(self.config)
            val_files = default_val if val_files is None else val_files
        train = read_rows(train_files, self.tokenizer, self.config, d.train_max_samples)
        val = read_rows(val_files, self.tokenizer, self.config, d.val_max_samples) if val_files is not None else None
        return train, val

    def _join_torchrun(self, world: int) -> int:
        """This process's rank: 0 in one process or as the Ray driver; under torchrun, its rank in the
        process group it joins now (the RL config then names torchrun's world as its ranks)."""
        if not self.torchrun:
            return 0
        from posttrain.distributed.torchrun import join

        rank, _ = join(self.config.trainer.device, self.specs.timeout_s)
        self.rl.trainer.nnodes, self.rl.trainer.n_gpus_per_node = 1, world
        return rank

    def _claim_checkpoint_folder(self) -> None:
        """Lock ``trainer.default_local_dir`` and apply its rule (`resume.prepare_folder`): rank 0's job
        under torchrun, whose verdict every rank then shares (one error, on every rank)."""
        problem = None
        if self.rank == 0:
            try:
                preflight.claim_checkpoint_folder(self.rl, self.checkpoints, self.fingerprint())
            except Exception as err:  # ConfigError, CheckpointError: shared with the other ranks as text
                problem = err
        if self.torchrun:
            from posttrain.distributed.torchrun import first_rank_says

            message = first_rank_says(None if problem is None else f"{problem}")
            if problem is None and message is not None:
                raise ConfigError(f"rank 0: {message}")
        if problem is not None:
            raise problem

    def _build_workers(self, model: Any) -> Any:
        """The RL worker group: in this process, on Ray ranks, or this torchrun rank's share."""
        from posttrain.trainer.trainer import seed_everything

        seed = self.config.trainer.seed
        seed_everything(seed)
        if self.torchrun:
            from posttrain.distributed.torchrun import TorchrunGroup

            return TorchrunGroup(self.specs, seed, self.tokenizer, self.config.trainer.device)
        return setup.build_workers(self.rl, self.specs, self.device, seed, model, None, self.tokenizer)

    # ------------------------------------------------------------------ batches and checkpoints
    def batches(self, dataset: Any) -> Iterator[Batch]:
        """``dataset`` in order, collated ``data.micro_batch_size_per_gpu`` rows per rank at a time
        (validation; DPO's reference log-probs computed once)."""
        size = self.config.data.micro_batch_size_per_gpu * self.workers.world_size
        for begin in range(0, len(dataset), size):
            yield dataset.collate_fn([dataset[i] for i in range(begin, min(len(dataset), begin + size))])

    def step(self) -> dict[str, float]:
        return self.trainer.train_step(self.train_loader.next_batch())

    def validate(self) -> dict[str, float]:
        return self.trainer.validate()

    def save_checkpoint(self) -> Path:
        """``global_step_N/actor`` (weights, optimizer, schedule) + the loader's position and RNG."""
        run = resume.RunState(self.global_step, self.nonfinite.streak, self.first_validation)
        return resume.save_run(self.checkpoints, self.workers, run, self.train_loader, None, self.fingerprint())

    def restore(self) -> resume.RunState | None:
        run = resume.restore_run(self.rl.trainer, self.workers, self.train_loader, None, self.fingerprint())
        if run is not None:
            self.nonfinite.streak = run.nonfinite_streak
        return run

    def fit(self) -> list[dict[str, float]]:
        """The run loop over this session, stopping on non-finite steps (`NonFiniteGuard`); a finished
        run's exported model folder is then `model_dir`."""
        loop = RunLoop(self, check=lambda metrics: self.nonfinite(self.global_step, metrics))
        try:
            return loop.fit()
        finally:
            self.model_dir = loop.model_dir

    def fingerprint(self) -> dict:
        return sft_fingerprint(self.rl, len(self.tokenizer), self.stage)


def sft_fingerprint(driver_config: Any, vocab_size: int, stage: str) -> dict:
    """What a resumed run must share with the one that saved: model, LoRA, batch size, stage, read
    from the driver's RL config (`posttrain.config.sft_roles.sft_driver_config`)."""
    fp = resume.config_fingerprint(driver_config, vocab_size=vocab_size)
    fp["adv_estimator"] = stage  # the RL key names the stage, so an RL run will not resume an SFT one
    return fp


def check_paths(config: SFTConfig, model: Any, tokenizer: Any) -> None:
    """The model path and the data files, checked before anything loads (one error listing all)."""
    from posttrain.data.schema import SUPPORTED_SUFFIXES

    d, problems = config.data, []
    if model is None or tokenizer is None:
        problem = preflight.model_path_problem(config.model.partial_pretrain)
        if problem:
            problems.append(f"model.partial_pretrain: {problem}")
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for file in [] if files is None else files if isinstance(files, (list, tuple)) else [files]:
            path = Path(str(file)).expanduser()
            if not path.is_file():
                problems.append(f"{key}: {path} {'is a folder' if path.is_dir() else 'does not exist'}")
            elif not str(path).endswith(SUPPORTED_SUFFIXES):
                problems.append(f"{key}: {path} is not a {'/'.join(SUPPORTED_SUFFIXES)} file")
    problems += preflight.check_run_dir(config)  # the same keys as an RL run (trainer.run_dir)
    if problems:
        raise ConfigError("; ".join(problems))


def load_sft_tokenizer(config: SFTConfig) -> Any:
    from posttrain.models import load_tokenizer

    m = config.model
    try:
        return load_tokenizer(m.partial_pretrain, trust_remote_code=m.trust_remote_code,
                              custom_chat_template=config.data.chat_template)
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model.partial_pretrain={m.partial_pretrain}: cannot load its tokenizer ({reason})") from err


def read_sft_rows(files: Any, tokenizer: Any, config: SFTConfig, max_samples: int) -> Any:
    from posttrain.data.sft import SFTDataset

    return SFTDataset(files, tokenizer, config.data, max_samples=max_samples)


def builtin_sft_files(config: SFTConfig) -> tuple[str, str]:
    """The built-in arithmetic task as SFT rows (``posttrain prep arithmetic-sft``), written once into a cache."""
    from posttrain.data.prep_sft import default_arithmetic_sft_files

    a = config.data.arithmetic
    return default_arithmetic_sft_files(digits=a.digits, n_train=a.n_train, n_test=a.n_test, seed=a.seed,
                                        prompt_style=a.prompt_style)
