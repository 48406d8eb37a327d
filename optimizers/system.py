"""The machine a layout runs on: the accelerator, its two link tiers, and what calibration learned.

A :class:`System` is facts from datasheets and published measurements, each
with its source: the accelerator's peaks and HBM (``mfuscope.hardware``), the
largest matmul throughput measured on it (MAMF, the ceiling real GEMMs
approach), GPUs per NVLink domain, and two link tiers as alpha-beta rows --
``scale_up`` (NVLink / NVSwitch / Infinity Fabric, inside a node or rack) and
``scale_out`` (the NIC per GPU, across nodes).  Bandwidths are per GPU and per
direction, bytes per second, which is what NCCL's bus bandwidth is measured
against.

A :class:`Profile` is how close a training step gets to those ceilings.  Four
numbers are fitted by ``optimizers.calibrate`` to published runs and saved as
``hw.json``; the cost of overlap is a published measurement, not fitted; the
links' two fractions are nccl-tests measurements (a measured run fits those
too).  The other defaults below are round starting values, not fits, and the
report says which profile a prediction used.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mfuscope import hardware
from mfuscope.atomic import write_json
from mfuscope.errors import UserInputError

GB = 1e9
Gbit = 1e9 / 8
US = 1e-6


@dataclass(frozen=True)
class LinkTier:
    """One link tier: ``latency_s`` per collective step, ``bandwidth_Bps`` per GPU and direction.
    ``reduce_scatter_as_all_reduce``: the library has no reduce-scatter of its own and runs it as an
    all-reduce of the whole input, keeping a slice (gloo: measured here, a 768 KB reduce-scatter
    of 2 ranks takes 2.5 ms, the all-reduce of the same buffer 2.1, the all-gather 0.6)."""

    name: str
    latency_s: float
    bandwidth_Bps: float
    source: str
    reduce_scatter_as_all_reduce: bool = False

    def runs_as(self, op: str) -> str:
        """The collective the tier's library really runs for ``op``."""
        return "all_reduce" if op == "reduce_scatter" and self.reduce_scatter_as_all_reduce else op


@dataclass(frozen=True)
class System:
    key: str
    accelerator: hardware.Accelerator
    gpus_per_node: int                  # GPUs sharing the scale-up domain (8 in HGX, 72 in NVL72)
    scale_up: LinkTier
    scale_out: LinkTier
    mamf_flops: dict[str, float]        # dtype -> measured maximum achievable matmul FLOP/s
    mamf_source: str
    memory_bytes: float | None = None   # overrides the datasheet (e.g. a 96 GB H100 variant)
    attention_flops: float | None = None  # measured flash-attention forward+backward FLOP/s
    power_limit_w: float | None = None  # a board capped below its TDP (e.g. 500 W H100s)
    tdp_w: float = 700.0

    @property
    def clock_derate(self) -> float:
        """Compute ceilings under a power cap: clock ~ power^(1/3) (dynamic power ~ f V^2 with V
        tracking f), so a 500 W cap on a 700 W part runs GEMMs at (5/7)^(1/3) = 0.894."""
        if not self.power_limit_w or self.power_limit_w >= self.tdp_w:
            return 1.0
        return (self.power_limit_w / self.tdp_w) ** (1 / 3)

    def attention_ceiling(self, kernel: str = "fa2") -> float:
        """Flash attention's measured rate at 16k tokens; where none is published, H100's ratio of
        flash attention to MAMF (335 / 794.5) times this device's bf16 MAMF.  ``fa3``
        (FlashAttention-3, cuDNN's fused attention) needs Hopper's asynchronous tensor cores or
        later: H100's FA3 rate over its FA2 rate times this device's FA2 rate; elsewhere FA2's."""
        rate = self.attention_flops or self.matmul_flops("bf16") * FA2_H100 / 794.5e12
        if kernel == "fa3" and self.key in ASYNC_TENSOR_CORES:
            rate *= FA3_H100 / FA2_H100
        return rate * self.clock_derate

    def peak_flops(self, dtype: str) -> float:
        peak = self.accelerator.peak_flops(dtype)
        if peak is None:
            raise UserInputError(f"{self.key} has no {dtype} tensor-core peak in the hardware table")
        return peak

    def matmul_flops(self, dtype: str) -> float:
        """The GEMM ceiling: measured MAMF where known, else the datasheet peak (power-capped)."""
        return (self.mamf_flops.get(dtype) or self.peak_flops(dtype)) * self.clock_derate

    @property
    def hbm_Bps(self) -> float:
        return self.accelerator.memory_tbps * 1e12

    @property
    def device_bytes(self) -> float | None:
        return self.memory_bytes or (self.accelerator.memory_gb * GB or None)


