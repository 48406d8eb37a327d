"""The cost model on mixture-of-experts rows: Megatron-LM's FLOP convention, experts under tensor
parallelism, MoE Parallel Folding, shared experts and the MLP each family runs.

Expected values are hand counts: Megatron's formula worked term by term for Mixtral 8x22B
(the dims its authors' config gives), the GEMM rows a GPU computes from the routing arithmetic,
and the node a folded expert group lands on from the rank order.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import replace

import pytest

from mfuscope.flops import train_flops_per_token
from mfuscope.optimizers import published
from mfuscope.optimizers.cost import comm
from mfuscope.optimizers.cost.compute import layer_gemms
from mfuscope.optimizers.model import spec_dict
from mfuscope.optimizers.spec import Layout, ModelSpec, Training

from .helpers import CORPUS

MOE_ROWS = CORPUS / "published" / "calibration_moe_fp8.csv"
needs_rows = pytest.mark.skipif(not MOE_ROWS.is_file(), reason=f"no {MOE_ROWS} (set MFUSCOPE_CORPUS)")

#: Mixtral 8x22B: 56 layers, hidden 6144, 48 heads in 8 key-value groups, experts of 16384 (SwiGLU),
#: 8 experts top-2, vocabulary 32000.
MIXTRAL = ModelSpec(n_layers=56, dim=6144, n_heads=48, n_kv_heads=8, ffn_dim=16384, vocab_size=32000,
                    n_experts=8, top_k=2)


def test_megatrons_flop_count_is_worked_by_hand_for_mixtral():
    """12 L h^2 [(1 + g/a + s/h) q/h + (f/h) k 3/2 + V/(2 L h)] per token, s = 4096:
    attention (1 + 8/48 + 4096/6144) = 1.833333; experts 16384/6144 x 2 x 1.5 = 8;
    logits 32000 / (2 x 56 x 6144) = 0.046503 (32000 is a multiple of 128 x 2: no padding at tp=2);
    12 x 56 x 6144^2 = 25,367,150,592; x 9.879836 = 2.506233e11."""
    assert published.megatron_flops_per_token(MIXTRAL, 4096, tp=2) == pytest.approx(2.506233e11, rel=1e-6)
    # at tp=4 the vocabulary pads to 32256 (a multiple of 512): the logits term grows by 256/32000
    padded = 25_367_150_592 * (1.833333333 + 8 + 32256 / (2 * 56 * 6144))
    assert published.megatron_flops_per_token(MIXTRAL, 4096, tp=4) == pytest.approx(padded, rel=1e-8)


def test_megatrons_count_is_ours_without_the_router_with_full_attention():
    """Megatron counts attention over the whole sequence and leaves the router out; mfuscope's
    count with ``causal=False`` is the same arithmetic plus the router's 6 h E a layer and token --
    for a GPT layer (Korthikanti's 72 B s L h^2 (1 + s/6h + V/12hL)) and for a shared expert."""
    ours, _ = train_flops_per_token(spec_dict(MIXTRAL, causal=False), 4096)
    router = 6 * MIXTRAL.dim * MIXTRAL.n_experts * MIXTRAL.n_layers
    assert ours - router == pytest.approx(published.megatron_flops_per_token(MIXTRAL, 4096, tp=2), rel=1e-12)
    gpt = ModelSpec(n_layers=96, dim=12288, n_heads=96, ffn_dim=4 * 12288, vocab_size=51200, mlp="gelu")
    s, L, h, V = 2048, 96, 12288, 51200
    assert published.megatron_flops_per_token(gpt, s) == pytest.approx(
        72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)), rel=1e-12)
    qwen = ModelSpec(n_layers=28, dim=3584, n_heads=28, n_kv_heads=4, ffn_dim=2560, vocab_size=151936,
                     n_experts=64, top_k=8, shared_ffn_dim=20480)
    ours, _ = train_flops_per_token(spec_dict(qwen, causal=False), 4096)
    assert ours - 6 * 3584 * 64 * 28 == pytest.approx(published.megatron_flops_per_token(qwen, 4096), rel=1e-12)


@needs_rows
def test_the_megatron_core_rows_are_read_with_their_convention():
    """Liu et al.'s Mixtral 8x22B with folding on 128 H100: 487.7 TFLOP/s (its MFU 0.493 x 989.5)
    over the 2.506233e11 FLOPs a token counted above is 1,945.9 tokens/s per GPU.  The row says "w/ Folding"
    (its ep=8 groups fold over tp); Qwen2's shared expert of 20480 comes from its notes; Mixtral
    and Qwen run SwiGLU, MPT a GELU MLP; Llama3-8x70B, whose top-k the paper does not state, is
    refused with that reason."""
    cases, skipped = published.load_cases(MOE_ROWS)
    rows = list(csv.DictReader(io.StringIO(MOE_ROWS.read_text())))
    folded = next(c for c in cases if c.name == "Mixtral 8x22B" and c.layout.ep == 8 and c.layout.cp == 1
                  and rows[c.row]["dtype_key"] == "bf16")
    assert folded.layout.expert_folding and folded.model.mlp == "swiglu"
    assert folded.measured_tps == pytest.approx(487.7e12 / 2.506233e11, rel=1e-6)
    qwen = next(c for c in cases if c.name.startswith("Qwen2"))
    assert qwen.model.shared_ffn_dim == 20480 and qwen.model.mlp == "swiglu"
    assert {c.model.mlp for c in cases if c.name.startswith("MPT")} == {"gelu"}
    llama_moe = [i for i, r in enumerate(rows) if r["model"] == "Llama3-8x70B"]
    assert llama_moe and all("top-k" in skipped[i] for i in llama_moe)
    # Llama 4 Scout's "1 shared expert, each SwiGLU 8192"; B200s "power limited (limit not stated)"
    # cannot be modelled: refused, not scored
    assert {c.model.shared_ffn_dim for c in cases if c.name.startswith("Llama 4 Scout")} == {8192}
    capped = [i for i, r in enumerate(rows) if "limit not stated" in r["gpu"]]
    assert capped and all("power" in skipped[i] for i in capped)


