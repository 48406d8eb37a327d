"""MFU and HFU: the FLOPs the model needed (and the hardware ran) over what the devices could do.

Per step: MFU = model FLOPs per token x tokens / (step time x devices x peak).
Model FLOPs come from the run's model spec (:mod:`mfuscope.flops`: dense, GQA,
SwiGLU, MoE active experts, causal attention) and HFU adds what activation
recomputation runs again.  With no model spec, FLOPs are estimated from the
shapes the trace recorded -- GEMMs (``aten::mm/addmm/bmm/baddbmm``: 2*M*N*K)
and fused attention (``aten::_scaled_dot_product_*``: 4*B*H*Sq*Sk*D forward,
twice that backward, over the whole key length since the trace does not say
causal) -- forward and backward alike, so this is hardware FLOPs; the report
says which.  The peak is the manifest's (hardware
table, or on CPU a measured matmul peak, labelled as such), or for a bare trace
set the hardware table's entry for the device the traces name; without one
there is no MFU, never a guessed peak.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from mfuscope import hardware
from mfuscope.event_table import EventTable
from mfuscope.flops import train_flops_per_token
from mfuscope.manifest import Manifest

_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
_ATTENTION = "aten::_scaled_dot_product_"  # the fused kernels (the public op is their parent)


def _table_peak(events: EventTable) -> tuple[float | None, str | None]:
    """The hardware table's 16-bit dense peak for the device the traces name (traces do not say
    which dtype ran; MFU is conventionally taken against the tensor-core peak)."""
    name = next((m.get("device_name") for m in events.ranks.values() if m.get("device_name")), None)
    acc = hardware.lookup(name)
    peak = acc.peak_flops("bf16") if acc else None
    if peak is None:
        return None, None
    return peak, f"hardware table: {acc.key} 16-bit dense peak ({acc.source}); the trace does not say the dtype"


def compute(step_times: pd.Series, tokens: pd.Series | None, manifest: dict | None,
            events: EventTable | None = None, devices: int | None = None,
            rank_step_times: pd.DataFrame | None = None) -> dict[str, Any]:
    """``step_times``/``tokens``: per step (index = step), seconds and global tokens;
    ``devices``: the job's world size, if known; ``rank_step_times``: rank, step, seconds (for
    MFU per rank: the job's FLOPs shared evenly over the devices, over that rank's own step
    time).  Returns summary fields, ``per_step`` and ``per_rank`` rows.

    FLOPs from the model spec are the job's (global tokens), so they are shared over the job's
    world size; FLOPs from trace shapes are the loaded ranks' own, so they are shared over the
    ranks loaded -- one rank of an 8-rank job is one device's work, not an eighth of it."""
    manifest = Manifest.of(manifest)
    hw = manifest.hardware
    peak, peak_source = hw.get("peak_flops"), hw.get("peak_source")
    if peak is None and events is not None:  # a trace set: the device the traces name
        peak, peak_source = _table_peak(events)
    devices = devices or manifest.raw.get("world_size")
    loaded = len(events.ranks) if events is not None else None
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
    model_flops = hw_flops = None
    if {"dim", "n_layers", "n_heads", "ffn_dim", "vocab_size"} <= spec.keys() and seq_len and have_tokens:
        per_token = train_flops_per_token(spec, seq_len, train.get("recompute") or "none")
        model_flops, hw_flops = tokens * per_token[0], tokens * per_token[1]
        out["flops_source"] = "model spec"
    elif events is not None:
        shaped = shape_flops_per_step(events)
        if len(shaped) and shaped.reindex(step_times.index).notna().any():
            hw_flops = shaped.reindex(step_times.index)
            devices = loaded
            out["flops_source"] = (f"GEMM and attention shapes in the trace (hardware FLOPs) of the {loaded} "
                                   f"rank(s) loaded")
    if hw_flops is None:
        out["mfu_note"] = "no model spec with tokens, and no GEMM shapes in the trace"
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
    if not peak:
        name = next((m.get("device_name") for m in (events.ranks.values() if events is not None else [])
                     if m.get("device_name")), None)
        out["mfu_note"] = (f"no peak FLOP/s for {name!r} (not in the hardware table)" if name
                           else "no peak FLOP/s: the traces do not name their device")
        return out
    capacity = step_times.sum() * devices * peak
    if model_flops is not None:
        out["mfu"] = float(model_flops.sum() / capacity)
    out["hfu"] = float(hw_flops.sum() / capacity)
    if model_flops is None:
        out["mfu_note"] = "estimated from GEMM and attention shapes: this is HFU, not MFU"
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


def shape_flops_per_step(events: EventTable) -> pd.Series:
    """FLOPs of every GEMM and fused-attention operator, from its input shapes, summed per step
    over all ranks."""
    df = events.to_pandas(["kind", "name", "step", "shapes"])
    df = df[(df["kind"] == "cpu_op") & (df["name"].isin(_GEMMS) | df["name"].str.startswith(_ATTENTION))
            & df["shapes"].notna()]
    if df.empty:
        return pd.Series(dtype=float)
    flops = np.array([_attention_flops(n, s) if n.startswith(_ATTENTION) else _gemm_flops(n, s)
                      for n, s in zip(df["name"].astype(str), df["shapes"])], dtype=float)
    return pd.Series(flops, index=df["step"].to_numpy()).groupby(level=0).sum()


def _attention_flops(name: str, shapes: str) -> float:
    """QK^T and PV: 2 * 2*B*H*Sq*Sk*D forward; the backward runs twice that."""
    try:
        dims = json.loads(shapes)
        q, k = (dims[1], dims[2]) if "backward" in name else (dims[0], dims[1])  # backward: grad_out first
        b, h, sq, d = q[-4], q[-3], q[-2], q[-1]
        fwd = 4.0 * b * h * sq * k[-2] * d
        return 2 * fwd if "backward" in name else fwd
    except (ValueError, IndexError, TypeError, KeyError):
        return 0.0


def _gemm_flops(name: str, shapes: str) -> float:
    try:
        dims = json.loads(shapes)
        a, b = (dims[1], dims[2]) if name in ("aten::addmm", "aten::baddbmm") else (dims[0], dims[1])
        batch = float(np.prod(a[:-2])) if len(a) > 2 else 1.0
        return 2.0 * batch * a[-2] * a[-1] * b[-1]
    except (ValueError, IndexError, TypeError, KeyError):
        return 0.0
