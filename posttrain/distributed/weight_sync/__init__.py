"""Trainer -> rollout weight transfer for asynchronous rollouts (issue 39).

Two transports with one interface (``send(named_tensors, version)`` on the trainer,
``receive(apply) -> version`` on each rollout worker):

- :class:`WeightSyncGroup`: a process group of its own between trainer rank 0 (rank 0) and ``k``
  rollout workers (ranks ``1..k``), built from its own ``TCPStore`` with no ``init_process_group``,
  so it neither needs nor disturbs the default group the trainer ranks already hold. ``gloo`` on CPU,
  ``nccl`` on GPUs. A send is, per bucket, a small JSON header (names, shapes, dtype, version) and
  one flat broadcast of that bucket's bytes; tensors of one dtype share a bucket up to
  ``bucket_bytes``. Tensors come from a generator and only one bucket per dtype is assembled at a
  time, so the sender never holds a second copy of the model (an FSDP2 shard is gathered only when
  its turn comes). Every receiver then reports success or its error back (one all-reduce), so a
  rollout worker that could not load the weights stops the trainer's ``send`` with its message
  instead of generating from a stale or half-loaded model.
- :class:`FileWeightSync`: the same through safetensors files in a versioned sub-folder plus an
  atomically replaced ``version`` file, for placements where no collective spans trainer and
  rollout (other clusters, a shared file system between them).

Around them: :func:`trainer_weights` (what the trainer sends: every weight, or the LoRA adapter
alone), :func:`load_weights` (copy into a rollout worker's own Hugging Face module, names and
shapes checked), :func:`push_trainer_weights` (every trainer rank iterates, rank 0 sends) and
:func:`receive_into` (load, then push into a vLLM engine when there is one), :func:`stage_weights`
(receive and check now, load later).

Collectives are blocking and need every rank: the driver tells the trainer to ``send`` and every
rollout worker to ``receive`` at the same time; each collective waits at most ``timeout_s``.

Two files: `transport` (how the bytes travel: the collective group, the files) and `names` (what the trainer sends
and how a rollout worker loads it: names, shapes, LoRA, vLLM). This package imports only torch at load time
(transformers, peft and safetensors when first used), so `benchmarks/gpu_check.py` and light processes can use it.
"""

from posttrain.distributed.weight_sync.names import (load_weights, push_trainer_weights, receive_into, stage_weights,
                                                     trainer_weights)
from posttrain.distributed.weight_sync.transport import (DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S, FileWeightSync,
                                                         WeightSyncError, WeightSyncGroup)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT_S",
    "FileWeightSync",
    "WeightSyncError",
    "WeightSyncGroup",
    "load_weights",
    "push_trainer_weights",
    "receive_into",
    "stage_weights",
    "trainer_weights",
]