def test_experts_split_the_tokens_over_tensor_parallel_ranks():
    """Experts are not split over tp (expert tensor parallelism 1): each of the 2 tp ranks routes
    its own half of a 4096-token microbatch, so with ep=4 and 8 experts top-2 a GPU's 2 experts see
    2048 x 2 x 4 / 8 = 2048 rows each, and its expert GEMMs total 2048 x 2 rows x 3 matrices of
    6144 x 16384 x 2 FLOPs; the dense projections stay split over tp by columns."""
    layout = Layout(tp=2, ep=4, dp_replicate=4)
    gemms = {g.name: g for g in layer_gemms(MIXTRAL, layout, 4096)}
    up, down = gemms["expert_up"], gemms["expert_down"]
    assert (up.m, up.count, down.m) == (2048, 2, 2048)
    assert up.flops + down.flops == pytest.approx(2 * 2048 * 2 * 3 * 6144 * 16384)
    assert gemms["qkv"].m == 4096 and gemms["qkv"].n == (6144 + 2 * 8 * 128) / 2


def test_folded_expert_groups_are_legal_and_stay_in_the_node():
    """tp=4 x dp=4 with ep=8: the data ranks (4) cannot hold 8 experts' groups, folded over
    tp x dp (16 ranks) they can; a folded ep group of 8 takes ranks 0-7, one 8-GPU node (NVLink),
    where the unfolded ep=4 beside tp=4 spans ranks 0, 4, 8, 12: four nodes."""
    plain = Layout(tp=4, dp_replicate=4, ep=8)
    assert any("folding" in p for p in plain.problems(MIXTRAL, 4096))
    folded = Layout(tp=4, dp_replicate=4, ep=8, expert_folding=True)
    assert folded.problems(MIXTRAL, 4096) == []
    assert comm.placements(folded, 8)["ep"].tier == "scale_up"
    assert comm.placements(Layout(tp=4, dp_replicate=4, ep=4), 8)["ep"].tier == "scale_out"


@needs_rows
def test_held_out_error_is_reported_by_family():
    """Each row is predicted by the fit without its own source; a family's MAPE is the mean of its
    rows' errors.  Two small sources (Korthikanti's 11 dense bf16 A100 rows, llm-foundry's 11 dense
    MPT rows on H100, bf16 and FP8) and a short search keep it quick: the Ampere family is exactly
    Korthikanti's rows held out, Hopper exactly llm-foundry's, and dense is all 22."""
    from mfuscope.optimizers import calibrate

    cases = [c for c in published.load_cases(CORPUS / "published" / "calibration.csv")[0] if c.source == "korthikanti"]
    cases += [c for c in published.load_cases(MOE_ROWS)[0] if c.source == "mosaicml"]
    assert calibrate.families(cases[0]) == ("dense", "bf16", "Ampere")
    assert {calibrate.families(c)[1] for c in cases[11:]} == {"bf16", "fp8"}
    sources, families, _ = calibrate.leave_one_source_out_by_family(cases, rounds=1, grid=3)
    assert families["Ampere"]["held_out_mape"] == pytest.approx(sources["korthikanti"]["held_out_mape"], rel=1e-12)
    assert families["Hopper"]["held_out_mape"] == pytest.approx(sources["mosaicml"]["held_out_mape"], rel=1e-12)
    assert families["dense"]["rows"] == 22 and families["dense"]["held_out_mape"] == pytest.approx(
        (sources["korthikanti"]["held_out_mape"] + sources["mosaicml"]["held_out_mape"]) / 2, rel=1e-12)
    assert families["fp8"]["rows"] + families["bf16"]["rows"] == 22