def _acc(name: str) -> hardware.Accelerator:
    acc = hardware.lookup(name)
    assert acc is not None, name
    return acc


# Link latencies are NCCL's order of magnitude for one step of a collective (a few microseconds
# over NVLink, about ten over InfiniBand/RoCE); they matter only for small messages.
_NV = 3 * US
_NET = 10 * US
# MAMF: stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
# comparison table" (mean of 100 iterations at the best shape found, torch 2.5-2.9).
_MAMF_SRC = "ml-engineering MAMF table (stas00/ml-engineering, compute/accelerator)"
# FlashAttention-2's forward rate at head dim 128: up to 230 TFLOP/s on A100 SXM4 (Dao 2023) and
# 335 TFLOP/s on H100 SXM5, causal, 16k tokens (Shah et al. 2024, FlashAttention-3, forward-speed
# figure).  Backward runs at about 0.87 of the forward rate: 63% against 73% of A100's peak (Dao
# 2023), 322 against 370 TFLOP/s on H100 at head dim 128 and 16k tokens (Shah et al. 2024, the
# FlashAttention-2 bars of the backward- and forward-speed figures).  ``Profile.attention`` carries
# the rest.
FA2_A100 = 230e12
FA2_H100 = 335e12
FA2_BACKWARD = 0.87
# FlashAttention-3's forward rate on H100 at head dim 128 and 16k tokens (batch x length = 16k,
# 2,048 channels of heads): 620.7 TFLOP/s, and 430.3 / 517.1 / 565.5 / 590.2 / 614.2 at 512 /
# 1k / 2k / 4k / 8k tokens (pytorch/benchmark pull request #2391, its test plan's table; the
# Triton tutorial's FA2-style kernel in the same table: 328.9 ... 476.8, the same shape).  Those
# shapes fit ``L / (L + ATTENTION_KNEE)`` normalised at 16k within 1.4% (512: 0.69 of the 16k
# rate, both kernels): a block of L keys pays a fixed cost per query tile (its prologue, the
# softmax's final rescale and the output's write) against a loop L long.
# cuDNN's fused attention runs at FA3's rate: 631.3 against FA3's 631.8 and SDPA's FA2 backend's
# 329.5 TFLOP/s on H100 at 4,608 tokens, head dim 128 (pytorch/pytorch#142132); PyTorch's SDPA made
# cuDNN opt-in after 2.5 (pytorch/pytorch#138649) until cuDNN 9.15, so torchtitan's runs are FA2.
FA3_H100 = 620.7e12
ATTENTION_KNEE = 240.0
ATTENTION_NORMALISED_AT = 16384.0
#: NVIDIA GPUs with Hopper's asynchronous tensor cores (TMA, warpgroup MMA) or later, which
#: FlashAttention-3-class kernels need.
ASYNC_TENSOR_CORES = ("H100", "H200", "H800", "B200", "B300", "GB200", "GB300")

#: GPUs whose tensor cores scale 32-element blocks themselves (the OCP MX formats: Blackwell's
#: fifth-generation tensor cores); earlier ones have no MXFP8 GEMM.
MICROSCALING = ("B200", "B300", "GB200", "GB300")

