"""The memory model against hand counts and published figures.

Parameter counts: the published sizes of Llama 2 7B (6,738,415,616) and Llama 3 8B
(8,030,261,248).  Bytes per parameter: the ZeRO paper's and Megatron's counts.  Activations:
Korthikanti et al. 2022's own claims for GPT-3 175B (s=2048, h=12288, a=96, t=8): selective
recomputation saves about 70% of the activations, and with sequence parallelism about 5x against
tensor parallelism alone.
"""
from __future__ import annotations

import pytest

from mfuscope.optimizers.cost import memory
from mfuscope.optimizers.spec import Layout, ModelSpec

LLAMA2_7B = ModelSpec(n_layers=32, dim=4096, n_heads=32, ffn_dim=11008, vocab_size=32000)
LLAMA3_8B = ModelSpec(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
GPT3 = ModelSpec(n_layers=96, dim=12288, n_heads=96, ffn_dim=4 * 12288, vocab_size=51200, mlp="gelu")
TOY = ModelSpec(n_layers=4, dim=8, n_heads=2, ffn_dim=16, vocab_size=10)


def test_parameter_counts_are_the_published_ones():
    assert LLAMA2_7B.total_params() == 6_738_415_616
    assert LLAMA3_8B.total_params() == 8_030_261_248


def test_toy_parameters_per_gpu_by_hand():
    # per layer: q,k,v,o 4*8*8 = 256, SwiGLU 3*8*16 = 384, two norms 16 -> 656; embedding and head
    # 10*8 each, final norm 8: 4*656 + 168 = 2792
    assert TOY.total_params() == 2792
    assert memory.params_per_gpu(TOY, Layout()) == 2792
    # tp=2 splits attention and MLP (640 of 656 per layer) and the vocab: 4*(320+16) + 40 + 40 + 8
    assert memory.params_per_gpu(TOY, Layout(tp=2)) == 4 * 336 + 88
    # pp=2: 2 layers a stage; the first holds the embedding (80), the last the head and norm (88)
    assert memory.params_per_gpu(TOY, Layout(pp=2)) == 2 * 656 + 88


@pytest.mark.parametrize("layout, per_param", [
    (Layout(dp_replicate=4), 2 + 4 + 12),                 # DDP: everything replicated
    (Layout(dp_replicate=4, zero=1), 2 + 4 + 12 / 4),     # distributed optimizer: Megatron's 6 + 12/dp
    (Layout(dp_replicate=4, zero=2), 2 + (4 + 12) / 4),
    (Layout(dp_shard=4), (4 + 4 + 8) / 4),                # FSDP: fp32 master, grad and moments sharded
])
def test_bytes_per_parameter_per_sharding(layout, per_param):
    m = memory.estimate(TOY, layout, seq_len=8)
    assert (m.weights_bytes + m.grads_bytes + m.optimizer_bytes) == pytest.approx(per_param * 2792)


def test_fsdp_gathers_two_layers_or_the_stage():
    per_layer_16bit = 2 * 2792 / 4
    assert memory.estimate(TOY, Layout(dp_shard=2), 8).gathered_bytes == pytest.approx(2 * per_layer_16bit)
    staged = memory.estimate(TOY, Layout(dp_shard=2, pp=2), 8)  # under pp FSDP keeps the stage gathered
    assert staged.gathered_bytes == pytest.approx(2 * memory.params_per_gpu(TOY, Layout(pp=2)))


def test_activations_follow_korthikanti_claims_for_gpt3():
    t, s = 8, 2048
    full = memory.activation_bytes_per_layer(GPT3, Layout(tp=t, sequence_parallel=True), s, flash_attention=False)
    selective = memory.activation_bytes_per_layer(GPT3, Layout(tp=t, recompute="selective"), s)
    tp_only = memory.activation_bytes_per_layer(GPT3, Layout(tp=t, sequence_parallel=False), s, flash_attention=False)
    assert 1 - selective / full == pytest.approx(0.70, abs=0.01)   # "reduces activation memory by 70%"
    assert tp_only / selective == pytest.approx(5.4, abs=0.1)      # "by 5x" with sequence parallelism
    # and the absolute formula, sbh/t * 34 for sequence parallel + selective, in bytes
    assert selective == 34 * s * 1 * 12288 / t
    assert memory.activation_bytes_per_layer(GPT3, Layout(tp=t, recompute="full"), s) == 2 * s * 12288 / t


@pytest.mark.parametrize("layout, held", [
    (Layout(pp=4, microbatches=16, schedule="gpipe"), 16),
    (Layout(pp=4, microbatches=16), 4),
    (Layout(pp=4, microbatches=2), 2),
    (Layout(pp=4, vpp=2, microbatches=16, schedule="interleaved_1f1b"), 4 * (1 + 3 / 8)),
    (Layout(pp=4, vpp=2, microbatches=16, schedule="zbv"), 4),
    (Layout(microbatches=8), 1),
])
def test_microbatches_in_flight_per_schedule(layout, held):
    assert memory.microbatches_in_flight(layout) == pytest.approx(held)


def test_later_1f1b_stages_hold_fewer_microbatches_and_gpipe_holds_all():
    """1F1B: stage s runs p - s forwards before its first backward (its warm-up), so it holds p - s
    microbatches; the last stage one.  GPipe runs every forward first on every stage."""
    one_f_one_b, gpipe = Layout(pp=4, microbatches=8), Layout(pp=4, microbatches=8, schedule="gpipe")
    assert [memory.microbatches_in_flight(one_f_one_b, s) for s in range(4)] == [4, 3, 2, 1]
    assert [memory.microbatches_in_flight(gpipe, s) for s in range(4)] == [8, 8, 8, 8]


def test_fits_verdicts():
    h100 = 80e9
    # torchtitan's Llama 3 8B on 8 H100s (FSDP, 8k tokens a GPU), with activation checkpointing:
    # 16 bytes a parameter over 8 ranks (16 GB), each layer's input kept (2 GB), the loss's logits
    assert memory.estimate(LLAMA3_8B, Layout(dp_shard=8, recompute="full"), 8192, device_bytes=h100).fits
    # 70B in DDP on one GPU: 18 bytes a parameter alone is 16x the device
    llama70 = ModelSpec(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256)
    assert not memory.estimate(llama70, Layout(), 8192, device_bytes=h100).fits
    assert memory.estimate(TOY, Layout(), 8).fits is None  # no device given, no verdict


def test_illegal_layouts_name_every_broken_rule():
    problems = Layout(tp=3, pp=33, ep=2).problems(LLAMA3_8B, 8192)
    assert any("tp=3" in p for p in problems) and any("pp x vpp" in p for p in problems)
    assert any("dense model" in p for p in problems)
    with pytest.raises(ValueError, match="tp=3"):
        memory.estimate(LLAMA3_8B, Layout(tp=3), 8192)


def test_spec_from_a_run_manifest():
    spec = ModelSpec.from_manifest({"dim": 8, "n_layers": 4, "n_heads": 2, "ffn_dim": 16, "vocab_size": 10,
                                    "max_seq_len": 64, "n_kv_heads": None})
    assert spec == TOY


def test_the_compiled_block_keeps_what_the_count_says(tmp_path):
    """torch.compile's Llama block, counted from its real autograd graph (one reference-trainer block
    under bf16 autocast on the CPU, ``benchmarks/saved_activations.py``), against the memory model's
    compiled count r h + e (5h + 2k + 3f) + 4a + 8 a token (r = 4: the fp32 residual stream of
    autocast over fp32 weights).  tiny_dense: h 64, k 32, f 128, a 4 -> 256 + 2 (320 + 64 + 384) +
    16 + 8 = 1,816 bytes.  The count was read off the gpu_dense_1b block (66,632 bytes); this
    checks that it carries over to other widths and that torch's partitioner still keeps that set."""
    pytest.importorskip("torch", reason="torch is in the [dev] extra; not installed")
    import json
    import subprocess
    import sys
    from pathlib import Path

    from mfuscope.reference_trainer.config import load_config

    cfg = load_config("tiny_dense")
    model = ModelSpec.from_manifest(cfg.model.spec())
    counted = memory.activation_bytes_per_layer(model, Layout(micro_batch=1, microbatches=1), 1, True, 2,
                                                compiled=True, residual_bytes=4)
    assert counted == 1816
    # The partitioner Inductor runs, without its code generation (the same saved set: 66,632 and
    # 1,816 bytes either way; 7 s instead of a minute), in a process of its own: compile workers
    # started in the test process would be inherited by the ranks later tests fork, and hang them.
    out = Path(tmp_path) / "saved.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "saved_activations.py"
    args = ["--config", "tiny_dense", "--seq", "48", "--backend", "aot_eager_decomp_partition", "--json", str(out)]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(out.read_text())["compiled"]["bytes_per_token"] == counted


def test_a_compiled_run_is_predicted_with_what_its_graph_keeps():
    """gpu_dense_1b on one GPU (8 x 4,096 tokens, bf16 autocast over fp32 weights): the compiled
    count, 66,632 bytes a token and layer x 32,768 tokens x 24 layers, plus the final norm's three
    bf16 h-wide tensors and its fp32 inverse RMS (12,292 bytes a token) = 52.8 GB of activations,
    against eager's 64.9 GB; an H200 run with torch.compile peaked at 77.6 GiB, which the compiled estimate
    meets within 15% (87.9 GiB) and the eager one did not (99.2 GiB)."""
    from mfuscope.reference_trainer.config import load_config

    cfg = load_config("gpu_dense_1b")
    model = ModelSpec.from_manifest(cfg.model.spec())
    layout = Layout(micro_batch=8, microbatches=1)
    compiled = memory.estimate(model, layout, 4096, compiled=True)
    eager = memory.estimate(model, layout, 4096)
    assert compiled.activations_bytes == pytest.approx((66_632 * 24 + 2 * 3 * 2048 + 4) * 32_768)
    measured_gib = 77.6
    assert abs(measured_gib / (compiled.total_bytes / memory.GiB) - 1) <= 0.15
    assert abs(measured_gib / (eager.total_bytes / memory.GiB) - 1) > 0.15