@needs_rows
def test_calibrate_lists_the_rows_its_held_out_fits_predict_worst(tmp_path, capsys):
    """``calibrate`` on published rows says which rows make a source's error: each row's held-out
    prediction (``--json``: ``held_out_rows``, furthest first; the text: the worst few).  Korthikanti's
    rows with a twin of the first whose measured throughput is doubled, beside llm-foundry's: the
    twin is the same run to the model and is held out by the same fit (the one without Korthikanti),
    so its prediction is the original's and its ratio half of it -- whatever the model says."""
    from mfuscope import cli
    from mfuscope.optimizers.commands import WORST_ROWS

    def rows_of(path, source):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            return reader.fieldnames, [r for r in reader if r["source"].lower().startswith(source)]

    fields, kept = rows_of(CORPUS / "published" / "calibration.csv", "korthikanti")
    twin = dict(kept[0], measured_tokens_per_s_per_gpu=str(2 * float(kept[0]["measured_tokens_per_s_per_gpu"])))
    dense, foundry = tmp_path / "dense.csv", tmp_path / "foundry.csv"
    for path, (names, rows) in ((dense, (fields, kept + [twin])), (foundry, rows_of(MOE_ROWS, "mosaicml"))):
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=names)
            w.writeheader()
            w.writerows(rows)
    assert cli.main(["calibrate", str(dense), str(foundry), "--json", "--out", str(tmp_path / "hw.json")]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["row"]: r for r in result["held_out_rows"]}
    original, copy = rows["dense.csv:0"], rows[f"dense.csv:{len(kept)}"]
    assert copy["held_out_tokens_per_s_per_gpu"] == original["held_out_tokens_per_s_per_gpu"]
    assert copy["held_out_ratio"] == pytest.approx(original["held_out_ratio"] / 2, rel=1e-12)
    # held out: predicted by the fit on llm-foundry's rows alone, not by the one on every row
    from mfuscope.optimizers import calibrate
    alone = calibrate.fit(published.load_cases(foundry)[0])
    first = published.load_cases(dense)[0][0]
    assert original["held_out_tokens_per_s_per_gpu"] == pytest.approx(calibrate.predicted_tps(first, alone), rel=1e-12)
    assert first.measured_tps == pytest.approx(original["measured_tokens_per_s_per_gpu"], rel=1e-12)
    ratios = [r["held_out_ratio"] for r in result["held_out_rows"]]
    assert len(ratios) == sum(s["rows"] for s in result["sources"].values())
    assert [abs(math.log(r)) for r in ratios] == sorted((abs(math.log(r)) for r in ratios), reverse=True)
    for source, score in result["sources"].items():  # a source's MAPE is its rows' mean error
        mine = [abs(r["held_out_ratio"] - 1) for r in result["held_out_rows"] if r["source"] == source]
        assert score["held_out_mape"] == pytest.approx(sum(mine) / len(mine), rel=1e-12)
    assert cli.main(["calibrate", str(dense), str(foundry), "--out", str(tmp_path / "hw.json")]) == 0
    text = capsys.readouterr().out.split("rows furthest from their measurement")[1].splitlines()[1:]
    worst = result["held_out_rows"][0]
    assert len([line for line in text if line.startswith("  ") and "x  " in line]) == WORST_ROWS
    assert text[0].split() [:3] == [f"{worst['held_out_ratio']:.2f}x", worst["source"], worst["row"]]


