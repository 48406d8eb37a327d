"""The cost model's attention core and context parallelism: the attention kernel's rate by key
length, a ring's short blocks and per-step sends, an unbalanced causal split, Ulysses'
all-to-alls, and the rows that run them.

Expected values come from outside the model: the key-length curve from the table of measured
FlashAttention-3 and Triton-FA2 rates it was fitted to (pytorch/benchmark #2391), the ring's and
the causal split's work from counting blocks by hand, Ulysses' bytes from the tensors it moves.
"""
from __future__ import annotations

import pytest

from mfuscope.optimizers import published
from mfuscope.optimizers.cost.comm import Links
from mfuscope.optimizers.cost.compute import attention_block_efficiency, stage_compute
from mfuscope.optimizers.model import predict
from mfuscope.optimizers.spec import Layout, ModelSpec, Training
from mfuscope.optimizers.system import Profile, system

from .helpers import CORPUS

MOE_ROWS = CORPUS / "published" / "calibration_moe_fp8.csv"

#: 8 layers of a Llama-style block: 32 query heads of 128 in 8 key-value groups.
LLAMA = ModelSpec(n_layers=8, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
IDEAL = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1.0, scale_out=1.0)


@pytest.mark.parametrize("rates", [
    # tokens: TFLOP/s forward on H100, head dim 128, batch x length = 16k (pytorch/benchmark #2391)
    {512: 430.32, 1024: 517.099, 2048: 565.544, 4096: 590.233, 8192: 614.234, 16384: 620.73},   # FA3
    {512: 328.882, 1024: 389.723, 2048: 433.721, 4096: 458.359, 8192: 470.732, 16384: 476.753},  # Triton FA2
], ids=["flash-attention-3", "triton-fa2"])
def test_the_key_length_curve_is_the_measured_tables(rates):
    """Each length's rate over the 16k one, as measured, within 2% (the fit's worst point, 1k of
    FA3, is 1.3% off; a curve without the knee would be 31% off at 512)."""
    for tokens, rate in rates.items():
        assert attention_block_efficiency(tokens) == pytest.approx(rate / rates[16384], rel=0.02), tokens


def _attention_s(cp: int, **training) -> float:
    layout = Layout(cp=cp, dp_shard=8 // cp)
    t = Training(seq_len=16384, **training)
    return stage_compute(LLAMA, layout, t, system("H100"), IDEAL, layers=1, with_head=False).attention_fwd_s


def test_a_rings_blocks_are_short_and_an_unbalanced_split_waits_for_its_last_rank():
    """16k tokens on cp=4.  An all-gather's call sees all 16,384 keys (the curve's 1.0).  A ring's
    slowest rank runs the diagonal over its two chunks (4,096 keys) and three steps over one chunk
    (2,048), each a quarter of the work: 1 / (1/4 x (1/e(4096) + 3/e(2048))), e(n) = n/(n+240) over
    16384/(16384+240).  A contiguous causal split gives the last rank 3 blocks and a half of the
    16/2 = 8 of the whole, against 2 each when balanced: 7/4."""
    e = lambda n: (n / (n + 240)) / (16384 / (16384 + 240))  # noqa: E731
    gathered = _attention_s(4)
    assert _attention_s(4, cp_comm="p2p") / gathered == pytest.approx((1 / e(4096) + 3 / e(2048)) / 4, rel=1e-9)
    assert _attention_s(4, cp_load_balance=False) / gathered == pytest.approx(7 / 4, rel=1e-9)
    assert _attention_s(4, cp_comm="a2a", cp_load_balance=False) == pytest.approx(gathered, rel=1e-9)
    # FlashAttention-3 at H100's measured 620.7 against FA2's 335 TFLOP/s (the 16k rates)
    assert gathered / _attention_s(4, attention_kernel="fa3") == pytest.approx(620.7 / 335, rel=1e-9)
    assert system("A100").attention_ceiling("fa3") == system("A100").attention_ceiling("fa2")  # no FA3 on Ampere


def test_ulysses_moves_queries_keys_values_and_the_output_exposed():
    """cp=2 Ulysses, one microbatch of 16k tokens: each rank holds 8,192 tokens and sends, per
    layer and pass, Q, K and V (32 + 2 x 8 heads of 128) then the output (32 heads), bf16, in two
    all-to-alls of the cp group, none hidden; forward and backward alike.  A cp that does not
    divide the 32 heads is refused."""
    layout = Layout(cp=2, dp_shard=4)
    training = Training(seq_len=16384, cp_comm="a2a")
    h100 = system("H100")
    links = Links(layout, h100, IDEAL)
    tokens = 8192
    per_pass = (links.seconds("cp", "all_to_all", tokens * (32 + 16) * 128 * 2)
                + links.seconds("cp", "all_to_all", tokens * 32 * 128 * 2))
    leaves = predict(LLAMA, layout, training, h100, IDEAL).leaves
    assert leaves["comm/cp/all_to_all"] == pytest.approx(2 * LLAMA.n_layers * per_pass, rel=1e-9)
    with pytest.raises(ValueError, match="Ulysses"):
        predict(LLAMA, Layout(cp=8, tp=8), training, h100, IDEAL)  # 32 / 8 = 4 heads a tp rank, over 8


def test_a_rings_sends_hide_behind_its_steps_until_the_link_is_slower():
    """cp=2 in one node (a ring of one send a pass forward, K and V of 8,192 tokens x 8 heads of
    128): over NVLink at full speed the send hides behind the step's half of the attention; at a
    thousandth of it, what sticks out is the send less that half."""
    layout = Layout(cp=2, dp_shard=4)
    training = Training(seq_len=16384, cp_comm="p2p")
    h100 = system("H100")
    fast = predict(LLAMA, layout, training, h100, IDEAL).leaves
    assert fast.get("comm/cp/send_recv", 0.0) == 0.0
    slow_profile = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1e-3, scale_out=1e-3)
    slow = predict(LLAMA, layout, training, h100, slow_profile).leaves
    send = Links(layout, h100, slow_profile).seconds("cp", "send_recv", 2 * 8192 * 8 * 128 * 2, n=2)
    step = _attention_s(2, cp_comm="p2p") / 2
    # forward: one send behind one step; backward: K, V and their gradients behind 2.5x the step
    expected = LLAMA.n_layers * ((send - step) + (2 * send - 2.5 * step))
    assert slow["comm/cp/send_recv"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.skipif(not MOE_ROWS.is_file(), reason=f"no {MOE_ROWS} (set MFUSCOPE_CORPUS)")
def test_megatron_core_rows_run_transformer_engines_attention_and_ring():
    """The Megatron-Core rows (their notes say MCore) run TE's fused attention and its p2p ring;
    torchtitan's and llm-foundry's FA2 and the all-gather."""
    cases, _ = published.load_cases(MOE_ROWS)
    for c in cases:
        mcore = c.source == "liu"
        assert (c.training.attention_kernel, c.training.cp_comm) == (("fa3", "p2p") if mcore else ("fa2", "all_gather"))