SYSTEMS: dict[str, System] = {
    "A100": System("A100", _acc("A100"), 8,
                   LinkTier("nvlink3", _NV, 300 * GB, "A100 datasheet: NVLink 600 GB/s bidirectional"),
                   LinkTier("ib-hdr", _NET, 200 * Gbit, "DGX A100: 8x 200 Gb/s HDR InfiniBand per node"),
                   {"bf16": 271.2e12, "fp16": 271.2e12}, _MAMF_SRC, attention_flops=FA2_A100, tdp_w=400),
    "H100": System("H100", _acc("H100"), 8,
                   LinkTier("nvlink4", _NV, 450 * GB, "H100 SXM datasheet: NVLink 900 GB/s bidirectional"),
                   LinkTier("ib-ndr", _NET, 400 * Gbit, "DGX H100: 8x 400 Gb/s ConnectX-7 per node"),
                   {"bf16": 794.5e12, "fp16": 794.5e12, "fp8": 1402.6e12}, _MAMF_SRC, attention_flops=FA2_H100),
    "H200": System("H200", _acc("H200"), 8,
                   LinkTier("nvlink4", _NV, 450 * GB, "H200 SXM datasheet: NVLink 900 GB/s bidirectional"),
                   LinkTier("ib-ndr", _NET, 400 * Gbit, "HGX H200: 400 Gb/s ConnectX-7 per GPU"),
                   {"bf16": 794.5e12, "fp16": 794.5e12, "fp8": 1453.4e12},
                   _MAMF_SRC + "; bf16 as H100 (the table notes H200 is the same)", attention_flops=FA2_H100),
    "H800": System("H800", _acc("H800"), 8,
                   LinkTier("nvlink4-h800", _NV, 200 * GB, "H800 SXM: NVLink 400 GB/s bidirectional"),
                   LinkTier("ib-ndr", _NET, 400 * Gbit, "DeepSeek-V3 report: 400 Gb/s InfiniBand per GPU"),
                   {"bf16": 794.5e12, "fp16": 794.5e12, "fp8": 1402.6e12},
                   _MAMF_SRC + "; H100's (same compute)", attention_flops=FA2_H100),
    "B200": System("B200", _acc("B200"), 8,
                   LinkTier("nvlink5", _NV, 900 * GB, "B200 datasheet: NVLink 1.8 TB/s bidirectional"),
                   LinkTier("ib-ndr", _NET, 400 * Gbit, "DGX B200: 8x 400 Gb/s ConnectX-7 per node"),
                   {"bf16": 1745.0e12, "fp16": 1745.0e12, "fp8": 3432.5e12}, _MAMF_SRC, tdp_w=1000),
    "B300": System("B300", _acc("B300"), 8,
                   LinkTier("nvlink5", _NV, 900 * GB, "HGX B300: NVLink 1.8 TB/s bidirectional"),
                   LinkTier("ib-xdr", _NET, 800 * Gbit, "HGX B300: 800 Gb/s ConnectX-8 per GPU"),
                   {"bf16": 1769.0e12, "fp16": 1769.0e12, "fp8": 3353.3e12}, _MAMF_SRC, tdp_w=1100),
    "GB200": System("GB200", _acc("GB200"), 72,
                    LinkTier("nvlink5-nvl72", _NV, 900 * GB, "GB200 NVL72: one 72-GPU NVLink domain, 1.8 TB/s"),
                    LinkTier("ib-ndr", _NET, 400 * Gbit, "GB200 NVL72: 400 Gb/s ConnectX-7 per GPU"),
                    {"bf16": 1822.0e12, "fp16": 1822.0e12, "fp8": 3615.6e12}, _MAMF_SRC, tdp_w=1200),
    "GB300": System("GB300", _acc("GB300"), 72,
                    LinkTier("nvlink5-nvl72", _NV, 900 * GB, "GB300 NVL72: one 72-GPU NVLink domain, 1.8 TB/s"),
                    LinkTier("ib-xdr", _NET, 800 * Gbit, "GB300 NVL72: 800 Gb/s ConnectX-8 per GPU"),
                    {}, "no MAMF published: the datasheet peak is the ceiling", tdp_w=1400),
    "MI300X": System("MI300X", _acc("MI300X"), 8,
                     LinkTier("infinity-fabric", _NV, 448 * GB, "MI300X: 7 x 64 GB/s per direction Infinity Fabric"),
                     LinkTier("roce-400", _NET, 400 * Gbit, "MI300X platforms: 400 Gb/s NIC per GPU"),
                     {"bf16": 668.4e12, "fp16": 668.4e12}, _MAMF_SRC, tdp_w=750),
    "V100": System("V100", _acc("V100"), 8,
                   LinkTier("nvlink2", _NV, 150 * GB, "V100 SXM2: NVLink 300 GB/s bidirectional"),
                   LinkTier("ib-edr", _NET, 100 * Gbit, "DGX-1: 100 Gb/s EDR InfiniBand per GPU"),
                   {}, "no MAMF published: the datasheet peak is the ceiling", tdp_w=300),
}


def system(key: str, *, gpus_per_node: int | None = None, memory_gb: float | None = None,
           power_limit_w: float | None = None) -> System:
    """A table entry by key (case-insensitive, ``H100-SXM`` and ``h100`` both work), optionally
    with another node size, memory size or power cap."""
    norm = key.upper().split("-")[0]
    if norm not in SYSTEMS:
        raise UserInputError(f"unknown GPU {key!r}: one of {', '.join(SYSTEMS)}")
    out = SYSTEMS[norm]
    if gpus_per_node:
        out = replace(out, gpus_per_node=gpus_per_node)
    if memory_gb:
        out = replace(out, memory_bytes=memory_gb * GB)
    if power_limit_w:
        out = replace(out, power_limit_w=power_limit_w)
    return out