@needs_rows
def test_calibrate_on_one_sources_rows_reports_in_sample_only(tmp_path, capsys):
    """A table of one source's runs (a team's own, say) leaves nothing to hold a row out from: the
    fit is made and written, the figures are in sample, held out none -- where it once raised."""
    from mfuscope import cli

    with open(CORPUS / "published" / "calibration.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader if r["source"].lower().startswith("korthikanti")]
        one = tmp_path / "one.csv"
        with one.open("w", newline="") as out:
            w = csv.DictWriter(out, fieldnames=reader.fieldnames)
            w.writeheader()
            w.writerows(rows)
    assert cli.main(["calibrate", str(one), "--json", "--out", str(tmp_path / "hw.json")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sources"]["korthikanti"]["held_out_mape"] is None and result["held_out_rows"] == []
    assert all(f["held_out_mape"] is None and f["in_sample_mape"] < 1 for f in result["families"].values())
    assert (tmp_path / "hw.json").is_file()
    assert cli.main(["calibrate", str(one), "--out", str(tmp_path / "hw.json")]) == 0
    assert "needs rows of two or more sources (these are all korthikanti's)" in capsys.readouterr().out


def test_the_planner_considers_folded_expert_groups():
    """16 GPUs, tp=4 x dp=4 of a model with 8 experts: unfolded, ep can be 1, 2 or 4 (the data
    ranks); folded over tp x dp, also 8 -- and ep=4 folded, which stays in an 8-GPU node where the
    unfolded ep=4 beside tp=4 spans 16 ranks, is a layout of its own.  ep=2 folded is the same
    placement as unfolded (both in the node): not considered twice."""
    from mfuscope.optimizers import planner
    from mfuscope.optimizers.spec import Training

    found = {(lay.ep, lay.expert_folding) for lay in planner.candidates(MIXTRAL, 16, 8, 64, Training(seq_len=4096), 8)
             if lay.tp == 4 and lay.pp == 1 and lay.cp == 1}
    assert found == {(1, False), (2, False), (4, False), (4, True), (8, True)}
    assert "ep=8 folded" in planner.describe(Layout(tp=4, dp_replicate=4, ep=8, expert_folding=True))


def test_the_planners_bound_ranks_as_predicting_every_layout_would():
    """The planner predicts layouts in order of their compute bound and stops where the bound falls
    below its top predictions.  Against the exhaustive ranking (every candidate that fits,
    predicted, stably sorted): the same layouts in the same order, and no layout's predicted step
    below its bound -- the property the stopping rule rests on.  Mixtral 8x22B on 64 H100s at 8k
    tokens, dense and MoE paths both (its attention and experts).  64 GPUs: its 141B parameters'
    weights, gradients and Adam states (16 bytes each, 2.3 TB) fit no layout of 32."""
    from mfuscope.optimizers import planner
    from mfuscope.optimizers.cost import memory as memory_model
    from mfuscope.optimizers.model import compute_bound_s, predict
    from mfuscope.optimizers.spec import Training
    from mfuscope.optimizers.system import default_profile, system

    gpus, batch, h100, profile = 64, 64, system("H100"), default_profile()
    training = Training(seq_len=8192, compiled=True)
    scored = []
    for layout in planner.candidates(MIXTRAL, gpus, 8, batch, training, 8):
        if layout.problems(MIXTRAL, training.seq_len) or (layout.pp > 1 and layout.microbatches < layout.pp):
            continue
        if memory_model.estimate(MIXTRAL, layout, training.seq_len, device_bytes=h100.device_bytes).fits is False:
            continue
        pred = predict(MIXTRAL, layout, training, h100, profile)
        assert compute_bound_s(MIXTRAL, layout, training, h100, profile) <= pred.step_s * (1 + 1e-12)
        scored.append((pred.tokens_per_s_per_gpu, planner.describe(layout)))
    assert len(scored) > 100
    exhaustive = sorted(scored, key=lambda s: -s[0])[:10]
    result = planner.plan(MIXTRAL, gpus, h100, batch, training, profile, top=10)
    assert [(p.tokens_per_s_per_gpu, planner.describe(lay)) for lay, p in result.ranked] == exhaustive
    assert result.rejected["fits but is slower than the top layouts"] == len(scored) - 10


#: One MoE layer small enough to count by hand: 4 experts of 4096 (SwiGLU), top-1, 8 heads of 128.
SMALL_MOE = ModelSpec(n_layers=1, dim=1024, n_heads=8, ffn_dim=4096, vocab_size=1000, n_experts=4, top_k=1)


def test_float8_recipes_cast_what_they_scale_and_scopes_pick_their_gemms():
    """1,024 tokens through SMALL_MOE on one H100.  The layer's float8 GEMMs, counted by hand
    (rows x inner x outer x count; each expert sees 1,024 / 4 = 256 rows): qkv 1024x1024x3072,
    attention out 1024x1024x1024, expert up 256x1024x8192 x4, expert down 256x4096x1024 x4 (the
    router stays 16-bit).  Their inputs X = 1,048,576 x 3 + 4,194,304 = 7,340,032 elements, weights
    W = 3,145,728 + 1,048,576 + 33,554,432 + 16,777,216 = 54,525,952, output gradients
    dY = 3,145,728 + 1,048,576 + 8,388,608 + 1,048,576 = 13,631,488.  Delayed scaling moves 4 bytes
    an element of X and W forward and of dY backward (a cast-transpose each, the amax from
    history); MXFP8 3 bytes an element per dimension it scales along: X and W forward, dY twice and
    X and W again backward."""
    from dataclasses import replace

    from mfuscope.optimizers.cost.compute import stage_compute
    from mfuscope.optimizers.spec import Training
    from mfuscope.optimizers.system import Profile, system

    ideal = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1.0, scale_out=1.0)
    x, w, dy = 7_340_032, 54_525_952, 13_631_488

    def stage(key="H100", **fp8):
        training = Training(seq_len=1024, **({"dtype": "fp8", **fp8} if fp8 else {}))
        return stage_compute(SMALL_MOE, Layout(), training, system(key), ideal, layers=1, with_head=False)

    bf16, hbm = stage(), system("H100").hbm_Bps
    for recipe, fwd_bytes, bwd_bytes in (("delayed", 4 * (x + w), 4 * dy), ("current", 6 * (x + w), 6 * dy),
                                         ("tensorwise", 5 * (x + w), 10 * dy + 5 * w)):
        f8 = stage(fp8_recipe=recipe)
        assert f8.fwd["norm_elementwise"] - bf16.fwd["norm_elementwise"] == pytest.approx(fwd_bytes / hbm, rel=1e-9)
        assert f8.bwd["norm_elementwise"] - bf16.bwd["norm_elementwise"] == pytest.approx(bwd_bytes / hbm, rel=1e-9)
    # torchao's float8 all-gather casts each rank's weight shard (W / 8 over 8 FSDP ranks) before
    # gathering it, not the gathered weight at each GEMM.
    def sharded(**fp8):
        training = Training(seq_len=1024, **fp8)
        return stage_compute(SMALL_MOE, Layout(dp_shard=8), training, system("H100"), ideal, layers=1,
                             with_head=False)
    gathered, plain = sharded(dtype="fp8", fp8_recipe="tensorwise", fp8_gather=True), sharded()
    assert gathered.fwd["norm_elementwise"] - plain.fwd["norm_elementwise"] == pytest.approx(
        (5 * x + 5 * w / 8) / hbm, rel=1e-9)
    assert gathered.bwd["norm_elementwise"] - plain.bwd["norm_elementwise"] == pytest.approx(
        (10 * dy + 5 * w / 8) / hbm, rel=1e-9)
    b200 = stage("B200", fp8_recipe="mxfp8")
    b200_bf16 = stage("B200")
    assert b200.bwd["norm_elementwise"] - b200_bf16.bwd["norm_elementwise"] == pytest.approx(
        (6 * dy + 3 * x + 3 * w) / system("B200").hbm_Bps, rel=1e-9)

    # Scopes: the experts' grouped GEMMs alone, or the dense linears alone, at the float8 rate.
    h100 = system("H100")
    dense = 2 * 1024 * 1024 * (3072 + 1024)
    router = 2 * 1024 * 1024 * 4
    experts = 2 * 256 * 4 * (1024 * 8192 + 4096 * 1024)
    f8_rate, b16_rate = h100.matmul_flops("fp8"), h100.matmul_flops("bf16")
    assert bf16.fwd["gemm"] == pytest.approx((dense + router + experts) / b16_rate, rel=1e-9)
    assert stage(fp8_recipe="delayed", fp8_scope="experts").fwd["gemm"] == pytest.approx(
        (dense + router) / b16_rate + experts / f8_rate, rel=1e-9)
    assert stage(fp8_recipe="delayed", fp8_scope="linears").fwd["gemm"] == pytest.approx(
        (router + experts) / b16_rate + dense / f8_rate, rel=1e-9)
    assert stage(fp8_recipe="rowwise").fwd["gemm"] == pytest.approx(bf16.fwd["gemm"], rel=1e-9)
    with pytest.raises(ValueError, match="recipe"):
        replace(Training(seq_len=1024), fp8_recipe="e4m3")


@needs_rows
def test_each_rows_float8_recipe_and_scope_is_read_from_its_dtype():
    """The recipes the new rows name (their dtype column, read by hand): Megatron-Core's FP8 rows
    and llm-foundry's ``amp_fp8`` run Transformer Engine's delayed scaling; torchao's B200 rows
    MXFP8, two of them on part of the GEMMs."""
    cases, _ = published.load_cases(MOE_ROWS)
    fp8 = {c.row: (c.training.fp8_recipe, c.training.fp8_scope) for c in cases if c.training.dtype == "fp8"}
    assert fp8[8] == fp8[9] == ("delayed", "all")                             # Liu et al., Mixtral 8x22B
    assert {fp8[r] for r in range(36, 43)} == {("delayed", "all")}            # llm-foundry amp_fp8
    assert (fp8[19], fp8[20]) == (("tensorwise", "all"), ("rowwise", "all"))  # torchao on H100
    assert (fp8[29], fp8[30], fp8[31]) == (("mxfp8", "linears"), ("mxfp8", "experts"), ("mxfp8", "all"))
    row = published.read_rows(MOE_ROWS)[31]
    with pytest.raises(ValueError, match="MXFP8 on H100"):
        published.case(31, {**row, "gpu_key": "H100", "gpu": "NVIDIA H100"})


#: One layer, 1,024 wide, 8 heads; 4 routed experts of 4,096 (top 1) and a shared expert of 2,048.
SHARED_MOE = ModelSpec(n_layers=1, dim=1024, n_heads=8, ffn_dim=4096, vocab_size=1000, n_experts=4, top_k=1,
                       shared_ffn_dim=2048)


def _moe_predict(profile=None, layout=None, **training):
    from mfuscope.optimizers.model import predict
    from mfuscope.optimizers.spec import Training
    from mfuscope.optimizers.system import Profile, system

    ideal = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1.0, scale_out=1.0,
                    overlap_slowdown=0.0)
    layout = layout or Layout(ep=2, dp_shard=2)
    return predict(SHARED_MOE, layout, Training(seq_len=1024, **training), system("H100"), profile or ideal), layout


def test_expert_all_to_alls_hide_behind_the_shared_expert_or_another_microbatch():
    """ep=2, one microbatch of 1,024 tokens, over NVLink slowed 1,000x so the exchange outlasts
    the compute.  Hidden behind the shared expert: its SwiGLU GEMMs, 2 x 1,024 x 1,024 x (2 x 2,048)
    + 2 x 1,024 x 2,048 x 1,024 FLOPs at H100's bf16 MAMF (794.5 TFLOP/s) forward, twice that
    backward; the all-to-alls stick out by the rest.  Behind another microbatch: the layer's GEMMs
    and attention -- more than the shared expert alone, so less sticks out.  Forward's exchange
    first sends its token counts, one int64 per expert (32 bytes, an all-to-all's latency)."""
    from mfuscope.optimizers.cost.comm import Links
    from mfuscope.optimizers.model import expert_counts_s, expert_exchange_s
    from mfuscope.optimizers.spec import Training
    from mfuscope.optimizers.system import Profile, system

    slow = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1e-3, scale_out=1e-3,
                   overlap_slowdown=0.0)
    none, layout = _moe_predict(slow)
    shared, _ = _moe_predict(slow, moe_overlap="shared_experts")
    other, _ = _moe_predict(slow, moe_overlap="microbatches")
    links = Links(layout, system("H100"), slow)
    a2a = expert_exchange_s(SHARED_MOE, layout, Training(seq_len=1024), links)
    counts = expert_counts_s(SHARED_MOE, links)
    assert counts == links.seconds("ep", "all_to_all", 4 * 8) and 0 < counts < a2a / 100
    shared_f = (2 * 1024 * 1024 * 4096 + 2 * 1024 * 2048 * 1024) / 794.5e12
    assert a2a > 2 * shared_f  # the premise: the exchange outlasts what hides it
    assert none.leaves["comm/ep/all_to_all"] == pytest.approx(2 * a2a + counts, rel=1e-9)
    assert shared.leaves["comm/ep/all_to_all"] == pytest.approx((a2a + counts - shared_f) + (a2a - 2 * shared_f),
                                                                rel=1e-9)
    assert other.leaves["comm/ep/all_to_all"] < shared.leaves["comm/ep/all_to_all"]


