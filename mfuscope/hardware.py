"""Accelerator peak numbers, for MFU and for the cost model.

Dense (no sparsity) peaks per device.  Bandwidths: memory in TB/s, the
scale-up link (NVLink / Infinity Fabric) as total bidirectional GB/s per
device, as the vendors quote it.  Where a vendor does not support a dtype the
entry is ``None``.  Every row names its source.

Scale-out (the inter-node network), where a vendor's reference system states it:
``nic_gbps`` is the NIC bandwidth one device has to itself, in the same unit as
``link_gbps`` (total bidirectional GB/s: a 400 Gb/s NIC per GPU is 50 GB/s each
way, 100 GB/s), with ``nic_source``; ``None`` where no reference system says it
(the network is the buyer's choice).  ``scaleup_domain`` is how many devices a
scale-up link joins in that reference system (8 on an HGX/DGX board or an MI300X
platform, 72 in an NVL72 rack, 2 for PCIe cards joined by an NVLink bridge).

An unknown device yields ``None`` (so no MFU) and one warning per device name:
a guessed peak would make every MFU number wrong without anyone noticing.
"""
from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass

log = logging.getLogger("mfuscope")

TFLOP = 1e12


@dataclass(frozen=True)
class Accelerator:
    key: str
    vendor: str
    bf16_tflops: float | None
    fp16_tflops: float | None
    fp8_tflops: float | None
    memory_gb: float
    memory_tbps: float
    link_gbps: float
    source: str
    nic_gbps: float | None = None
    nic_source: str | None = None
    scaleup_domain: int = 8

    def peak_flops(self, dtype: str = "bf16") -> float | None:
        """Dense peak FLOP/s for ``dtype`` (bf16, fp16, fp8, tf32, fp32); bf16 falls back to fp16
        on chips without bf16 (V100).  fp32 is the non-tensor-core peak (matrix cores on AMD)."""
        if dtype in ("fp32", "tf32"):
            fp32, tf32 = _FP32_TF32.get(self.key, (None, None))
            value = fp32 if dtype == "fp32" else tf32
            return value * TFLOP if value is not None else None
        value = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp8": self.fp8_tflops}.get(dtype)
        if value is None and dtype == "bf16":
            value = self.fp16_tflops
        return value * TFLOP if value is not None else None

    def as_dict(self) -> dict:
        return asdict(self)


_DGX_H = ("NVIDIA DGX BasePOD reference architecture, DGX H100/H200: eight single-port ConnectX-7, "
          "up to 400 Gb/s, one per GPU")

