"""The reference PyTorch executor (torch is an optional extra).

`executor.scale` (no torch): reduced-size copies of a ModelSpec. `executor.model`: the reference
transformer built from a ModelSpec. `executor.reference`: batches, the single-process step, a
deterministic training loop and `RunSpec`/`reference_run`, which distributed runs are compared
against. `executor.launch`: a world of ranks on this machine (`run_world`) or under torchrun.
`executor.data_parallel`: DP with ZeRO 0-3. `executor.compare`: a run against the reference.
See docs/executor.md.
Nothing is imported here, so `import executor.scale` works without torch.
"""