def test_an_imbalanced_router_slows_the_busiest_rank_unless_capacity_drops_tokens():
    """The busiest ep rank's routed tokens at 1.3x the mean: its expert GEMMs and the exchange
    take 1.3x; a capacity factor of 1.1 drops what is past 1.1x, so 1.1x.  The token counts sent
    ahead of the exchange are one per expert whatever the load."""
    from mfuscope.optimizers.cost.comm import Links
    from mfuscope.optimizers.model import expert_counts_s
    from mfuscope.optimizers.spec import Training
    from mfuscope.optimizers.system import Profile, system

    base, layout = _moe_predict()
    ideal = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1.0, scale_out=1.0,
                    overlap_slowdown=0.0)
    counts = expert_counts_s(SHARED_MOE, Links(layout, system("H100"), ideal))  # one layer, one microbatch
    tokens = base.leaves["comm/ep/all_to_all"] - counts
    for kw, factor in (({"moe_imbalance": 1.3}, 1.3), ({"moe_imbalance": 1.3, "moe_capacity_factor": 1.1}, 1.1)):
        skewed, _ = _moe_predict(**kw)
        assert skewed.leaves["comm/ep/all_to_all"] == pytest.approx(factor * tokens + counts)
    gemms = {g.name: g for g in layer_gemms(SHARED_MOE, Layout(ep=2, dp_shard=2), 1024, expert_load=1.3)}
    assert gemms["expert_up"].m == pytest.approx(1024 * 1 * 2 / 4 * 1.3)  # tokens x top-k x ep / E x load
    with pytest.raises(ValueError, match="1 or more"):
        Training(seq_len=1024, moe_imbalance=0.9)


