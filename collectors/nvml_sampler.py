"""GPU samples from NVML on a background thread: utilization, SM clock, power, memory,
temperature, PCIe and NVLink throughput.

NVML answers in microseconds and holds no GIL-heavy work, so a 100 ms period
costs the training loop nothing measurable.  Without nvidia-ml-py or without
an NVIDIA driver the sampler is off, and says so in one line (once per node).
Metrics a device does not expose are null, never zero.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any


class NvmlSampler:
    def __init__(self, rank: int, device_index: int, period_s: float = 0.1, announce: bool = True):
        self.rank = rank
        self.device_index = device_index
        self.period_s = period_s
        self.announce = announce
        self.rows: list[dict] = []
        self.off_reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        self._last_nvlink: tuple[int, int] | None = None

    def start(self) -> bool:
        """Start sampling; False (with ``off_reason`` set and one notice line) if NVML is unavailable."""
        try:
            import pynvml
        except ImportError:
            return self._off("nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        try:
            pynvml.nvmlInit()
            self._handle = _device_handle(pynvml, self.device_index)
        except pynvml.NVMLError as e:
            return self._off(f"no NVIDIA driver or device ({e})")
        self._nvml = pynvml
        self._thread = threading.Thread(target=self._run, name="mfuscope-nvml", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass

    def take_rows(self) -> list[dict]:
        taken, self.rows = self.rows, []
        return taken

    def _off(self, reason: str) -> bool:
        self.off_reason = reason
        if self.announce:
            print(f"mfuscope: GPU sampling (NVML) is off: {reason}", file=sys.stderr, flush=True)
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.rows.append(self.sample())

    def sample(self) -> dict:
        nvml, h = self._nvml, self._handle
        util = _try(nvml, lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        mem = _try(nvml, lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        power_mw = _try(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(h))
        # PCIe throughput is reported in KB/s over the last 20 ms.
        tx = _try(nvml, lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES))
        rx = _try(nvml, lambda: nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES))
        return {
            "rank": self.rank, "device": self.device_index, "ts_ns": time.time_ns(),
            "gpu_util_pct": None if util is None else float(util.gpu),
            "mem_util_pct": None if util is None else float(util.memory),
            "sm_clock_mhz": _float(_try(nvml, lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))),
            "power_w": None if power_mw is None else power_mw / 1e3,
            "mem_used_bytes": None if mem is None else int(mem.used),
            "temp_c": _float(_try(nvml, lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))),
            "pcie_tx_bps": None if tx is None else tx * 1e3,
            "pcie_rx_bps": None if rx is None else rx * 1e3,
            "nvlink_bps": self._nvlink_bps(),
        }

    def _nvlink_bps(self) -> float | None:
        """NVLink bytes/s (tx + rx, all links) from the cumulative throughput counters."""
        nvml = self._nvml
        fields = [getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", None),
                  getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", None)]
        if None in fields:
            return None
        values = _try(nvml, lambda: nvml.nvmlDeviceGetFieldValues(self._handle, fields))
        if not values or any(v.nvmlReturn != nvml.NVML_SUCCESS for v in values):
            return None
        now = time.monotonic()
        total_kib = sum(int(v.value.ullVal) for v in values)  # KiB since driver load
        last, self._last_nvlink = self._last_nvlink, (now, total_kib)
        if last is None or now <= last[0]:
            return None
        return (total_kib - last[1]) * 1024 / (now - last[0])


def _device_handle(nvml, index: int):
    """The NVML handle of CUDA device ``index``, matched by PCI bus id (NVML numbers devices without
    regard to CUDA_VISIBLE_DEVICES)."""
    try:
        import torch
        props = torch.cuda.get_device_properties(index)
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return nvml.nvmlDeviceGetHandleByPciBusId(bus)
    except (ImportError, AttributeError, RuntimeError, AssertionError, nvml.NVMLError):
        return nvml.nvmlDeviceGetHandleByIndex(index)


def _try(nvml, read):
    try:
        return read()
    except nvml.NVMLError:  # not supported on this device, or transiently unavailable
        return None


def _float(value) -> float | None:
    return None if value is None else float(value)
