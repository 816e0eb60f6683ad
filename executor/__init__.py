"""The reference PyTorch executor (torch is an optional extra) and `meshplan verify`.

`executor.scale` (no torch): reduced-size copies of a ModelSpec. `executor.model`: the reference
transformer built from a ModelSpec. `executor.reference`: batches, the single-process step, a
deterministic training loop and `RunSpec`/`reference_run`, which distributed runs are compared
against. `executor.launch`: a world of ranks on this machine (`run_world`) or under torchrun.
`executor.mesh`: a plan's groups as DeviceMeshes. One file per parallel dimension:
`tensor_parallel`, `pipeline` (+ `recompute`), `context_parallel`, `expert_parallel`,
`data_parallel` (+ `sharded_optimizer` for ZeRO-1 under TP). `executor.plan_run`: all of them on one
rank. `executor.compare`: a run against the reference. `executor.verify`: what `meshplan verify` runs.
See docs/executor.md.
Nothing is imported here, so `import executor.scale` works without torch.
"""