def test_delayed_scaling_reduces_its_amaxes_twice_a_microbatch():
    """Transformer Engine's delayed scaling all-reduces the float8 amaxes over the data, context
    and tensor-parallel ranks at the end of each microbatch's forward (X and W of each GEMM: 4
    float8 GEMMs in a dense layer, 8 values) and of its backward (dY: 4): on 8 ranks (tp=2 x
    dp=4), 4 microbatches, two all-reduces each; tensor-wise dynamic scaling has none."""
    from mfuscope.optimizers.cost.comm import Links
    from mfuscope.optimizers.model import predict
    from mfuscope.optimizers.spec import Training
    from mfuscope.optimizers.system import Profile, system

    dense = ModelSpec(n_layers=1, dim=1024, n_heads=8, ffn_dim=4096, vocab_size=1000)
    layout = Layout(tp=2, dp_replicate=4, microbatches=4)
    ideal = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1.0, scale_out=1.0)
    h100 = system("H100")

    def reduce_leaf(recipe):
        training = Training(seq_len=1024, dtype="fp8", fp8_recipe=recipe, overlap_grad_reduce=False)
        return predict(dense, layout, training, h100, ideal).leaves["comm/dp/all_reduce"]

    links = Links(layout, h100, ideal)
    amax = links.seconds("dp", "all_reduce", 4 * 8, n=8) + links.seconds("dp", "all_reduce", 4 * 4, n=8)
    assert reduce_leaf("delayed") - reduce_leaf("tensorwise") == pytest.approx(4 * amax, rel=1e-9)


