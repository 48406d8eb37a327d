"""Names of communication, from every layer and era, map to one op vocabulary."""
from __future__ import annotations

import pytest

from mfuscope.analyzers import collectives as c


@pytest.mark.parametrize("name, op", [
    ("nccl:all_reduce", "all_reduce"), ("gloo:all_reduce", "all_reduce"), ("c10d::allreduce_", "all_reduce"),
    ("nccl:_all_gather_base", "all_gather"), ("c10d::_reduce_scatter_base_", "reduce_scatter"),
    ("nccl:all_to_all", "all_to_all"), ("c10d::alltoall_base_", "all_to_all"), ("nccl:send", "send"),
    ("nccl:recv", "recv"), ("c10d::broadcast_", "broadcast"), ("c10d::barrier", "barrier"),
    ("mfuscope.comm/tp/reduce_scatter", "reduce_scatter"), ("allgather_into_tensor_coalesced", "all_gather"),
    ("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", None), ("record_param_comms", None),
])
def test_normalize_op(name, op):
    assert c.normalize_op(name) == op


def test_dimension_from_labels_and_group_descriptions():
    assert c.label_dim("mfuscope.comm/dp_shard/all_gather") == "dp_shard"
    assert c.dim_from_group_desc("mesh_tp") == "tp"
    assert c.dim_from_group_desc("default_pg") == "world"
    assert c.dim_from_group_desc("undefined") is None


def test_bytes():
    assert c.bytes_from_dims("[[394241]]", '["float"]') == 394241 * 4
    assert c.bytes_from_dims("[[8, 1024]]", '["c10::BFloat16"]') == 8 * 1024 * 2
    assert c.bytes_from_dims("[[]]", '["TensorList"]') is None
    assert c.dtype_bytes("Float") == 4 and c.dtype_bytes("BFloat16") == 2 and c.dtype_bytes("weird") is None
    assert c.parse_group_ranks("[0, 2, 4]") == "0,2,4" and c.parse_group_ranks([1, 3]) == "1,3"
