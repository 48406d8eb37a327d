"""MFU and HFU: the FLOPs the model needed (and the hardware ran) over what the devices could do.

Per step: MFU = model FLOPs per token x tokens / (step time x devices x peak).
Model FLOPs come from the run's model spec (:mod:`mfuscope.flops`: dense, GQA,
SwiGLU, MoE active experts, causal attention) and HFU adds what activation
recomputation runs again.  With no model spec, FLOPs are estimated from the
shapes the trace recorded -- GEMMs (``aten::mm/addmm/bmm/baddbmm/_scaled_mm``:
2*M*N*K), convolutions (``aten::convolution`` and its backward, from the input
and weight dims and the stride, padding and dilation of ``Concrete Inputs``)
and fused attention (``aten::_scaled_dot_product_*``: 4*B*H*Sq*Sk*D forward,
twice that backward, over the whole key length since the trace does not say
causal) -- forward and backward alike, so this is hardware FLOPs; the report
says which.  On a rank with device work only operators whose work ran inside
the trace count.  The peak is the manifest's (hardware table, or on CPU a
measured matmul peak, labelled as such), or for a bare trace set the hardware
table's entry for the device the traces name, **per dtype**: each operator's
FLOPs against the dense peak of the dtype its inputs have (FP32 -- or TF32 where
the trace's GEMM/convolution kernels run TF32 --, 16-bit, FP8), so HFU is the
share of the step the operators would take at their own peaks.  Without a peak
for a dtype that ran there is no HFU, never a guessed peak.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mfuscope import hardware
from mfuscope.event_table import EventTable
from mfuscope.flops import train_flops_per_token
from mfuscope.manifest import Manifest

from .group_sums import as_str
from .kernel_kinds import is_fp32_simt, per_name

_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
_CONVS = ("aten::convolution", "aten::convolution_backward")
_ATTENTION = "aten::_scaled_dot_product_"  # the fused kernels (the public op is their parent)


@dataclass
class TraceShapes:
    """What MFU reads of the traces themselves, as sums that merge over ranks summarized apart:
    FLOPs per (step, dtype) from operator shapes, kernel time in TF32 and FP32-SIMT kernels, the
    device the traces name, and how many ranks were loaded."""

    by_dtype: pd.DataFrame   # step, dtype, flops
    tf32_ns: float = 0.0
    simt_ns: float = 0.0
    device_name: str | None = None
    ranks: int = 0

    @classmethod
    def of(cls, events: EventTable) -> TraceShapes:
        tf32, simt = _tf32_and_simt_ns(events)
        name = next((m.get("device_name") for m in events.ranks.values() if m.get("device_name")), None)
        return cls(shape_flops_by_dtype(events), tf32, simt, name, len(events.ranks))

    @classmethod
    def merge(cls, parts: list[TraceShapes]) -> TraceShapes:
        frames = [p.by_dtype for p in parts if len(p.by_dtype)]
        by_dtype = (pd.concat(frames).groupby(["step", "dtype"], as_index=False)["flops"].sum() if frames
                    else pd.DataFrame(columns=["step", "dtype", "flops"]))
        return cls(by_dtype, sum(p.tf32_ns for p in parts), sum(p.simt_ns for p in parts),
                   next((p.device_name for p in parts if p.device_name), None), sum(p.ranks for p in parts))


def _table_peak(shapes: TraceShapes) -> tuple[float | None, str | None]:
    """The hardware table's 16-bit dense peak for the device the traces name (traces do not say
    which dtype ran; MFU is conventionally taken against the tensor-core peak)."""
    acc = hardware.lookup(shapes.device_name)
    peak = acc.peak_flops("bf16") if acc else None
    if peak is None:
        return None, None
    return peak, f"hardware table: {acc.key} 16-bit dense peak ({acc.source}); the trace does not say the dtype"


def compute(step_times: pd.Series, tokens: pd.Series | None, manifest: dict | None,
            shapes: TraceShapes | EventTable | None = None, devices: int | None = None,
            rank_step_times: pd.DataFrame | None = None) -> dict[str, Any]:
    """``step_times``/``tokens``: per step (index = step), seconds and global tokens;
    ``devices``: the job's world size, if known; ``rank_step_times``: rank, step, seconds (for
    MFU per rank: the job's FLOPs shared evenly over the devices, over that rank's own step
    time).  Returns summary fields, ``per_step`` and ``per_rank`` rows.

    FLOPs from the model spec are the job's (global tokens), so they are shared over the job's
    world size; FLOPs from trace shapes are the loaded ranks' own, so they are shared over the
    ranks loaded -- one rank of an 8-rank job is one device's work, not an eighth of it.
    ``shapes``: :class:`TraceShapes` of the traces (or their EventTable), None without traces."""
    if isinstance(shapes, EventTable):
        shapes = TraceShapes.of(shapes)
    manifest = Manifest.of(manifest)
    hw = manifest.hardware
    peak, peak_source = hw.get("peak_flops"), hw.get("peak_source")
    if peak is None and shapes is not None:  # a trace set: the device the traces name
        peak, peak_source = _table_peak(shapes)
    devices = devices or manifest.raw.get("world_size")
    loaded = shapes.ranks if shapes is not None else None
    spec = manifest.model or {}
    train = manifest.train
    seq_len = train.get("seq_len") or spec.get("max_seq_len")
    out: dict[str, Any] = {"mfu": None, "hfu": None, "tokens_per_s": None, "tflops_per_device": None,
                           "flops_source": None, "peak_flops": peak, "peak_source": peak_source,
                           "mfu_note": None, "per_step": [], "per_rank": []}
    if not len(step_times):
        out["mfu_note"] = "no timed steps"
        return out
    have_tokens = tokens is not None and tokens.notna().all() and len(tokens) == len(step_times)
    if have_tokens:
        out["tokens_per_s"] = float(tokens.sum() / step_times.sum())
    model_flops = hw_flops = seconds_at_peak = None
    if {"dim", "n_layers", "n_heads", "ffn_dim", "vocab_size"} <= spec.keys() and seq_len and have_tokens:
        per_token = train_flops_per_token(spec, seq_len, train.get("recompute") or "none")
        model_flops, hw_flops = tokens * per_token[0], tokens * per_token[1]
        out["flops_source"] = "model spec"
    elif shapes is not None:
        by_dtype = shapes.by_dtype
        shaped = by_dtype.groupby("step")["flops"].sum() if len(by_dtype) else pd.Series(dtype=float)
        if len(shaped) and shaped.reindex(step_times.index).notna().any():
            hw_flops = shaped.reindex(step_times.index)
            devices = loaded
            out["flops_source"] = (f"GEMM, convolution and attention shapes in the trace (hardware FLOPs) of the "
                                   f"{loaded} rank(s) loaded")
            if not hw.get("peak_flops"):  # a trace set: a peak for each dtype the operators ran in
                peak, peak_source, seconds_at_peak = _dtype_peaks(shapes)
                out["peak_flops"], out["peak_source"] = peak, peak_source
    if hw_flops is None:
        out["mfu_note"] = ("no model spec with tokens, and no GEMM, convolution or attention shapes in the trace "
                           "(record_shapes was off, or none of their work ran in the window)")
        return out
    if model_flops is not None:
        out["model_flops_per_step"] = float(model_flops.median())
    if hw_flops.notna().any():
        out["hardware_flops_per_step"] = float(hw_flops.median())
    achieved = (hw_flops if model_flops is None else model_flops) / step_times
    out["tflops_per_device"] = float((achieved / devices).median() / 1e12) if devices else None
    if not devices:
        out["mfu_note"] = ("world size unknown (no manifest, and the traces carry no distributedInfo.world_size): "
                           "the job's FLOPs cannot be shared over its devices")
        return out
    if not peak and peak_source:  # the device is known, a dtype that ran has no peak for it
        out["mfu_note"] = f"no peak FLOP/s: {peak_source}"
        return out
    if not peak:
        name = shapes.device_name if shapes is not None else None
        out["mfu_note"] = (f"no peak FLOP/s for {name!r} (not in the hardware table)" if name
                           else "no peak FLOP/s: the traces do not name their device")
        return out
    capacity = step_times.sum() * devices * peak
    if model_flops is not None:
        out["mfu"] = float(model_flops.sum() / capacity)
    if seconds_at_peak is not None:  # operators of several dtypes: each against its own peak
        at_peak = seconds_at_peak.reindex(step_times.index)
        hw_flops = at_peak * peak  # in the reported peak's FLOPs, so the ratios below are the dtype-true ones
    out["hfu"] = float(hw_flops.sum() / capacity)
    if model_flops is None:
        out["mfu_note"] = "estimated from GEMM, convolution and attention shapes: this is HFU, not MFU"
    for step, seconds in step_times.items():
        out["per_step"].append({
            "step": int(step), "step_time_s": float(seconds),
            "mfu": None if model_flops is None else float(model_flops[step] / (seconds * devices * peak)),
            "hfu": float(hw_flops[step] / (seconds * devices * peak)) if pd.notna(hw_flops[step]) else None})
    if rank_step_times is not None and len(rank_step_times):
        flops = (model_flops if model_flops is not None else hw_flops).rename("flops")
        rs = rank_step_times.join(flops, on="step").dropna(subset=["flops"])
        for rank, g in rs.groupby("rank"):
            share = g["flops"].sum() / devices / (g["seconds"].sum() * peak)
            out["per_rank"].append({"rank": int(rank), "mfu" if model_flops is not None else "hfu": float(share)})
    return out


_TF32_KERNEL = re.compile(r"tf32|s1688|s16816", re.I)


def _dtype_peaks(shapes: TraceShapes) -> tuple[float | None, str | None, pd.Series | None]:
    """(the 16-bit peak as the reported one, its source, seconds a step the operators would take
    at their own dtype's peak) for a trace set: FP32 operators against the FP32 peak -- or the TF32
    one where the trace's GEMM/convolution kernels run TF32 on tensor cores (more kernel time in
    TF32 kernels than in FP32 SIMT ones) --, 16-bit against the 16-bit peak, FP8 against FP8's,
    operators of unstated dtype against the 16-bit peak (the trace does not say).  No peak (None)
    where a dtype that ran has none for this device."""
    acc = hardware.lookup(shapes.device_name)
    if acc is None:
        return None, None, None
    by_dtype = shapes.by_dtype
    fp32 = "tf32" if shapes.tf32_ns > shapes.simt_ns else "fp32"
    classes = {"fp32": fp32, "bf16": "bf16", "fp8": "fp8", "unknown": "bf16"}
    peaks = {d: acc.peak_flops(classes[d]) for d in by_dtype["dtype"].unique()}
    missing = sorted(classes[d] for d, p in peaks.items() if not p)
    base = acc.peak_flops("bf16")
    if missing or base is None:
        return None, f"hardware table: {acc.key} has no {', '.join(missing) or '16-bit'} peak", None
    at_peak = by_dtype.assign(s=by_dtype["flops"] / by_dtype["dtype"].map(peaks)).groupby("step")["s"].sum()
    ran = ", ".join(f"{classes[d]} {by_dtype['flops'][by_dtype['dtype'] == d].sum() / by_dtype['flops'].sum():.0%}"
                    for d in sorted(peaks))
    unknown = " (operators of unstated dtype at the 16-bit peak)" if "unknown" in peaks else ""
    return base, (f"hardware table: {acc.key}, each operator against its dtype's dense peak ({ran} of the "
                  f"FLOPs){unknown}; {acc.source}"), at_peak


def _tf32_and_simt_ns(events: EventTable) -> tuple[float, float]:
    """Kernel time in TF32 tensor-core kernels and in FP32 SIMT ones."""
    df = events.to_pandas(["kind", "name", "dur_ns"])
    k = df[df["kind"] == "kernel"]
    if k.empty:
        return 0.0, 0.0
    # each name tested once (per_name), the integer durations summed under the masks: no groupby
    dur = k["dur_ns"].to_numpy()
    tf32 = dur[per_name(k["name"], lambda n: bool(_TF32_KERNEL.search(n)), default=False)].sum()
    simt = dur[per_name(k["name"], is_fp32_simt, default=False)].sum()
    return float(tf32), float(simt)


def shape_flops_per_step(events: EventTable) -> pd.Series:
    """FLOPs of every GEMM, convolution and fused-attention operator, from its input shapes, summed
    per step over all ranks (all dtypes)."""
    by_dtype = shape_flops_by_dtype(events)
    return by_dtype.groupby("step")["flops"].sum() if len(by_dtype) else pd.Series(dtype=float)


#: The precision classes a peak is looked up by, from the profiler's ``Input type`` names.
_DTYPE_CLASS = {"float": "fp32", "double": "fp32", "c10::bfloat16": "bf16", "c10::half": "bf16",
                "bfloat16": "bf16", "half": "bf16", "c10::float8_e4m3fn": "fp8", "c10::float8_e5m2": "fp8",
                "c10::float8_e4m3fnuz": "fp8", "c10::float8_e5m2fnuz": "fp8"}


def shape_flops_by_dtype(events: EventTable) -> pd.DataFrame:
    """Columns: step, dtype (fp32, bf16 -- any 16-bit --, fp8, or unknown), flops.

    Operators counted: ``aten::mm/addmm/bmm/baddbmm/_scaled_mm`` (2*M*N*K), fused attention
    (:func:`_attention_flops`), ``aten::convolution`` and ``aten::convolution_backward``
    (:func:`_conv_flops`).  On a rank with device work, an operator counts only if work it launched
    ran on the device inside the trace: an operator recorded while a CUDA graph was captured, and
    not replayed in the window, ran nothing (a decode trace whose device ran 11 us of fills is not
    at 1% HFU)."""
    df = events.to_pandas(["rank", "kind", "name", "step", "shapes", "ts_ns", "dur_ns", "tid", "correlation",
                           "device"])
    shaped = per_name(df["name"], lambda n: n in _GEMMS or n in _CONVS or n.startswith(_ATTENTION), default=False)
    counted = df[(df["kind"] == "cpu_op") & df["shapes"].notna() & shaped]
    if counted.empty:
        return pd.DataFrame(columns=["step", "dtype", "flops"])
    counted = counted[_ran_on_device(df, counted)]
    rows = []
    for name, shapes, step in zip(as_str(counted["name"]), counted["shapes"], counted["step"]):
        dims, types, concrete = _parse_shapes(shapes)
        if dims is None:
            continue
        if name.startswith(_ATTENTION):
            flops = _attention_flops(name, dims)
        elif name in _CONVS:
            flops = _conv_flops(name, dims, concrete)
        else:
            flops = _gemm_flops(name, dims)
        dtype = _DTYPE_CLASS.get(str((types or [""])[0]).lower(), "unknown")
        rows.append((int(step), dtype, flops))
    out = pd.DataFrame(rows, columns=["step", "dtype", "flops"])
    return out.groupby(["step", "dtype"], as_index=False)["flops"].sum()


def _ran_on_device(df: pd.DataFrame, ops: pd.DataFrame) -> np.ndarray:
    """Which of ``ops`` launched device work that the trace holds (all of them on a rank without
    device work: a CPU job's operators are its compute)."""
    ran = np.ones(len(ops), bool)
    kind = df["kind"]
    work = df[kind.isin(["kernel", "comm", "memcpy", "memset"]) & (df["device"] >= 0) & (df["correlation"] >= 0)]
    launches = df[kind.isin(["runtime", "driver"]) & (df["correlation"] >= 0)]
    work_of = dict(tuple(work.groupby("rank")["correlation"]))  # one pass, not a scan per rank
    launches_of = dict(tuple(launches.groupby("rank")))
    for rank, rows in ops.groupby("rank").indices.items():
        if rank not in work_of:
            continue
        mine = ops.iloc[rows]
        lr = launches_of.get(rank, launches.iloc[0:0])
        done = lr[lr["correlation"].isin(set(work_of[rank]))]
        hit = np.zeros(len(rows), bool)
        for tid, lt in done.groupby("tid")["ts_ns"]:
            on = np.flatnonzero(mine["tid"].to_numpy() == tid)
            if not len(on):
                continue
            start = mine["ts_ns"].to_numpy()[on]
            end = start + mine["dur_ns"].to_numpy()[on]
            t = np.sort(lt.to_numpy())
            hit[on] = np.searchsorted(t, end, side="left") > np.searchsorted(t, start, side="left")
        ran[rows] = hit
    return ran


def _parse_shapes(shapes: str) -> tuple[list | None, list | None, list | None]:
    """(Input Dims, Input type, Concrete Inputs) from the ``shapes`` column."""
    try:
        value = json.loads(shapes)
    except ValueError:
        return None, None, None
    if isinstance(value, list):  # tables written before types were kept
        return value, None, None
    return value.get("dims"), value.get("types"), value.get("concrete")


def _attention_flops(name: str, dims: list) -> float:
    """QK^T and PV: 2 * 2*B*H*Sq*Sk*D forward; the backward runs twice that."""
    try:
        q, k = (dims[1], dims[2]) if "backward" in name else (dims[0], dims[1])  # backward: grad_out first
        b, h, sq, d = q[-4], q[-3], q[-2], q[-1]
        fwd = 4.0 * b * h * sq * k[-2] * d
        return 2 * fwd if "backward" in name else fwd
    except (ValueError, IndexError, TypeError, KeyError):
        return 0.0


def _gemm_flops(name: str, dims: list) -> float:
    try:
        a, b = (dims[1], dims[2]) if name in ("aten::addmm", "aten::baddbmm") else (dims[0], dims[1])
        batch = float(np.prod(a[:-2])) if len(a) > 2 else 1.0
        return 2.0 * batch * a[-2] * a[-1] * b[-1]
    except (ValueError, IndexError, TypeError, KeyError):
        return 0.0


def _concrete_ints(concrete: list | None, index: int, n: int, default: int) -> list[int]:
    """A list argument of ``Concrete Inputs`` (``"[2, 2]"``), as n ints; ``default`` where absent."""
    try:
        value = json.loads(concrete[index]) if concrete and concrete[index] not in ("", None) else None
    except (ValueError, IndexError, TypeError):
        value = None
    if isinstance(value, int):
        return [value] * n
    if isinstance(value, list) and len(value) in (1, n) and all(isinstance(v, int) for v in value):
        return value * n if len(value) == 1 else value
    return [default] * n


def _conv_flops(name: str, dims: list, concrete: list | None) -> float:
    """A convolution's multiply-adds x 2, from the input and weight dims and the stride, padding,
    dilation and transposition the profiler records in ``Concrete Inputs`` (without them: stride 1,
    no dilation, "same" padding).  Forward: 2 * N * C_out * C_in/groups * prod(kernel) *
    prod(output size).  ``convolution_backward``: that again for the input's gradient and for the
    weight's, as its output mask asks (grad_output's size is the forward's output size)."""
    try:
        # (grad_output,) input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        # (, output_mask): the argument list of aten::convolution(_backward)
        if name == "aten::convolution_backward":
            grad_out, x, w, arg = dims[0], dims[1], dims[2], 4
        else:
            grad_out, x, w, arg = None, dims[0], dims[1], 3
        spatial = len(x) - 2
        kernel = w[2:]
        stride = _concrete_ints(concrete, arg, spatial, 1)
        dilation = _concrete_ints(concrete, arg + 2, spatial, 1)
        same = [d * (k - 1) // 2 for d, k in zip(dilation, kernel)]
        padding = _concrete_ints(concrete, arg + 1, spatial, -1)
        padding = [s if p < 0 else p for p, s in zip(padding, same)]
        transposed = bool(concrete and len(concrete) > arg + 3 and str(concrete[arg + 3]).lower() == "true")
        if grad_out is not None:
            out = grad_out[2:]
        elif transposed:
            out = x[2:]  # a transposed convolution's work is the forward one's over its input
        else:
            out = [(i + 2 * p - d * (k - 1) - 1) // s + 1
                   for i, p, d, k, s in zip(x[2:], padding, dilation, kernel, stride)]
        fwd = 2.0 * x[0] * w[0] * w[1] * float(np.prod(kernel)) * float(np.prod(out))
        if grad_out is None:
            return fwd
        mask = str(concrete[arg + 6]).lower() if concrete and len(concrete) > arg + 6 else ""
        wanted = [m.strip() == "true" for m in mask.strip("[]").split(",")] if mask.startswith("[") else [True, True]
        return fwd * (int(wanted[0]) + int(len(wanted) > 1 and wanted[1]))
    except (ValueError, IndexError, TypeError, KeyError):
        return 0.0
