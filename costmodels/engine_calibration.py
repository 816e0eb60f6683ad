"""A serving engine's calibrated parameters (issue 45, item 2): what one engine (vLLM, SGLang, TensorRT-LLM) adds to,
or takes from, the roofline of costmodels/serving.py. A few physical parameters, each with a stated physical bound,
the same for every model the engine serves (never a factor per deployment) and for every GPU its rows ran on (the
factors scale each GPU's own defaults).

- The training calibration's five factors on the GPU's sourced defaults (costmodels/efficiency.scaled): GEMM and
  attention kernel ceilings, the memory-bound kernels' share of HBM bandwidth (decode's weight and KV reads), the
  collectives' share of the link rates (the engine's all-reduce and expert dispatch) and the launch cost per operator.
  The engine fit holds them at x1 since stop 56 (engine_fit.ENGINE_HELD): the engines' measured kernel tables now
  price decode.
- iteration_s: seconds every engine iteration takes beyond its kernels: the scheduler's batch assembly, sampling and
  the step's host-device synchronisation (vLLM's EngineCore loop, SGLang's scheduler, TensorRT-LLM's executor). It
  adds to every iteration (as a calibration's step overhead, Efficiency.head_overhead).
- request_s: seconds a request's first token takes beyond the engine's iterations: the HTTP front end, tokenisation,
  the hand-off to the engine process and the first token's detokenisation and streaming. It adds to TTFT only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshplan.costmodels.efficiency import Efficiency, scaled
from meshplan.hardware_db.calibration import EngineCalibration, StepOverhead, digest
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.decode_kernels import decode_kernels
from meshplan.hardware_db.gpu import GPUSpec, load_gpu

__all__ = ["EngineParameters", "FACTORS", "ADDITIVE", "BOUNDS", "parameters_of", "engine_calibrated_cluster"]

FACTORS = ("gemm", "attention", "memory", "network", "overhead")  # log factors (efficiency.scaled)
ADDITIVE = ("iteration_s", "request_s")  # seconds
# Physical bounds. Factors: a ceiling may fall to a quarter of its default (a kernel that bad would be a different
# kernel), and may rise only as far as the GPU's peak allows (scaled() caps every share at 1); launch cost between a
# tenth and 10x its 4 us default. Additive: no negative time; an iteration's host work at most 20 ms, four times a
# whole Llama-8B decode step on an H100 (~5 ms, which the vLLM blog's "vLLM V1 Alpha", 2025-01-27, gives as where the
# CPU's scheduling, input preparation and detokenisation become pronounced); a request's front-end time at most 0.5 s.
BOUNDS = {"gemm": (-1.386, 0.405), "attention": (-1.386, 0.405), "memory": (-1.386, 0.405),
          "network": (-1.386, 0.405), "overhead": (-2.303, 2.303), "iteration_s": (0.0, 0.020),
          "request_s": (0.0, 0.5)}


@dataclass(frozen=True)
class EngineParameters:
    """One engine's parameters on one GPU type: log factors on the defaults and two additive times (seconds)."""

    log_factors: tuple[tuple[str, float], ...] = ()
    iteration_s: float = 0.0
    request_s: float = 0.0

    def apply(self, gpu: GPUSpec, engine: str | None = None) -> tuple[GPUSpec, Efficiency]:
        """The GPU spec (its network shares scaled) and the efficiency model an engine iteration is timed with; with
        `engine`, decode attention and GEMMs as that engine's kernels run them on this GPU
        (hardware_db/decode_kernels.py)."""
        spec, eff = scaled(gpu, Efficiency.from_gpu(gpu), dict(self.log_factors))
        if engine is not None:
            eff = dataclasses.replace(eff, decode_attention=decode_kernels(gpu.name, "attention", engine),
                                      decode_gemm=decode_kernels(gpu.name, "gemm", engine))
        if self.iteration_s:
            eff = dataclasses.replace(eff, head_overhead=StepOverhead(forward_s=self.iteration_s, backward_s=0.0))
        return spec, dataclasses.replace(eff, request_s=self.request_s)

    def vector(self) -> tuple[float, ...]:
        """(the FACTORS' log factors, then the ADDITIVE seconds): the fit's parameter vector."""
        logs = dict(self.log_factors)
        return tuple(logs.get(name, 0.0) for name in FACTORS) + (self.iteration_s, self.request_s)

    @classmethod
    def of_vector(cls, values: tuple[float, ...] | list[float]) -> EngineParameters:
        v = [float(x) for x in values]
        return cls(tuple(zip(FACTORS, v[:len(FACTORS)], strict=True)), v[len(FACTORS)], v[len(FACTORS) + 1])

    def within_bounds(self) -> bool:
        return all(lo - 1e-12 <= x <= hi + 1e-12
                   for x, (lo, hi) in zip(self.vector(), (BOUNDS[n] for n in FACTORS + ADDITIVE), strict=True))


def parameters_of(cal: EngineCalibration) -> EngineParameters:
    """The parameters a calibration file states."""
    return EngineParameters(tuple((n, math.log(cal.factors[n].factor)) for n in FACTORS if n in cal.factors),
                            cal.iteration_s, cal.request_s)


def engine_calibrated_cluster(spec: ClusterSpec, cal: EngineCalibration, origin: str) -> tuple[Cluster, Efficiency]:
    """The cluster (its GPU's network shares scaled) and the efficiency model an engine's iterations are timed
    with under `cal`, labelled for the plan's record as a GPU calibration is (efficiency.factor_cluster)."""
    gpu, eff = parameters_of(cal).apply(load_gpu(spec.gpu), cal.engine)
    label = f"{origin.rsplit('/', 1)[-1]} sha256:{digest(cal)}"
    return Cluster(spec, gpu=gpu), dataclasses.replace(eff, calibration=label)
