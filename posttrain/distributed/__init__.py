"""Where the roles run: one process (`placement.InProcess`, where the machine's levers meet the roles), or several
ranks (one process per GPU, or per CPU slot with gloo) running posttrain's workers.

Modules (import the one you need; this package itself imports nothing heavy, and no Ray):

    placement  InProcess: the one-process placement (device, precision, paging, the optimizer's choice and
               the allocator's phases on a CPU run)
    rank_group RankWorkerGroup: the trainer's WorkerGroup over Ray ranks (split, call, gather, metrics)
    rank       RankWorker: one rank's actor (+ rollout), reference and critic on FSDP2 shards
    ray_pool   RayActorPool: placement groups per node, rank environment, liveness-polled calls
    cluster    connect to / start Ray, per-node resource checks before anything is created
    split      splitting a driver batch over ranks, balancing tokens, combining what comes back
    fsdp       init_distributed, build_mesh, shard_model (FSDP2), gathered_for_generation,
               offload helpers, the gradient-averaging rule that is correct on gloo and NCCL
    weight_sync  trainer -> rollout weights (async rollouts): a stateless gloo/NCCL group or a folder of
               safetensors files; trainer_weights (full or LoRA adapters), load_weights
    dcp        save_sharded / load_sharded (torch.distributed.checkpoint, loadable at any world
               size, never unpickles code), full_state_dict_for_export
"""
