"""The reference PyTorch executor (torch is an optional extra).

`executor.scale` (no torch): reduced-size copies of a ModelSpec. `executor.model`: the reference
transformer built from a ModelSpec. `executor.reference`: batches, the single-process step and a
deterministic training loop that distributed runs are compared against. See docs/executor.md.
Nothing is imported here, so `import executor.scale` works without torch.
"""
