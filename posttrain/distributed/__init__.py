"""Scale-out: several ranks (one process per GPU, or per CPU slot with gloo) running posttrain's workers.

Modules (import the one you need; this package itself imports nothing heavy, and no Ray):

    fsdp      init_distributed, build_mesh, shard_model (FSDP2), gathered_for_generation,
              offload helpers, the gradient-averaging rule that is correct on gloo and NCCL
    dcp       save_sharded / load_sharded (torch.distributed.checkpoint, loadable at any world
              size, never unpickles code), full_state_dict_for_export
    dispatch  splitting a driver batch over ranks and combining what comes back
"""
