"""Models: loading (HF folder, hub id, GGUF, alias), the critic's value model, mixed precision,
response log-probs/entropy (chunked, padding-trimmed) and the matmul-rate yardstick.

    load_tokenizer(path, *, trust_remote_code, custom_chat_template, padding_side)
    load_causal_lm(path, *, trust_remote_code, override_config, enable_gradient_checkpointing, dtype, device)
    load_value_model(path, ...) / value_model_from_lm(lm) -> ValueModel
    compute_response_logprobs(model, batch, micro_batch_size, temperature, calculate_entropy) -> ([N,R], [N,R]|None)
    response_logprobs(model, input_ids, attention_mask, position_ids, responses, ...)  (one micro-batch, with grad)
    autocast_context(device, param_dtype); measure_matmul_flops(dtype) -> FLOP/s
    fast_cpu_attention(model): faster CPU attention for bf16 forward/backward and decoding (attention.py)
"""

from posttrain.models.attention import fast_cpu_attention
from posttrain.models.loading import (
    SMOLLM2_ALIAS,
    ResolvedModel,
    enable_activation_checkpointing,
    load_causal_lm,
    load_config,
    load_tokenizer,
    parse_dtype,
    resolve_model_path,
)
from posttrain.models.logprobs import compute_response_logprobs, response_hidden_states, response_logprobs, split_lm
from posttrain.models.microbatch import micro_batch_indices, split_by_tokens, split_for_padding, split_rows
from posttrain.models.perf import measure_matmul_flops
from posttrain.models.precision import autocast_context, default_device
from posttrain.models.value_model import ValueModel, backbone_of, load_value_model, value_model_from_lm

__all__ = [
    "SMOLLM2_ALIAS",
    "ResolvedModel",
    "ValueModel",
    "autocast_context",
    "backbone_of",
    "compute_response_logprobs",
    "default_device",
    "enable_activation_checkpointing",
    "fast_cpu_attention",
    "load_causal_lm",
    "load_config",
    "load_tokenizer",
    "load_value_model",
    "measure_matmul_flops",
    "micro_batch_indices",
    "parse_dtype",
    "resolve_model_path",
    "response_hidden_states",
    "response_logprobs",
    "split_by_tokens",
    "split_for_padding",
    "split_lm",
    "split_rows",
    "value_model_from_lm",
]
