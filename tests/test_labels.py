"""The range labels' one grammar (mfuscope/labels.py): every kind formats and parses back, the
wait form is read as what it is, near misses do not parse, and real traces' names read as they
should.  Pure string work, no torch (the collectors' labels in a real run are checked where the
shared 3D run is read: test_comm_labels)."""
from __future__ import annotations

import pytest

from mfuscope import labels
from mfuscope.analyzers import collectives

from .helpers import HTA_DATA, needs_corpus, read_raw


def test_step_round_trip():
    for step in (0, 1, 17, 123456):
        assert labels.step_label(step) == f"mfuscope.step#{step}"
        assert labels.parse_step(labels.step_label(step)) == ("mfuscope.step", step)
    # torch.profiler's marker is read too, with its own source (the trainer's numbering wins over it)
    assert labels.parse_step("ProfilerStep#551") == ("ProfilerStep", 551)


@pytest.mark.parametrize("dim", ["tp", "pp", "dp_shard_cp", "ep_dp", "world", "outer"])
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "send_recv", "all_gather_into_tensor"])
def test_comm_and_wait_round_trip(dim, op):
    call, wait = labels.comm_label(dim, op), labels.wait_label(dim, op)
    assert call == f"mfuscope.comm/{dim}/{op}" and wait == f"mfuscope.wait/{dim}/{op}"
    assert labels.parse_comm(call) == labels.CommLabel(dim, op, wait=False)
    assert labels.parse_comm(wait) == labels.CommLabel(dim, op, wait=True)
    # the breakdown's vectorized reader (Series.str.extract) uses the same pattern
    assert labels.COMM_RE.match(wait).group("dim", "op") == (dim, op)


def test_wait_is_communication_but_not_a_call():
    """The breakdown books both forms as exposed communication; the collectives' readers take only
    the call: a wait is the thread blocked on a call made earlier, not a second call."""
    call, wait = labels.comm_label("tp", "all_reduce"), labels.wait_label("tp", "all_reduce")
    assert collectives.is_comm_cpu_name(call) and collectives.label_dim(call) == "tp"
    assert collectives.normalize_op(call) == "all_reduce"
    assert not collectives.is_comm_cpu_name(wait) and collectives.label_dim(wait) is None


@pytest.mark.parametrize("action", ["F", "B", "W"])
def test_pipeline_round_trip(action):
    for stage, mb in ((0, 0), (1, 3), (12, 31)):
        label = labels.pp_label(stage, action, mb)
        assert label == f"mfuscope.pp/{stage}{action}{mb}"
        assert labels.parse_pp(label) == labels.PipelineAction(stage, action, mb)


def test_pytorch_pipeline_actions():
    assert labels.parse_pp("PP:0F1") == (0, "F", 1)
    assert labels.parse_pp("PP:3I12") == (3, "I", 12)    # backward of the input (zero-bubble schedules)
    assert labels.parse_pp("Forward 3") == (None, "F", 3)   # GPipe: the stage is the rank's
    assert labels.parse_pp("Backward 0") == (None, "B", 0)


def test_simulated_compute():
    assert labels.paced_label("forward") == "mfuscope.paced/forward"
    assert labels.inject_label("compute") == "mfuscope.inject/compute"
    assert labels.paced_label("weight").startswith(labels.SIMULATED)
    assert labels.inject_label("late").startswith(labels.SIMULATED)
    # the injected loader stall reads as a DataLoader region, not as compute
    assert not f"enumerate(DataLoader)#{labels.inject_label('loader')}".startswith(labels.SIMULATED)


@pytest.mark.parametrize("name", [
    "mfuscope.step#", "mfuscope.step#x", "mfuscope.step#-1", "mfuscope.step#3 ", "mfuscope.step3",
    "mfuscope.steps#1", "Optimizer.step#SGD.step", "ProfilerStep#", "xProfilerStep#1", "mfuscope.comm/tp/all_reduce",
])
def test_not_a_step(name):
    assert labels.parse_step(name) is None


@pytest.mark.parametrize("name", [
    "mfuscope.comm/tp", "mfuscope.comm/tp/", "mfuscope.comm//all_reduce", "mfuscope.comm/tp/all_reduce/x",
    "mfuscope.comm", "mfuscope.commtp/all_reduce", "mfuscope.waits/tp/all_reduce", "mfuscope.wait/tp",
    "mfuscope_comm/tp/all_reduce", "nccl:all_reduce", "c10d::allreduce_", "gloo:all_reduce", "record_param_comms",
    " mfuscope.comm/tp/all_reduce", "mfuscope.step#1",
])
def test_not_a_comm_label(name):
    assert labels.parse_comm(name) is None and not labels.COMM_RE.match(name)


@pytest.mark.parametrize("name", [
    "mfuscope.pp/?F1", "mfuscope.pp/0F?", "mfuscope.pp/0X1", "mfuscope.pp/0F", "mfuscope.pp/F1", "mfuscope.pp/0F1x",
    "PP:0UNSHARD", "PP:0SEND_F1", "PP:0RECV_B1", "pp:0F1", "Forward", "Forward x", "Forward  3", "## forward ##",
    "DistributedDataParallel.forward",
])
def test_not_a_pipeline_action(name):
    assert labels.parse_pp(name) is None


@needs_corpus(HTA_DATA)
@pytest.mark.parametrize("trace, steps", [
    ("nccl_parser_config/nccl_data.json.gz", {4, 5, 6}),            # NCCL, DDP: Optimizer.step#SGD.step is no step
    ("trace_filter/sampled_rank-0.json.gz", {551, 552}),            # TorchRec: "## forward ##" is no action
    ("cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", {551}),  # gloo
])
def test_real_trace_names(trace, steps):
    """Names from real traces of other projects: their ProfilerStep markers read as steps, and none
    of their other names (c10d, nccl, gloo, DataLoader, autograd, ...) as any of mfuscope's labels."""
    raw = read_raw(HTA_DATA / trace)
    names = {e["name"] for e in raw["traceEvents"] if isinstance(e.get("name"), str)}
    parsed = {n: labels.parse_step(n) for n in names}
    assert {p for p in parsed.values() if p} == {("ProfilerStep", s) for s in steps}
    assert not [n for n in names if labels.parse_comm(n) or labels.parse_pp(n)]
