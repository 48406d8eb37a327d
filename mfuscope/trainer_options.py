"""The reference trainer's options: every flag defined once, here.

One frozen dataclass is the only definition of each trainer flag (torchtitan's configs are the
model): the trainer's own parser and ``mfuscope train``'s are built from its fields
(:func:`add_arguments`), ``to_argv`` writes the command line back, ``to_manifest`` the run
manifest's ``trainer`` section, and ``from_manifest`` reads a run back as the options that made
it -- what ``mfuscope optimize --apply`` and ``mfuscope ci check --confirm-runs`` rerun.  A change
optimize tries is ``opts.changed(...)``, a :func:`dataclasses.replace`.

A change travels as text, as ``optimize.json`` records it: ``{"prefetch": "true",
"set.recompute": "none"}`` (a field's value as its flag takes it; ``set.KEY`` is a train setting,
``--set KEY=VALUE``).  :meth:`TrainerOptions.change` writes that form, :meth:`changed` reads it.

Adding a flag is adding a field: its type says how argparse reads it, ``metadata`` holds its help
text and whether the manifest records it.  Torch-free.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mfuscope.errors import UserInputError
from mfuscope.layout import INTERLEAVED, SCHEDULES, Degrees


def parse_stage_layers(text: str | None) -> tuple[int, ...] | None:
    """``--stage-layers 5,3`` as (5, 3); None when not given."""
    if not text:
        return None
    try:
        split = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise UserInputError(f"--stage-layers: cannot read {text!r}; layers per pipeline stage, e.g. 5,3") from None
    if any(n < 1 for n in split):
        raise UserInputError(f"--stage-layers {text}: every stage needs at least one layer")
    return split


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["recompute=full", "global_batch=16"]`` -> {"recompute": "full", "global_batch": 16} (JSON values,
    else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserInputError(f"--set {item!r}: use KEY=VALUE, e.g. --set recompute=full")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


CHECKPOINT_MODES = ("sync", "async")
#: How ``mfuscope train`` starts the ranks (``--launcher``); the manifest records it, so that a rerun
#: (``optimize --apply``, ``ci check --confirm-runs``) starts its ranks the same way.
LAUNCHERS = ("torchrun", "fork")


@dataclass(frozen=True)
class CheckpointSpec:
    """``--checkpoint every=N,mode=sync|async,dir=DIR``."""

    every: int
    mode: str
    dir: str


def parse_checkpoint(text: str) -> CheckpointSpec:
    """``every=5,mode=async,dir=ckpt`` (mode defaults to sync); a bad spec is a UserInputError."""
    try:
        kv = dict(part.split("=", 1) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserInputError(f"--checkpoint {text!r}: use every=N,mode=sync|async,dir=DIR") from None
    if unknown := set(kv) - {"every", "mode", "dir"}:
        raise UserInputError(f"--checkpoint {text!r}: unknown key(s) {', '.join(sorted(unknown))}; "
                             "it takes every=N,mode=sync|async,dir=DIR")
    if "every" not in kv or not kv.get("dir"):
        raise UserInputError(f"--checkpoint {text!r}: needs every=N and dir=DIR, e.g. every=5,mode=async,dir=ckpt")
    try:
        every = int(kv["every"])
    except ValueError:
        raise UserInputError(f"--checkpoint {text!r}: every takes a whole number of steps") from None
    mode = kv.get("mode", "sync")
    if every < 1 or mode not in CHECKPOINT_MODES:
        raise UserInputError(f"--checkpoint {text!r}: every must be >= 1 and mode one of "
                             f"{', '.join(CHECKPOINT_MODES)}")
    return CheckpointSpec(every, mode, kv["dir"])


def _text(value: Any) -> str:
    """A value as its flag takes it on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def _flag(default: Any, help: str, *, record: bool = False, launcher: bool = True, requires: str | None = None,
          **argparse_kw: Any) -> Any:
    """A trainer flag: ``record``: the run manifest's ``trainer`` section keeps it (the others are
    recorded elsewhere, resolved -- the layout, the train settings -- or say nothing about the run);
    ``launcher``: ``mfuscope train`` takes it too (it has its own ``--out``); ``requires``: what the
    layout must have for the flag to mean anything (``fsdp``, ``ddp``, ``tp``, or ``same_stages``:
    the pipeline stages it was made for), see :meth:`TrainerOptions.carried_over`."""
    meta = {"help": help, "record": record, "launcher": launcher, "requires": requires, "argparse": argparse_kw}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TrainerOptions:
    config: str = _flag("tiny_dense",
                        "bundled config name (tiny_dense, tiny_moe, gpu_dense_1b, gpu_moe) or a TOML file")
    layout: str = _flag("", "e.g. dp_shard=2,tp=2,pp=2 (dp_shard fills what is left)")
    schedule: str = _flag("1f1b", "pipeline schedule: " + ", ".join(SCHEDULES), record=True, choices=SCHEDULES)
    virtual_stages: int | None = _flag(None, "model chunks per pipeline rank under interleaved_1f1b and zero_bubble "
                                             "(default 2; zbv runs 2, gpipe and 1f1b 1)", record=True,
                                       requires="interleaved", metavar="V")
    microbatches: int | None = _flag(None, "pipeline microbatches per step (default: the config's)")
    steps: int | None = _flag(None, "training steps (default: the config's)")
    dp_mode: str = _flag("fsdp", "how data ranks share the model", record=True, choices=("fsdp", "ddp"))
    reshard_after_forward: bool | None = _flag(
        None, "FSDP2: free the gathered weights after each forward (default: on without pp, off with pp, where it "
              "would re-gather them for every microbatch)", record=True)
    prefetch: bool = _flag(False, "FSDP2: explicit prefetch (each block gathers the next one's weights early, async)",
                           record=True, requires="fsdp")
    keep_last_gathered: bool = _flag(False, "FSDP2: the last block keeps its weights gathered after forward "
                                            "(its backward is next)", record=True, requires="fsdp")
    async_tp: bool = _flag(False, "micro-pipelined TP: tp collectives overlap their GEMMs (CUDA, with "
                                  "--set compile=true)", record=True, requires="tp")
    kernels: str = _flag("eager", "fused: the model's RMSNorm, SwiGLU, RoPE, LM head + loss and MoE routing run "
                                  "mfuscope's Triton kernels (docs/kernels.md)", record=True,
                         choices=("eager", "fused"))
    ddp_bucket_mb: float | None = _flag(None, "DDP: gradient bucket size in MiB (default 25); smaller buckets start "
                                              "reducing during backward", record=True, requires="ddp", metavar="MIB")
    grad_as_bucket_view: bool = _flag(False, "DDP: gradients live in the buckets", record=True, requires="ddp")
    inject: str | None = _flag(
        None, "faults, ';'-separated: compute:rank=3:ms=50[:pass=bwd], stage:stage=1:ms=30, comm:dim=tp:ms=20, "
              "link:dim=dp:gbps=1[:rank=6], loader:ms=200, gc:ms=80, optimizer:ms=40, sync, "
              "hang/die/desync:rank=R:step=S; each also every=N, from=S, jitter_ms=J "
              "(docs/reference_trainer.md)", record=True)
    collective_timeout: float | None = _flag(
        None, "seconds a collective may wait before it fails (set on every process group after a normal "
              "rendezvous): a hung run then ends, and every rank's Flight Recorder dump is written for "
              "`mfuscope hang`", record=True, metavar="SECONDS")
    paced: str | None = _flag(None, "fixed stage times, e.g. fwd_ms=20,bwd_ms=40[,w_ms=20][,per=sample][,scope=layer]",
                              record=True)
    stage_layers: tuple[int, ...] | None = _flag(
        None, "layers per pipeline stage, in stage order, e.g. 5,3 (default: an even cut)", record=True,
        requires="same_stages", metavar="N,N,...")
    overrides: dict[str, Any] = _flag({}, "override a train setting, e.g. --set recompute=full --set dtype=bf16",
                                      metavar="KEY=VALUE")
    window: str | None = _flag(None, "record torch.profiler traces of these steps, e.g. 5:3", record=True,
                               metavar="START:STEPS")
    profile_memory: bool = _flag(False, "record memory in the traced window: Kineto's [memory] events, the memory "
                                        "timeline, on a GPU the allocator's snapshot; and the model states' bytes "
                                        "every step (docs/memory.md)", record=True)
    checkpoint: str | None = _flag(None, "save model, optimizer, data position and RNG with "
                                         "torch.distributed.checkpoint every N steps, sync or async (staged, then "
                                         "written in the background), e.g. every=5,mode=async,dir=ckpt",
                                   record=True, metavar="every=N,mode=sync|async,dir=DIR")
    resume: str | None = _flag(None, "start from the latest complete checkpoint under DIR (or DIR itself), onto "
                                     "this run's layout", record=True, metavar="DIR")
    launcher: str = _flag("torchrun", "how mfuscope train starts the ranks: torchrun (its elastic agent, an "
                                      "interpreter and a torch import a rank), or fork (this node only: one process "
                                      "imports torch once and forks the ranks; quicker to start many CPU ranks, no "
                                      "restarts)", record=True, choices=LAUNCHERS)
    out: str | None = _flag(None, "run directory (steps, communication, GPU samples)", launcher=False)
    force: bool = _flag(False, "replace an earlier run directory at --out", launcher=False)
    result: str | None = _flag(None, "tests: where each rank saves its losses and every step's full gradients",
                               launcher=False)

    # ------------------------------------------------------------------ the command line
    def to_argv(self) -> list[str]:
        """The trainer's command line for these options: every field that differs from its default."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default or (f.name == "overrides" and not value):
                continue
            if f.name == "overrides":
                argv += [a for k, v in value.items() for a in ("--set", f"{k}={_text(v)}")]
            elif f.type in ("bool", "bool | None"):
                argv.append(_flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
            else:
                argv += [_flag_name(f.name), _text(value)]
        return argv

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, launcher: bool = False, **fixed: Any) -> TrainerOptions:
        """From a namespace :func:`add_arguments` filled (with the same ``launcher``); ``fixed``
        sets fields besides."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.metadata["launcher"] or not launcher}
        if "overrides" in values:
            values["overrides"] = parse_overrides(values["overrides"])
        if "stage_layers" in values:  # read here, not by argparse: a bad value is a UserInputError
            values["stage_layers"] = parse_stage_layers(values["stage_layers"])
        return cls(**{**values, **fixed})

    # ------------------------------------------------------------------ the run manifest
    def to_manifest(self) -> dict[str, Any]:
        """The run manifest's ``trainer`` section: how the run was launched, beyond its layout and
        train settings (which the manifest records resolved)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in fields(self) if f.metadata["record"]}

    @classmethod
    def from_manifest(cls, manifest: Any, config: str = "tiny_dense") -> TrainerOptions:
        """The options a reference-trainer run was launched with, from its manifest (a dict or a
        :class:`~mfuscope.manifest.Manifest`), with ``config`` as the model and train settings
        (``mfuscope.optimizers.optimize.write_config`` writes them from the same manifest)."""
        from mfuscope.manifest import Manifest

        m = Manifest.of(manifest)
        recorded = {f.name for f in fields(cls) if f.metadata["record"]}
        values = {k: v for k, v in m.trainer.items() if k in recorded and v is not None}
        if "stage_layers" in values:
            values["stage_layers"] = tuple(int(n) for n in values["stage_layers"])
        values["schedule"] = values.get("schedule") or m.schedule_name or "1f1b"
        return cls(config=config, layout=Degrees.from_sizes(m.layout).text(), microbatches=m.microbatches,
                   **values)

    def carried_over(self, base: TrainerOptions) -> TrainerOptions:
        """These options, made from ``base`` by a change, less each switch whose ``requires`` the new
        layout lacks (the trainer would refuse it): a stage split made for other stages (or chunk count), a chunk
        count under a schedule that has none to choose, FSDP's
        switches without FSDP, DDP's without DDP, async TP without tp."""
        degrees = Degrees.parse(self.layout)
        have = {"fsdp": degrees.dp_shard > 1 and self.dp_mode == "fsdp", "ddp": self.dp_mode == "ddp",
                "tp": degrees.tp > 1, "same_stages": (self.layout, self.schedule) == (base.layout, base.schedule)
                and self.virtual_stages == base.virtual_stages, "interleaved": self.schedule in INTERLEAVED}
        return dataclasses.replace(self, **{f.name: f.default for f in fields(self)
                                            if f.metadata["requires"] and not have[f.metadata["requires"]]})

    # ------------------------------------------------------------------ changes, as optimize records them
    @classmethod
    def change(cls, overrides: Mapping[str, Any] | None = None, **values: Any) -> dict[str, str]:
        """A change in its recorded text form: ``change(prefetch=True)`` -> {"prefetch": "true"},
        ``change(overrides={"recompute": "none"})`` -> {"set.recompute": "none"}."""
        names = {f.name for f in fields(cls)} - {"overrides"}
        if unknown := set(values) - names:
            raise ValueError(f"not trainer options: {', '.join(sorted(unknown))}")
        return {**{k: _text(v) for k, v in values.items()},
                **{f"set.{k}": _text(v) for k, v in (overrides or {}).items()}}

    def changed(self, change: Mapping[str, str]) -> TrainerOptions:
        """These options with a recorded change applied (``set.KEY`` entries join the overrides)."""
        by_name = {f.name: f for f in fields(self)}
        values: dict[str, Any] = {}
        overrides = dict(self.overrides)
        for key, text in change.items():
            if key.startswith("set."):
                overrides.update(parse_overrides([f"{key[4:]}={text}"]))
            elif key in by_name and key != "overrides":
                values[key] = _parse(by_name[key], text)
            else:
                raise UserInputError(f"a change names {key!r}, which is not a trainer option")
        return dataclasses.replace(self, **values, overrides=overrides)


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse(f: dataclasses.Field, text: str) -> Any:
    """A field's value from its command-line text."""
    kind = f.type
    if kind in ("bool", "bool | None"):
        if str(text).lower() not in ("true", "false"):
            raise UserInputError(f"--{f.name.replace('_', '-')}: {text!r} is not true or false")
        return str(text).lower() == "true"
    if kind == "int | None":
        return int(text)
    if kind == "float | None":
        return float(text)
    if f.name == "stage_layers":
        return parse_stage_layers(text)
    return text


def add_arguments(parser: argparse.ArgumentParser, *, launcher: bool = False) -> None:
    """Every trainer flag on ``parser``; ``launcher``: only those ``mfuscope train`` passes on
    (it has its own ``--out`` and ``--force``)."""
    for f in fields(TrainerOptions):
        if launcher and not f.metadata["launcher"]:
            continue
        kw = {"help": f.metadata["help"], **f.metadata["argparse"]}
        if f.name == "overrides":
            parser.add_argument("--set", dest="overrides", action="append", default=[], **kw)
        elif f.type == "bool":
            parser.add_argument(_flag_name(f.name), action="store_true", **kw)
        elif f.type == "bool | None":
            parser.add_argument(_flag_name(f.name), action=argparse.BooleanOptionalAction, default=None, **kw)
        else:
            convert = {"int | None": int, "float | None": float}.get(f.type)
            parser.add_argument(_flag_name(f.name), default=f.default, **({"type": convert} if convert else {}), **kw)
