"""Hardware table: the names drivers report map to datasheet peaks; unknown means no MFU."""
from __future__ import annotations

import logging

import pytest

from mfuscope import hardware


@pytest.mark.parametrize("name, key, bf16_tflops", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100-PCIe", 756.0),
    ("NVIDIA H200", "H200-SXM", 989.4),
    ("NVIDIA H800", "H800-SXM", 989.4),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100-PG509-200", "A100", 312.0),
    ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA GB200", "GB200", 2500.0),
    ("NVIDIA B300 SXM6 AC", "B300", 2250.0),
    ("NVIDIA GB300", "GB300", 2500.0),
    ("AMD Instinct MI300X VF", "MI300X", 1307.4),
    ("Tesla V100-SXM2-32GB", "V100-SXM2", 125.0),  # no bf16: fp16 tensor peak
])
def test_known_devices(name, key, bf16_tflops):
    acc = hardware.lookup(name)
    assert acc.key == key
    assert acc.peak_flops("bf16") == pytest.approx(bf16_tflops * 1e12)
    assert acc.source


def test_fp8_is_twice_bf16_on_hopper_and_absent_on_ampere():
    assert hardware.lookup("NVIDIA H100 80GB HBM3").peak_flops("fp8") == pytest.approx(2 * 989.4e12, rel=1e-3)
    assert hardware.lookup("NVIDIA A100-SXM4-40GB").peak_flops("fp8") is None


def test_unknown_device_gives_no_peak_and_warns_once(caplog):
    name = "NVIDIA GeForce GTX 480 (no test reads it elsewhere)"  # a name no other test has warned about yet
    with caplog.at_level(logging.WARNING, logger="mfuscope"):
        assert hardware.lookup(name) is None
        assert hardware.lookup(name) is None
    assert len([r for r in caplog.records if "GTX 480" in r.getMessage()]) == 1
    assert hardware.lookup(None) is None