def _simulated_nodes(rng, experts, top_k, nodes, groups, group_topk, tokens=3000):
    """The mean number of nodes a token's experts lie on, routing ``tokens`` tokens at random:
    ``group_topk`` of ``groups`` contiguous expert groups, then ``top_k`` experts among theirs."""
    import numpy as np

    per_group, per_node = experts // groups, experts // nodes
    hit = []
    for _ in range(tokens):
        chosen = rng.choice(groups, group_topk, replace=False)
        pool = np.concatenate([np.arange(g * per_group, (g + 1) * per_group) for g in chosen])
        hit.append(len(np.unique(rng.choice(pool, top_k, replace=False) // per_node)))
    return float(np.mean(hit)), float(np.std(hit)) / len(hit) ** 0.5


def test_distinct_nodes_are_those_of_a_simulated_router():
    """The expected number of nodes holding a token's experts, against a router simulated token
    by token: DeepSeek-V3's 256 experts, top 8 from 4 of 8 groups, over 8, 4 and 16 nodes, and
    without the group limit; Mixtral's 8 experts, top 2, over 2 nodes.  Within five standard
    errors of the simulated mean (3,000 tokens each)."""
    import numpy as np

    rng = np.random.default_rng(7)
    for experts, top_k, nodes, groups, group_topk in ((256, 8, 8, 8, 4), (256, 8, 8, 1, 1), (256, 8, 4, 8, 4),
                                                      (256, 8, 16, 8, 4), (8, 2, 2, 1, 1)):
        mean, err = _simulated_nodes(rng, experts, top_k, nodes, groups, group_topk)
        assert comm.distinct_nodes(experts, top_k, nodes, groups, group_topk) == pytest.approx(
            mean, abs=5 * err + 1e-9), (experts, top_k, nodes, groups, group_topk)
    # Hand counts: 2 of Mixtral's 8 experts on 2 nodes miss a node with C(4,2)/C(8,2) = 6/28; one
    # group of two chosen, each group one node: always one node.
    assert comm.distinct_nodes(8, 2, 2) == pytest.approx(2 * (1 - 6 / 28))
    assert comm.distinct_nodes(8, 2, 2, groups=2, group_topk=1) == pytest.approx(1.0)
    assert comm.distinct_nodes(256, 8, 1) == 1.0


def test_the_two_level_dispatch_sends_a_copy_a_node_over_the_nic():
    """ep=16 over two nodes of 8 (H100: 50 GB/s NIC, 450 GB/s NVLink; no latency): NCCL's all-to-all
    sends each of a token's k=2 copies, the half bound for the other node over the NIC; the
    two-level dispatch sends one copy for each distinct remote node -- 2 (1 - 6/28) distinct
    nodes, half of them remote -- and forwards every copy over NVLink (7/8 of them leave the
    receiving GPU), which is faster than the NIC here.  With the experts in two groups, one chosen
    (each group a node), a token reaches one node: half of the time the other one.  Inside one
    node both are the same all-to-all."""
    from dataclasses import replace

    from mfuscope.optimizers.cost.comm import Links
    from mfuscope.optimizers.system import Profile, system

    h100 = system("H100")
    s = replace(h100, scale_up=replace(h100.scale_up, latency_s=0.0), scale_out=replace(h100.scale_out, latency_s=0.0))
    ideal = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1.0, scale_out=1.0)
    nic, nvl, token_bytes = 50e9, 450e9, 1e9
    links = Links(Layout(ep=16, dp_shard=16), s, ideal)
    nccl = links.expert_dispatch_seconds(token_bytes, 2, 8)
    assert nccl == pytest.approx(token_bytes * 2 * 8 / 16 / nic)
    two_level = links.expert_dispatch_seconds(token_bytes, 2, 8, two_level=True)
    remote, nvlink = token_bytes * 2 * (1 - 6 / 28) / 2 / nic, token_bytes * 2 * 7 / 8 / nvl
    assert nvlink < remote and two_level == pytest.approx(remote)
    limited = links.expert_dispatch_seconds(token_bytes, 2, 8, groups=2, group_topk=1, two_level=True)
    assert limited == pytest.approx(token_bytes * 1 / 2 / nic)
    inside = Links(Layout(ep=8, dp_shard=8), s, ideal)
    assert inside.expert_dispatch_seconds(token_bytes, 2, 8, two_level=True) == pytest.approx(
        inside.expert_dispatch_seconds(token_bytes, 2, 8)) == pytest.approx(token_bytes * 2 * 7 / 8 / nvl)
    with pytest.raises(ValueError, match="MoE dispatch"):
        Training(seq_len=1024, moe_dispatch="nvshmem")


def test_experts_are_sharded_and_reduced_only_over_the_ranks_that_hold_them():
    """Expert data parallelism (torchtitan's ``dp_shard_mod_ep``, Megatron-Core's EDP): a rank's
    experts are gathered, reduce-scattered and kept sharded only among the ranks holding the same
    experts, and nowhere where ``ep`` spans the shard group.  Counted by hand for Mixtral 8x22B:
    a layer's 8 experts of 3 x 6144 x 16384 are 2,415,919,104 parameters, its attention, norms and
    router 6144 x (2 x 6144 + 2 x 1024) + 2 x 6144 + 8 x 6144 = 88,141,824; the embedding and head
    32000 x 6144 each, and the final norm."""
    from mfuscope.optimizers.cost import memory

    experts_total, dense_layer = 56 * 2_415_919_104, 88_141_824
    dense_total = 56 * dense_layer + 2 * 32000 * 6144 + 6144
    assert sum(MIXTRAL.layer_params()) == dense_layer + 2_415_919_104
    fsdp = Layout(dp_shard=64, ep=8)  # 8 copies of each expert, each FSDP-sharded over 8 ranks
    assert (fsdp.expert_shard_ranks, fsdp.expert_grad_ranks) == (8, 8)
    assert memory.state_params_per_gpu(MIXTRAL, fsdp) == pytest.approx(dense_total / 64 + experts_total / 64)
    spans = Layout(dp_shard=8, ep=8)      # one copy of each expert: nothing shards them
    assert memory.state_params_per_gpu(MIXTRAL, spans) == pytest.approx(dense_total / 8 + experts_total / 8)
    est = memory.estimate(MIXTRAL, spans, 4096)
    assert est.optimizer_bytes == pytest.approx(8 * (dense_total / 8 + experts_total / 8))  # Adam, fp32 moments
    # Megatron-Core's distributed optimizer (ZeRO-1), tp=2 x dp=8 with ep=4 cut from the data ranks:
    # each expert whole on a rank, so the tp pair holds the same ones, in each of two ep groups: 4.
    zero = Layout(tp=2, dp_replicate=8, ep=4, zero=1)
    assert zero.expert_grad_ranks == 4
    dense_gpu = 56 * ((dense_layer - 2 * 6144 - 8 * 6144) / 2 + 2 * 6144 + 8 * 6144) + (2 * 32000 * 6144) / 2 + 6144
    assert memory.state_params_per_gpu(MIXTRAL, zero) == pytest.approx(dense_gpu / 8 + experts_total / 4 / 4)
    # Folded (Liu et al. 2025): the ep group of 8 takes 2 tp ranks x 4 data ranks, so of the 16
    # ranks 2 hold each expert.  With tp=4 and FSDP over 8 data ranks, an ep group of 8 spans 4 tp
    # ranks x 2 data ranks: a tp coordinate's 8 FSDP ranks take 2 expert slots, 4 ranks each.
    assert Layout(tp=2, dp_replicate=8, ep=8, zero=1, expert_folding=True).expert_grad_ranks == 2
    folded = Layout(tp=4, dp_shard=8, ep=8, expert_folding=True)
    assert (folded.expert_shard_ranks, folded.expert_grad_ranks) == (4, 4)
    assert comm.placements(folded, 8)["dp_expert_shard"] == comm.Placement("scale_out", 1)  # ranks 0, 8, 16, 24


def test_fsdp_moves_only_the_dense_parameters_where_each_rank_holds_its_own_experts():
    """dp_shard=2 with ep=2 (the reference trainer's MoE layout on real compute): each rank's two
    experts are its own, so FSDP gathers and reduce-scatters only the rest -- with zero-latency
    links and nothing hidden, a gather of the dense bf16 weights once forward and once backward,
    and one reduce-scatter of their fp32 gradients, (n - 1) / n of each over NVLink.  With ep=1
    each rank holds every expert, and FSDP moves them too."""
    from mfuscope.optimizers.cost import memory
    from mfuscope.optimizers.model import predict
    from mfuscope.optimizers.system import Profile, system

    moe = ModelSpec(n_layers=2, dim=1024, n_heads=8, ffn_dim=4096, vocab_size=1000, n_experts=4, top_k=2)
    s = system("H100")
    s = replace(s, scale_up=replace(s.scale_up, latency_s=0.0))
    ideal = Profile(gemm=1.0, gemm_knee=0.0, attention=1.0, memory=1.0, scale_up=1.0, scale_out=1.0)
    training = Training(seq_len=1024, overlap_param_gather=False, overlap_reduce_scatter=False,
                        overlap_grad_reduce=False)
    layer, root = moe.layer_params(), 2 * 1000 * 1024 + 1024
    dense = 2 * layer[0] + root
    half = 0.5 / (s.scale_up.bandwidth_Bps * ideal.scale_up)  # (n - 1) / n over the link
    p = predict(moe, Layout(dp_shard=2, ep=2, micro_batch=1, microbatches=1), training, s, ideal)
    assert p.leaves["comm/dp/all_gather"] == pytest.approx(2 * dense * 2 * half)
    assert p.leaves["comm/dp/reduce_scatter"] == pytest.approx(dense * 4 * half)
    everything = memory.params_per_gpu(moe, Layout(dp_shard=2))
    q = predict(moe, Layout(dp_shard=2, micro_batch=1, microbatches=1), training, s, ideal)
    assert everything == dense + 2 * layer[1]
    assert q.leaves["comm/dp/reduce_scatter"] == pytest.approx(everything * 4 * half)


def _moved_by(fn, *args) -> int:
    """Elements ``fn`` reads and writes, counted from the operators it dispatches: each floating
    output written once, each floating input read once at its storage's size (an expanded view
    reads its base), the tensor an ``index_copy_`` overwrites not read; views move nothing."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Moved(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("view", "unsqueeze", "expand", "split_with_sizes", "unbind", "empty_like", "reshape"):
                return out
            reads = args[3:] if name == "index_copy_" else (args, kwargs)
            for t in tree_flatten(reads)[0]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    Moved.total += min(t.numel(), t.untyped_storage().nbytes() // t.element_size())
            Moved.total += sum(o.numel() for o in tree_flatten(out)[0]
                               if isinstance(o, torch.Tensor) and o.is_floating_point())
            return out

    with Moved():
        fn(*args)
    return Moved.total


def test_the_reference_trainers_routing_copies_are_what_its_operators_move():
    """The reference trainer's eager MoE moves each routed copy more often than a gather and a
    scatter (Megatron-Core's, torchtitan's: 4 k h a token).  By hand from its code: permute h + 3 k h
    (repeat, then place), unpermute 5 k h + h (pick, weigh, sum) -- the router's k weights read
    besides -- and the experts' sort, concatenation and unsort 2 k h each: 8 k h + 2 h + 6 k h at
    an even load.  The same counted from the operators the trainer's own functions dispatch (16
    tokens, h 8, k 2, 4 experts); the model prices that count for a reference-trainer run
    (``Training.of_run``), and a gather where torch.compile fuses the copies."""
    import torch

    from mfuscope.optimizers.cost.compute import elementwise_elements, moe_routing_elements
    from mfuscope.reference_trainer import model as trainer
    from mfuscope.trainer_options import TrainerOptions

    t, h, k, e = 16, 8, 2, 4
    torch.manual_seed(0)
    tokens, weight = torch.randn(t, h), torch.rand(t, k)
    expert = torch.randint(0, e, (t, k))
    order, positions = trainer.route(expert)
    experts = trainer.Experts(e, h, 6)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w)
    rows = trainer.permute(tokens, positions)
    assert _moved_by(trainer.permute, tokens, positions) == t * (h + 3 * k * h)
    assert _moved_by(trainer.unpermute, rows, positions, weight) == t * (5 * k * h + h + k)
    gemms_and_swiglu = _moved_by(lambda r, x: [(torch.nn.functional.silu(s @ a) * (s @ c)) @ b for s, a, c, b in
                                               zip(r.split(x.tolist()), experts.w1.unbind(0), experts.w3.unbind(0),
                                                   experts.w2.unbind(0))],
                                 rows, trainer.expert_counts(expert.reshape(-1)[order], e))
    moved = _moved_by(experts, rows, expert.reshape(-1)[order]) - gemms_and_swiglu
    assert moved == t * 6 * k * h

    spec = ModelSpec(n_layers=1, dim=h, n_heads=2, ffn_dim=6, vocab_size=16, n_experts=e, top_k=k)
    run = Training.of_run(TrainerOptions(), {"seq_len": 16}, on_gpu=False)
    assert run.moe_routing == "copies"
    assert moe_routing_elements(spec, run) == 8 * k * h + 2 * h + 6 * k * h
    assert moe_routing_elements(spec, run, load=1.5) == 8 * k * h + 2 * h + 6 * k * 1.5 * h
    assert moe_routing_elements(spec, replace(run, fused_kernels=True)) == 2 * k * h + 2 * h + 6 * k * h
    assert moe_routing_elements(spec, replace(run, compiled=True)) == moe_routing_elements(spec, Training(16)) \
        == 4 * k * h
    lay = Layout()
    assert elementwise_elements(spec, lay, run) - elementwise_elements(spec, lay, Training(16)) == \
        8 * k * h + 2 * h + 6 * k * h - 4 * k * h
