"""verl's experimental recipes under their module names (`verl` -> `posttrain`): asynchronous rollouts,
one-step-off (`one_step_off_policy.async_main_ppo`) and fully async (`fully_async_policy.fully_async_main`).
Both run `posttrain.trainer.async_trainer.AsyncRLTrainer`; `posttrain train` runs it too when
`actor_rollout_ref.hybrid_engine=False`."""