# (pattern on the device name as CUDA/ROCm report it, entry).  First match wins,
# so more specific names (H100 PCIe, GB200) come before general ones.
_TABLE: list[tuple[str, Accelerator]] = [
    # NVIDIA H100 Tensor Core GPU datasheet (2023): H100 PCIe column.
    (r"H100.*PCIe", Accelerator("H100-PCIe", "nvidia", 756.0, 756.0, 1513.0, 80, 2.0, 600,
                                 "NVIDIA H100 datasheet, PCIe: 1,513 TF bf16 / 3,026 TF fp8 with sparsity",
                                 scaleup_domain=2)),  # the datasheet's NVLink is a bridge joining two cards
    # NVIDIA H100 Tensor Core GPU datasheet (2023): H100 SXM column.
    (r"H100", Accelerator("H100-SXM", "nvidia", 989.4, 989.4, 1978.9, 80, 3.35, 900,
                          "NVIDIA H100 datasheet, SXM: 1,979 TF bf16 / 3,958 TF fp8 with sparsity",
                          nic_gbps=100, nic_source=_DGX_H)),
    # NVIDIA H200 Tensor Core GPU datasheet (2024): H200 SXM column.
    (r"H200", Accelerator("H200-SXM", "nvidia", 989.4, 989.4, 1978.9, 141, 4.8, 900,
                          "NVIDIA H200 datasheet, SXM: 1,979 TF bf16 with sparsity, 141 GB HBM3e at 4.8 TB/s",
                          nic_gbps=100, nic_source=_DGX_H)),
    # H800 SXM: H100 compute with NVLink cut to 400 GB/s (NVIDIA H800 product brief).
    (r"H800", Accelerator("H800-SXM", "nvidia", 989.4, 989.4, 1978.9, 80, 3.35, 400,
                          "NVIDIA H800 SXM product brief: H100 SXM compute, 400 GB/s NVLink")),
    # Blackwell Ultra (GB300 NVL72 / HGX B300 datasheets, 2025): per GPU dense 2.5 PF bf16 and 5 PF fp8
    # (GB300), 2.25 / 4.5 PF (B300); 288 GB HBM3e at 8 TB/s; NVLink 5 at 1.8 TB/s.
    (r"GB300", Accelerator("GB300", "nvidia", 2500.0, 2500.0, 5000.0, 288, 8.0, 1800,
                           "NVIDIA GB300 NVL72 datasheet: 360 PF bf16 dense per 72 GPUs, 288 GB HBM3e per GPU",
                           scaleup_domain=72)),
    (r"B300", Accelerator("B300", "nvidia", 2250.0, 2250.0, 4500.0, 288, 8.0, 1800,
                          "NVIDIA HGX B300 datasheet: 2.25 PF bf16 / 4.5 PF fp8 dense per GPU, 288 GB HBM3e")),
    # GB200 NVL72 datasheet (2024): 360 PF bf16 / 720 PF fp8 sparse over 72 GPUs -> per GPU dense.
    (r"GB200", Accelerator("GB200", "nvidia", 2500.0, 2500.0, 5000.0, 186, 8.0, 1800,
                           "NVIDIA GB200 NVL72 datasheet: 180 PF bf16 dense per 72 GPUs, 13.4 TB HBM3e",
                           scaleup_domain=72)),
    # DGX B200 datasheet (2024): 72 PF fp8 training (sparse) over 8 GPUs -> 4.5 PF fp8 dense per GPU.
    (r"B200", Accelerator("B200", "nvidia", 2250.0, 2250.0, 4500.0, 180, 8.0, 1800,
                          "NVIDIA DGX B200 datasheet: 1,440 GB HBM3e and 72 PF fp8 sparse per 8 GPUs",
                          nic_gbps=100, nic_source="NVIDIA DGX BasePOD reference architecture, DGX B200: "
                          "8x single-port ConnectX-7, up to 400 Gb/s, one per GPU")),
    # NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TF bf16/fp16 dense; 80 GB SXM at 2,039 GB/s.
    (r"A100", Accelerator("A100", "nvidia", 312.0, 312.0, None, 80, 2.039, 600,
                          "NVIDIA A100 datasheet: 312 TF bf16 dense (624 sparse), NVLink 600 GB/s",
                          nic_gbps=50, nic_source="NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 VPI "
                          "200 Gb/s HDR InfiniBand, one per GPU")),
    # NVIDIA V100 datasheet (2018): 125 TF fp16 tensor (SXM2); no bf16.
    (r"V100", Accelerator("V100-SXM2", "nvidia", None, 125.0, None, 32, 0.9, 300,
                          "NVIDIA Tesla V100 datasheet: 125 TF fp16 tensor, 900 GB/s HBM2, NVLink 300 GB/s")),
    # AMD Instinct MI300X data sheet (2023): 1,307.4 TF bf16 dense, 2,614.9 TF fp8, 192 GB at 5.3 TB/s.
    (r"MI300X", Accelerator("MI300X", "amd", 1307.4, 1307.4, 2614.9, 192, 5.3, 896,
                            "AMD Instinct MI300X data sheet: 7 x 128 GB/s Infinity Fabric links")),
]

#: Dense FP32 (CUDA cores; AMD: matrix cores) and TF32 tensor-core peaks, TFLOP/s, by table key, from
#: the same datasheets as the table (TF32 there is quoted with sparsity: halved).  A key that is not
#: here has no such peak in mfuscope: HFU of FP32 operators on it is null, never guessed.
_FP32_TF32: dict[str, tuple[float | None, float | None]] = {
    "H100-SXM": (67.0, 494.7),   # NVIDIA H100 datasheet, SXM: FP32 67 TF, TF32 989 TF with sparsity
    "H100-PCIe": (51.0, 378.0),  # NVIDIA H100 datasheet, PCIe: FP32 51 TF, TF32 756 TF with sparsity
    "H200-SXM": (67.0, 494.7),   # NVIDIA H200 datasheet: FP32 67 TF, TF32 989 TF with sparsity
    "H800-SXM": (67.0, 494.7),   # H100 SXM compute
    "A100": (19.5, 156.0),       # NVIDIA A100 datasheet: FP32 19.5 TF, TF32 156 TF (312 with sparsity)
    "V100-SXM2": (15.7, None),   # NVIDIA V100 datasheet, SXM2: FP32 15.7 TF; no TF32
    "MI300X": (163.4, 653.7),    # AMD Instinct MI300X data sheet: FP32 matrix 163.4 TF, TF32 653.7 TF
}

_warned: set[str] = set()


def lookup(device_name: str | None, *, warn: bool = True) -> Accelerator | None:
    """Table entry for a device name as the driver reports it, or None (warned once, unless ``warn``
    is False: a caller that only adds to the MFU, such as the link bandwidths, stays quiet)."""
    if not device_name:
        return None
    for pattern, acc in _TABLE:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return acc
    if warn and device_name not in _warned:
        _warned.add(device_name)
        log.warning("mfuscope: unknown accelerator %r: no peak FLOP/s in the hardware table, "
                    "so no MFU is reported for it", device_name)
    return None
