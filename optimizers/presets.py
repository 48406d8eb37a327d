"""Named model specs for ``mfuscope plan --model``: published architectures and the trainer's configs.

Shapes from each model's published config (Hugging Face ``config.json`` of the
released weights).  DeepSeek-V3 is an approximation the spec can express:
its multi-head latent attention is modelled as multi-head attention of the
same width, and its three leading dense layers are MoE layers too (the routed
experts carry nearly all parameters: about 700B against the published 671B).
"""
from __future__ import annotations

import json
from pathlib import Path

import tomllib

from mfuscope.errors import UserInputError

from .spec import ModelSpec

TRAINER_CONFIGS = Path(__file__).resolve().parent.parent / "reference_trainer" / "configs"

PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256),
    "llama3-70b": ModelSpec(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256),
    "llama3-405b": ModelSpec(n_layers=126, dim=16384, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                             vocab_size=128256),
    "mixtral-8x7b": ModelSpec(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                              n_experts=8, top_k=2),
    # DeepSeek-V3's config.json: 256 routed experts of 2048 (top 8) and one shared expert of 2048
    # (n_shared_experts 1), routed from 4 of 8 expert groups (topk_group 4, n_group 8); its MLA
    # attention and its first three dense layers are not modelled
    "deepseek-v3": ModelSpec(n_layers=61, dim=7168, n_heads=128, ffn_dim=2048, vocab_size=129280,
                             n_experts=256, top_k=8, shared_ffn_dim=2048, router_groups=8, router_group_topk=4),
}


def names() -> list[str]:
    trainer = sorted(p.stem for p in TRAINER_CONFIGS.glob("*.toml")) if TRAINER_CONFIGS.is_dir() else []
    return sorted(PRESETS) + trainer


def load(name_or_path: str) -> ModelSpec:
    """A preset name, a reference-trainer config name (``tiny_dense``), or a JSON file of
    ``ModelSpec`` fields (``n_layers``, ``dim``, ``n_heads``, ``ffn_dim``, ``vocab_size``, ...)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    toml = TRAINER_CONFIGS / f"{name_or_path}.toml"
    path = Path(name_or_path)
    if toml.is_file():
        with toml.open("rb") as f:
            return ModelSpec.from_manifest(tomllib.load(f).get("model", {}))
    if path.suffix == ".json":
        try:
            return ModelSpec.from_manifest(json.loads(path.read_text()))
        except FileNotFoundError:
            raise UserInputError("no such model spec file", path) from None
        except (ValueError, TypeError) as e:
            raise UserInputError(f"not a model spec ({e}); give n_layers, dim, n_heads, ffn_dim, vocab_size",
                                 path) from None
    raise UserInputError(f"unknown model {name_or_path!r}: one of {', '.join(names())}, or a .json spec")
