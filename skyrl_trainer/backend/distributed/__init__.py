"""Training across several processes: a Ray-backed `TrainingWorkerGroup` (`training.num_workers > 1`).

- `partition`: split a request's examples across ranks by token count.
- `replica`: the actor side, one rank's `TrainingWorker` in a torch.distributed group
  (replicated LoRA / data parallel, or FSDP2-sharded full fine-tuning).
- `ray_cluster`: join or start Ray in bounded time; refuse a cluster too small for the workers.
- `ray_group`: the driver side, `RayTrainingWorkerGroup`, what `make_worker_group` returns.

Importing this package does not import Ray; `ray_group` and `ray_cluster` do.
"""