#: An FSDP2 hook call's host time in layer passes of host time (``Profile.fsdp_hook_layer_passes``
#: until a calibration run that shards fits it): measured, not fitted to what it predicts --
#: ``python benchmarks/fsdp_hooks.py`` trains two models the cost model's real-compute table does not
#: predict (the reference trainer's ``tiny_dense``, d=64, and a d=128 one) on one rank and on
#: dp_shard=2 on this repository's 2-core CPU, five times each, and calibrates each pair.  A hook
#: call took 0.6-0.8 ms on both, a layer pass 0.4-0.5 ms at d=64 and 0.77-0.86 ms at d=128 (the
#: per-layer host time grows with the tensors, the hooks' Python does not): medians 1.42 and 0.87
#: layer passes (2026-12-06), of which this is the geometric mean.
FSDP_HOOK_LAYER_PASSES = 1.1


@dataclass(frozen=True)
class Profile:
    """How close training gets to each ceiling (fractions), and the one overlap cost.

    gemm             achieved fraction of MAMF by a large GEMM inside a training step
    gemm_knee        a GEMM dimension d runs at d / (d + knee) of a large one's rate (per dimension,
                     normalised at 8192): small, skinny GEMMs after TP sharding run slower
    attention        flash attention's fraction of its published rate (``System.attention_ceiling``)
    memory           fraction of HBM bandwidth that memory-bound kernels reach
    scale_up         achieved bus bandwidth over the NVLink tier, fraction of its bandwidth: 0.78,
                     NCCL's own tuning model's ceiling for A100 (235 GB/s of NVLink3's 300,
                     ``src/graph/tuning.cc``)
    scale_out        the same over the network tier: 0.96, what NCCL's maintainers measure (192 GB/s
                     of all-reduce bus bandwidth over a DGX A100's 8 x 200 Gb/s, NVIDIA/nccl#1576;
                     48-49 GB/s from a 400 Gb/s ConnectX-7, NVIDIA/nccl-tests#267)
    overlap_slowdown compute time added per second of communication it hides (SM and HBM sharing):
                     0.159, measured, not fitted -- compute kernels run on average 18.9% longer while
                     collectives run beside them (Lee et al. 2025, arXiv:2507.03114: GPT and Llama
                     layers on 4 A100s, H100s, MI250s and MI210s; 40% at most), so a second of hidden
                     communication leaves 1 - 1/1.189 of a second of compute undone
    microbatch_overhead_s
                     host time per microbatch, chunk and pass (Python, framework, launches) that the
                     device does not hide: zero for the published GPU runs (not fitted there), the
                     largest cost of a small model on CPU; fitted from a measured run
    latency_scale    multiplies the link tiers' latencies: 1 for the published runs (not fitted
                     there); a measured run with many small collectives fits it (gloo on a loaded
                     host waits milliseconds, not microseconds)
    layer_overhead_s host time per layer and pass (module calls, hooks, a tensor-parallel layer's
                     DTensor dispatch) that the device does not hide: zero for the published GPU
                     runs; on a CPU, where every operator is dispatched by the one thread that
                     computes, it grows with the layers a rank runs, not with its microbatches
    tp_overhead_s    host time per layer and pass that tensor parallelism adds: DTensor propagates
                     the sharding of every operator of a tensor-parallel layer (and redistributes)
                     on the thread that launches it; on a CPU it shows inside every operator's time
    fsdp_hook_layer_passes
                     host time of FSDP's hooks per unit and collective it issues (each gather, each
                     reduce-scatter), in layer passes of host time (``layer_overhead_s``): FSDP2's
                     hooks -- their Python, the copy-in and copy-out calls, the sharded parameters'
                     DTensor wrapping -- run on the thread that also launches the compute, and cost
                     what the host's speed makes of a fixed amount of Python, as a layer's module
                     calls do.  :data:`FSDP_HOOK_LAYER_PASSES` until a calibration run that shards its
                     parameters, beside one that does not, fits it; nothing where the host time is
                     hidden (the published GPU runs: ``layer_overhead_s`` is zero)
    dtensor_param_s  seconds per parameter tensor and optimizer step when the parameters are
                     DTensors (tensor parallelism, FSDP2's shards): each tensor's update dispatches
                     through DTensor, not as one fused multi-tensor kernel over plain tensors
    optimizer        fraction of HBM bandwidth the optimizer step reaches: the memory-bound kernels'
                     (``memory``) until a measured run says otherwise -- a fused multi-tensor AdamW
                     and a per-parameter loop over sharded tensors differ by several times
    link_tp .. link_pp
                     each dimension's own factor on its collectives' speed (time / factor), 1 for the
                     tier as the two link fractions above state it; a measured run that exposes a
                     dimension's collectives fits that dimension's (its group's kind of collectives,
                     message sizes and process-group implementation are its own)

    The two link fractions are nccl-tests facts, not fitted to published throughput: across the
    published runs a faster link and a slower GEMM predict the same steps (Megatron's exposed TP
    collectives scale with its GEMMs), so a fit of both wanders along that valley.  A measured run,
    whose trace separates communication from compute, fits them (``calibrate.fit_run``).
    """

    gemm: float = 0.75
    gemm_knee: float = 128.0
    attention: float = 1.0
    memory: float = 0.7
    scale_up: float = 0.78
    scale_out: float = 0.96
    overlap_slowdown: float = 0.159
    microbatch_overhead_s: float = 0.0
    latency_scale: float = 1.0
    layer_overhead_s: float = 0.0
    tp_overhead_s: float = 0.0
    fsdp_hook_layer_passes: float = FSDP_HOOK_LAYER_PASSES
    dtensor_param_s: float = 0.0
    optimizer: float = 0.7
    link_tp: float = 1.0
    link_cp: float = 1.0
    link_dp: float = 1.0
    link_ep: float = 1.0
    link_pp: float = 1.0
    provenance: dict = field(default_factory=lambda: {"source": "defaults (not calibrated)"})

    FITTED = ("gemm", "gemm_knee", "attention", "memory")
    LINKS = ("link_tp", "link_cp", "link_dp", "link_ep", "link_pp")
    FIELDS = FITTED + ("overlap_slowdown", "scale_up", "scale_out", "microbatch_overhead_s", "latency_scale",
                       "layer_overhead_s", "tp_overhead_s", "fsdp_hook_layer_passes", "dtensor_param_s",
                       "optimizer") + LINKS
    BOUNDS = {"gemm": (0.2, 1.0), "gemm_knee": (8.0, 4096.0), "attention": (0.1, 1.0),
              "memory": (0.2, 1.0), "scale_up": (0.2, 1.0), "scale_out": (0.2, 1.0),
              "overlap_slowdown": (0.0, 1.0), "microbatch_overhead_s": (0.0, 1.0), "latency_scale": (1e-3, 1e4),
              "optimizer": (1e-4, 1.0), "layer_overhead_s": (0.0, 1.0), "tp_overhead_s": (0.0, 1.0),
              "fsdp_hook_layer_passes": (0.0, 100.0), "dtensor_param_s": (0.0, 1.0), **{k: (1e-3, 1e3) for k in LINKS}}

    def values(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.FIELDS}

    def save(self, path: str | Path) -> None:
        write_json(Path(path), {"profile": self.values(), "provenance": self.provenance})

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
            values = data["profile"]
            # A profile written before FSDP's hooks were counted in layer passes held their seconds.
            if "fsdp_unit_overhead_s" in values:
                hook_s, layer_s = float(values.pop("fsdp_unit_overhead_s")), float(values.get("layer_overhead_s", 0.0))
                values["fsdp_hook_layer_passes"] = hook_s / layer_s if hook_s and layer_s else FSDP_HOOK_LAYER_PASSES
            unknown = set(values) - set(cls.FIELDS)
            if unknown:
                raise KeyError(", ".join(sorted(unknown)))
            # A profile written before the optimizer had its own rate: the memory-bound kernels'.
            values.setdefault("optimizer", values.get("memory", cls.optimizer))
            return cls(**{k: float(v) for k, v in values.items()}, provenance=data.get("provenance", {}))
        except FileNotFoundError:
            raise UserInputError(f"{p}: no such hardware profile") from None
        except (ValueError, KeyError, TypeError) as e:
            raise UserInputError(f"{p}: not a hardware profile written by `mfuscope calibrate` ({e})") from None


PUBLISHED_PROFILE = Path(__file__).resolve().parent / "profiles" / "published.json"


def default_profile() -> Profile:
    """The profile fitted on the published runs (``mfuscope calibrate calibration.csv``), shipped
    with mfuscope; the round defaults where it is missing."""
    return Profile.load(PUBLISHED_PROFILE) if PUBLISHED_PROFILE.is_file() else Profile()


def describe(s: System) -> dict:
    return {"key": s.key, "gpus_per_node": s.gpus_per_node, "scale_up": asdict(s.scale_up),
            "scale_out": asdict(s.scale_out), "mamf_flops": s.mamf_flops, "device_bytes": s.device_bytes}
