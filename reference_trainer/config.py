"""Model and training configuration: dataclasses loaded from TOML files in ``configs/``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from mfuscope.errors import UserInputError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass
class ModelConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0          # 0: dense SwiGLU feed-forward; >0: MoE in every layer
    top_k: int = 2
    aux_loss_coef: float = 0.01  # load-balancing loss weight

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise UserInputError(f"dim {self.dim} / heads {self.n_heads} / kv heads {self.n_kv_heads} do not divide")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise UserInputError(f"top_k {self.top_k} must be in 1..n_experts ({self.n_experts})")

    def spec(self) -> dict[str, Any]:
        """The model spec for the run manifest (FLOPs formulas read it)."""
        return {"family": "llama-moe" if self.n_experts else "llama", **dataclasses.asdict(self)}


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    seq_len: int = 32
    global_batch: int = 8      # sequences per optimizer step, over all data-parallel ranks
    microbatches: int = 1      # pipeline microbatches per step
    grad_accum: int = 1
    steps: int = 5
    lr: float = 1e-3
    optimizer: str = "adamw"   # adamw | sgd (tests: with SGD the update is lr x the gradient, nothing amplified)
    seed: int = 0
    dtype: str = "fp32"        # fp32 | bf16 (bf16 on GPU)
    recompute: str = "none"    # none | selective | full
    compile: bool = False
    cuda_graphs: bool = False  # with compile: each block compiled mode="reduce-overhead", replayed as a CUDA graph
    # with tp: norms and residuals sharded on the sequence (Megatron's --sequence-parallel)
    sequence_parallel: bool = True
    data: str = "text"         # text (the small corpus shipped in-tree: learnable) | synthetic (uniform tokens)

    def validate(self) -> None:
        self.model.validate()
        if self.recompute not in ("none", "selective", "full"):
            raise UserInputError(f"recompute must be none, selective or full, not {self.recompute!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise UserInputError(f"optimizer must be adamw or sgd, not {self.optimizer!r}")
        if self.data not in ("text", "synthetic"):
            raise UserInputError(f"data must be text or synthetic, not {self.data!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise UserInputError(f"dtype must be fp32 or bf16, not {self.dtype!r}")
        if self.seq_len > self.model.max_seq_len:
            raise UserInputError(f"seq_len {self.seq_len} exceeds max_seq_len {self.model.max_seq_len}")


def load_config(name_or_path: str, **overrides: Any) -> TrainConfig:
    """``tiny_dense`` (a file in configs/) or a path to a TOML file; ``overrides`` set train fields."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
        raise UserInputError(f"no such config (bundled: {known})", path)
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserInputError(f"invalid TOML: {e}", path) from None
    try:
        model = ModelConfig(**doc.get("model", {}))
        cfg = TrainConfig(model=model, **doc.get("train", {}))
    except TypeError as e:
        raise UserInputError(f"unknown setting: {e}", path) from None
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)} - {"model"})
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(TrainConfig) if f.name != "model")
        raise UserInputError(f"unknown train setting {', '.join(unknown)} (settings: {known})")
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    cfg.validate()
    return cfg
