"""verl 0.9's `reward.*` tree (its reward loop, `verl/trainer/config/reward/reward.yaml`) with posttrain's
own `reward.{num_workers, on_error, timeout_s}` inside it.

verl 0.9 moved the reward's keys under one section: the user's scoring function
(`reward.custom_reward_function`), the manager that calls it (`reward.reward_manager`), a reward model
served as a generative judge or a discriminative scorer (`reward.reward_model`), and the code sandbox
(`reward.sandbox_fusion`). The older top-level `custom_reward_function.*` and `reward_model.*` keys keep
working; where both trees set the same thing differently, the start-up check names the two keys and says
which one a run would use (`posttrain.config.validate`).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Optional

from posttrain.config.actor_rollout_ref import _cfg

REWARD_MANAGER_SOURCES = ("register", "importlib")
"""``reward.reward_manager.source``'s values (verl's): a registered name, or a class loaded from a file."""


@_cfg()
class RewardFunctionConfig:
    path: Optional[str] = None
    """Python file defining the scoring function (null: the built-in scorers by data_source, or the legacy custom_reward_function.path)."""
    name: str = "compute_score"
    """Function in that file: compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs), plain or async def; a GenRM function also receives reward_router_address and reward_model_tokenizer."""


@_cfg()
class ModuleRefConfig:
    path: Optional[str] = None
    """Python file (or importable module) holding the class."""
    name: str = "custom_reward_manager"
    """Class name in that file."""


@_cfg()
class RewardManagerConfig:
    source: str = "register"
    """Where the manager comes from: register (a name registered with @register: naive, dapo, limit, remote, or the user's own) or importlib (the class named by module.path/module.name)."""
    name: str = "naive"
    """Registered manager: naive (one score per response), dapo (also records acc and applies the overlong buffer), limit (concurrency and rate bound, for rate-limited judges), remote (a separate process pool for CPU-heavy scorers)."""
    module: ModuleRefConfig = field(default_factory=ModuleRefConfig)
    """The manager class when source=importlib."""


@_cfg()
class JudgeDisaggregationConfig:
    enabled: bool = False
    """SGLang prefill/decode disaggregation of the reward model's server (GPU clusters with SGLang only; refused when True)."""
    prefill_replicas: int = 1
    """Prefill replicas (SGLang disaggregation; no effect here)."""
    decode_replicas: int = 1
    """Decode replicas (SGLang disaggregation; no effect here)."""
    decode_tensor_model_parallel_size: Optional[int] = None
    """Decode tensor parallelism (SGLang disaggregation; no effect here)."""
    transfer_backend: str = "nixl"
    """KV transfer back-end (SGLang disaggregation; no effect here)."""
    bootstrap_port: Optional[int] = None
    """Bootstrap port (SGLang disaggregation; no effect here)."""
    ib_device: Optional[str] = None
    """InfiniBand device (SGLang disaggregation; no effect here)."""


@_cfg()
class JudgeRolloutConfig:
    name: str = "hf"
    """Engine serving the reward model: hf (posttrain's, any machine) or vllm (verl requires a name; posttrain defaults to hf)."""
    dtype: str = "bfloat16"
    """Weights' dtype in the server (on a CPU without bf16 instructions: float32)."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (vllm engine on a GPU; no effect on the hf engine)."""
    enforce_eager: bool = True
    """No CUDA graphs (vllm engine)."""
    cudagraph_capture_sizes: Optional[list[int]] = None
    """CUDA-graph batch sizes (vllm on a GPU; no effect here)."""
    free_cache_engine: bool = True
    """Free the KV cache between phases (vllm engine)."""
    data_parallel_size: int = 1
    """Data-parallel replicas of the server (posttrain: one server per run)."""
    expert_parallel_size: int = 1
    """Expert parallelism (MoE on GPUs; no effect here)."""
    tensor_model_parallel_size: int = 2
    """Tensor parallelism of the server (vllm on GPUs; one process on a CPU)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallelism (GPU clusters; no effect here)."""
    max_num_batched_tokens: int = 8192
    """Most tokens one engine step handles (vllm engine)."""
    max_model_len: Optional[int] = None
    """Longest prompt + answer (null: prompt_length + response_length)."""
    max_num_seqs: int = 1024
    """Most requests decoded together (the server's batch bound)."""
    load_format: str = "auto"
    """Weight loading format (vllm engine)."""
    layered_summon: bool = False
    """Gather FSDP weights layer by layer (verl's weight sync; no effect on a frozen judge)."""
    scheduling_policy: str = "fcfs"
    """Request scheduling (vllm engine)."""
    full_determinism: bool = False
    """Deterministic kernels (vllm engine)."""
    seed: int = 42
    """Sampling seed of the server."""
    multi_stage_wake_up: bool = False
    """Wake weights and KV cache in stages (verl's GPU memory juggling; no effect here)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra engine arguments (vllm: passed to LLM(...))."""
    limit_images: Optional[int] = None
    """Images per prompt (vision judges; not supported yet)."""
    enable_chunked_prefill: bool = True
    """Chunked prefill (vllm engine)."""
    enable_prefix_caching: bool = True
    """Prefix caching (vllm engine)."""
    disable_log_stats: bool = True
    """Quiet engine statistics (vllm engine)."""
    skip_tokenizer_init: bool = False
    """Token ids in, token ids out (vllm engine)."""
    ignore_eos: bool = False
    """Generate past the end-of-sequence token."""
    temperature: float = 1.0
    """Default sampling temperature of the judge (a request's own temperature wins)."""
    top_k: int = -1
    """Default top-k (-1: off)."""
    top_p: float = 1.0
    """Default top-p."""
    do_sample: bool = True
    """Sample (False: greedy)."""
    n: int = 1
    """Answers per request."""
    prompt_length: int = 2048
    """Longest judge prompt in tokens."""
    response_length: int = 2048
    """Longest judge answer in tokens."""
    quantization: Optional[str] = None
    """Weight quantization (vllm on GPUs; no effect here)."""
    quantization_config_file: Optional[str] = None
    """Quantization config file (vllm on GPUs; no effect here)."""
    mtp: Any = None
    """Multi-token prediction for the judge (GPU engines; no effect here)."""
    disaggregation: JudgeDisaggregationConfig = field(default_factory=JudgeDisaggregationConfig)
    """Prefill/decode disaggregation (SGLang)."""


@_cfg()
class RewardLoopModelConfig:
    enable: bool = False
    """Score with a reward model: a generative judge behind an OpenAI-compatible server (GenRM; the reward function receives reward_router_address) or, with the legacy reward_model.* keys, a discriminative scorer (DisRM)."""
    enable_resource_pool: bool = False
    """Give the reward model its own resource pool (n_gpus_per_node x nnodes) instead of sharing the trainer's devices."""
    n_gpus_per_node: int = 8
    """Devices per node of the reward model's own pool (enable_resource_pool=True)."""
    nnodes: int = 0
    """Nodes of the reward model's own pool."""
    model_path: Optional[str] = None
    """The reward model: a local folder, a hub id, or a package model name (e.g. smollm2-135m-instruct)."""
    rollout: JudgeRolloutConfig = field(default_factory=JudgeRolloutConfig)
    """How the reward model is served."""


@_cfg()
class RewardSandboxConfig:
    url: Optional[str] = None
    """Sandbox service for code rewards (null: the legacy reward_model.sandbox_fusion.url, else no sandbox)."""
    max_concurrent: int = 64
    """Concurrent sandbox requests."""
    memory_limit_mb: int = 1024
    """Sandbox memory limit."""


@_cfg()
class RewardConfig:
    num_workers: int = 0
    """Processes scoring responses in parallel (0: in this process; verl's default is 8 reward-loop workers, posttrain scores in process unless asked)."""
    on_error: str = "raise"
    """(posttrain) An exception, a time-out or a nan/inf score in a scorer: raise (naming the row) or zero (score 0, counted in reward/errors)."""
    timeout_s: Optional[float] = 60.0
    """(posttrain) Seconds the scorer may take on one row (> 0; null: no limit); then the row is handled per reward.on_error. Also each judge request's limit, retries included; verl's reward.timeout is the same key."""
    max_concurrent: Optional[int] = None
    """Rows the limit reward manager scores at once (verl reads +reward.max_concurrent; null: 1, verl's default); also the judge client's requests in flight (null: 64 to the run's own GenRM server, 8 to a URL)."""
    max_rpm: Optional[float] = None
    """Judge requests a minute at most (the limit manager's and the judge client's bound; verl's +reward.max_rpm; null: no limit)."""
    max_tpm: Optional[float] = None
    """Tokens a minute at most, each row counted as estimated_tokens_per_request (the limit manager; verl's +reward.max_tpm; null: no limit)."""
    estimated_tokens_per_request: int = 2000
    """Tokens one row is counted as against max_tpm (verl's default)."""
    custom_reward_function: RewardFunctionConfig = field(default_factory=RewardFunctionConfig)
    """The user's scoring function (verl 0.9's place for the legacy custom_reward_function.*)."""
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    """The manager that calls the scoring function."""
    reward_model: RewardLoopModelConfig = field(default_factory=RewardLoopModelConfig)
    """A reward model in the reward loop."""
    sandbox_fusion: RewardSandboxConfig = field(default_factory=RewardSandboxConfig)
    """Code-execution sandbox for code rewards."""
