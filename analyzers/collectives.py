"""What a communication event is: its op, its payload in bytes, its group.

Names come from many eras and layers -- NCCL kernels (``ncclKernel_*``,
``ncclDevKernel_*``, ``ncclSymk*``, RCCL's ``ncclDevKernel_Generic``), c10d ops
(``c10d::allreduce_``), profiler annotations (``nccl:all_reduce``,
``gloo:all_reduce``), ``record_param_comms`` fields (``Collective name``) and
mfuscope's own call labels (``mfuscope.comm/<dim>/<op>``, :mod:`mfuscope.labels`).  They all
map to one small vocabulary of ops here.
"""
from __future__ import annotations

import functools
import json
import math
import re

from mfuscope import labels

#: Canonical op names, matched in this order against the letters of a name
#: (so ``reducescatter`` wins over ``reduce`` and ``allgather`` over ``gather``).
_OP_TOKENS = (
    ("reducescatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("sendrecv", "send_recv"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("reduce", "reduce"),
    ("send", "send"),
    ("recv", "recv"),
)

_EP_KERNEL = re.compile(r"deep_ep::|dpsk::ep::|nvshmem", re.I)
#: All-reduce kernels of inference and training stacks that bypass NCCL, matched on the name with its
#: camelCase split (``oneShotAllReduceKernel`` -> ``one_shot_all_reduce_kernel``): vLLM's, SGLang's and
#: AITER's ``cross_device_reduce_1stage/2stage``, PyTorch symmetric memory's
#: ``multimem_all_reduce_kernel`` / ``one_shot_all_reduce_kernel`` / ``two_shot_all_reduce_kernel_inplace``,
#: TensorRT-LLM's ``oneShotAllReduceKernel`` / ``twoShotAllReduceKernel``, and the fused all-reduce +
#: norm kernels of TensorRT-LLM, FlashInfer and AITER (``allreduce_fusion_kernel_oneshot_lamport``,
#: ``moefinalize_allreduce_fusion_kernel_oneshot_lamport``, ``allreduce_fusion_kernel_1stage``).
_ALL_REDUCE_KERNEL = re.compile(r"cross_device_reduce|(?<![a-z])all_?reduce(?![a-z])")
_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def _custom_all_reduce(name: str) -> bool:
    return bool(_ALL_REDUCE_KERNEL.search(_CAMEL.sub("_", name).lower()))


def _call_label(name: str) -> labels.CommLabel | None:
    """mfuscope's label of a collective call; not its wait form (``mfuscope.wait/<dim>/<op>``), which
    is the thread blocked on a call made earlier: taken for a call, it would count that call twice,
    and a gloo worker's orphan work could be given the wait for its issuing call."""
    label = labels.parse_comm(name)
    return label if label is not None and not label.wait else None


def is_comm_kernel(name: str) -> bool:
    """NCCL and RCCL device kernels, every naming generation; expert-parallel communication
    kernels: DeepEP's dispatch/combine (``deep_ep::intranode::dispatch``, ``internode``,
    ``internode_ll``, and ``dpsk::ep::internode::notify_dispatch`` ... in the builds that rename its
    namespace) and NVSHMEM's, which move tokens between GPUs without NCCL; and the custom all-reduce
    kernels of vLLM, SGLang, TensorRT-LLM, FlashInfer and PyTorch symmetric memory."""
    low = name.lower()
    return "nccl" in low or "rccl" in low or bool(_EP_KERNEL.search(name)) or _custom_all_reduce(name)


def kernel_dim(name: str) -> str | None:
    """The parallel dimension a communication kernel's name gives away: DeepEP and NVSHMEM
    kernels are expert parallelism's token dispatch and combine."""
    return "ep" if _EP_KERNEL.search(name) else None


def is_comm_cpu_name(name: str) -> bool:
    """CPU-side names that stand for a collective call (not the device work)."""
    return name == "record_param_comms" or name.startswith(("nccl:", "gloo:", "c10d::")) or bool(_call_label(name))


@functools.lru_cache(maxsize=1 << 14)
def normalize_op(name: str | None) -> str | None:
    """Canonical collective op for any name above, or None if it names none.  (Cached: a trace
    asks it of the same few hundred names thousands of times.)"""
    if not name:
        return None
    label = _call_label(name)
    if label:
        return normalize_op(label.op)
    base = name.split("(", 1)[0]
    if base.startswith(("nccl:", "gloo:", "c10d::")):
        base = base.split(":")[-1]
    if _EP_KERNEL.search(name):  # dispatch and combine send every token to its experts' GPUs
        return "all_to_all"
    if _custom_all_reduce(name):  # cross_device_reduce_2stage: a reduce-scatter and an all-gather in one
        return "all_reduce"
    key = re.sub(r"[^a-z]", "", base.lower())
    for token, op in _OP_TOKENS:
        if token in key:
            return op
    return None


def label_dim(name: str) -> str | None:
    """Parallel dimension from an ``mfuscope.comm/<dim>/<op>`` label, or an expert-parallel kernel."""
    label = _call_label(name)
    return label.dim if label else kernel_dim(name)


#: Process-group descriptions frameworks write (``Process Group Description`` in ``record_param_comms``,
#: ``pg_desc`` in ``distributedInfo.pg_config``) -> mfuscope's dimension.  Megatron-Core names every
#: group it creates (``parallel_state.initialize_model_parallel``; PyTorch >= 2.4 records the name):
#: the decoder's tensor, context, data and pipeline groups and their products, and the expert layers'
#: groups, whose data-parallel group is ``dp_expert`` (expert weights' gradients, over the ranks left
#: after expert tensor x expert x pipeline parallelism).  Older Megatron spelled the expert groups
#: ``DATA_MODULO_EXPERT_PARALLEL_GROUP`` / ``TENSOR_AND_EXPERT_PARALLEL_GROUP``.  Suffixes
#: ``_GLOO`` (the CPU twin), ``_AG`` (a second communicator for all-gathers), ``HIERARCHICAL_*_L<n>``
#: (a level of a hierarchical group) keep their group's dimension (:func:`_base_desc`).
_DESC_DIMS = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "EMBEDDING_GROUP": "pp",  # first and last pipeline stages: tied embedding gradients
    "POSITION_EMBEDDING_GROUP": "pp",
    "DATA_PARALLEL_GROUP": "dp",
    "DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp_shard_cp",  # one distributed-optimizer instance
    "MODEL_PARALLEL_GROUP": "tp_pp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "EXPERT_TENSOR_PARALLEL_GROUP": "tp",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "TENSOR_AND_EXPERT_PARALLEL_GROUP": "tp_ep",
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "EXPERT_DATA_PARALLEL_GROUP": "dp_expert",
    "DATA_MODULO_EXPERT_PARALLEL_GROUP": "dp_expert",
}
#: DeviceMesh dimension names (``mesh_<name>``: torchtitan's ParallelDims and any user mesh) that are
#: mfuscope's under another name.  torchtitan: ``batch`` = dp_replicate x dp_shard, ``loss_mesh`` (its
#: flattened batch x cp) and ``dp_cp``, ``fsdp`` = dp_shard x cp (its FSDP mesh), ``efsdp`` = FSDP of
#: the expert layers; ``default`` / ``world``: every rank.  Other names are kept as they are.
_MESH_DIMS = {"default": "world", "world": "world", "batch": "dp", "loss_mesh": "dp_cp", "loss": "dp_cp",
              "efsdp": "dp_expert"}
#: A group described by mfuscope's own dimension name (``new_group(..., group_desc="tp")``).
_PLAIN_DIMS = ("tp", "cp", "pp", "ep", "dp", "dp_replicate", "dp_shard", "fsdp", "dp_shard_cp", "dp_cp", "dp_expert")
_GROUP_SUFFIX = re.compile(r"(_GLOO|_AG|_L\d+)+$")


def _base_desc(desc: str) -> str:
    base = desc[len("HIERARCHICAL_"):] if desc.startswith("HIERARCHICAL_") else desc
    return _GROUP_SUFFIX.sub("", base)


def dim_from_group_desc(desc: str | None) -> str | None:
    """Dimension from a process-group description: DeviceMesh's ``mesh_<dim>`` (torchtitan's names
    mapped by :data:`_MESH_DIMS`), PyTorch's ``default_pg``, Megatron-Core's names
    (:data:`_DESC_DIMS`); None for a description that says nothing (``undefined``: DeepSpeed and
    plain ``new_group`` calls, ``mesh_dim_0`` of an unnamed mesh, a split group)."""
    if not desc:
        return None
    if desc == "default_pg":
        return "world"
    if desc in _PLAIN_DIMS:
        return desc
    m = re.match(r"^mesh_(\w+)$", desc)
    if m:
        name = m.group(1)
        return None if re.fullmatch(r"dim_\d+", name) else _MESH_DIMS.get(name, name)
    base = _base_desc(desc.strip().upper())
    if re.fullmatch(r"HYBRID_DP_CP_GROUP_\d+", base):  # Megatron's power-of-two slices of dp x cp
        return "dp_cp"
    return _DESC_DIMS.get(base)


def group_dim(name: str | None, desc: str | None) -> str | None:
    """Dimension of a process group from what the trace calls it: its description first, then its
    name where a framework named the group itself (``Process Group Name`` is otherwise PyTorch's
    counter or a hash, which says nothing)."""
    return dim_from_group_desc(desc) or (dim_from_group_desc(name) if name and not name.isdigit() else None)


# Element sizes by the names PyTorch uses: c10 ScalarType names in
# record_param_comms "dtype", C++ type names in "Input type".
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
    "bfloat16": 2, "c10::bfloat16": 2, "c10::half": 2, "int": 4, "int32": 4,
    "long": 8, "long int": 8, "int64": 8, "long long": 8, "short": 2, "short int": 2,
    "int16": 2, "char": 1, "signed char": 1, "byte": 1, "unsigned char": 1,
    "uint8": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "complexfloat": 8,
    "c10::complex<float>": 8,
}


def dtype_bytes(dtype: str | None) -> int | None:
    if not dtype:
        return None
    return _DTYPE_BYTES.get(dtype.strip().lower())


def bytes_from_dims(dims_json: str | None, types_json: str | None) -> int | None:
    """Payload of the first tensor argument from profiler ``Input Dims`` / ``Input type``."""
    if not dims_json or not types_json:
        return None
    try:
        dims, types = json.loads(dims_json), json.loads(types_json)
    except ValueError:
        return None
    if not dims or not types or not isinstance(dims[0], list) or not dims[0]:
        return None
    size = dtype_bytes(types[0])
    if size is None or not all(isinstance(d, int) for d in dims[0]):
        return None
    return math.prod(dims[0]) * size


def read_group_ranks(value) -> tuple[list[int], bool] | None:
    """(ranks, truncated) from a ``Process Group Ranks`` / ``pg_config`` ranks value: a list, or the
    string Kineto writes, ``"[0, 2, 4]"``.  PyTorch's profiler cuts lists longer than 30 entries
    (``kTruncatLength``) to their first 30 and a trailing ``...``: ``"[0, 1, 2, ..., 29, ...]"``
    written out is 30 ranks then ``, ...``; such a list is a prefix of the group, flagged
    ``truncated``.  None for nothing usable (missing, empty, not a list of ranks)."""
    if value is None:
        return None
    truncated = False
    if isinstance(value, str):
        text = value.strip()
        if not (text.startswith("[") and text.endswith("]")):
            return None
        parts = [p.strip() for p in text[1:-1].split(",") if p.strip()]
        truncated = any(p.strip(".") == "" for p in parts)  # "..." entries
        value = [p for p in parts if p.strip(".") != ""]
    if not isinstance(value, (list, tuple)):
        return None
    try:
        ranks = [int(v) for v in value]
    except (TypeError, ValueError):
        return None
    return (ranks, truncated) if ranks else None


def full_group_ranks(head: list[int], size: int | None, start: int | None, stride: int | None) -> list[int] | None:
    """A truncated list's whole group, where the event says how to rebuild it: PyTorch records
    ``Global rank start`` and ``Global rank stride`` for a group whose ranks are evenly strided (a
    DeviceMesh dimension, Megatron's single-dimension groups), and ``Group size``.  Only when the
    recorded head agrees with that progression; else None (the group is not known)."""
    if not size or start is None or start < 0 or not stride or stride < 1:
        return None
    ranks = [start + i * stride for i in range(size)]
    return ranks if ranks[:len(head)] == head else None


def compact_ranks(ranks: list[int]) -> str:
    """[0, 1] -> ``"0,1"``: the EventTable's ``group_ranks`` form."""
    return ",".join(str(r) for r in ranks)


def parse_group_ranks(value) -> str | None:
    """``"[0, 1]"``, ``[0, 1]`` -> ``"0,1"`` (a compact, hashable form); None for a truncated list
    (never taken for the group: its size would be 30, its members a prefix) or anything else."""
    read = read_group_ranks(value)
    if read is None or read[1]:
        return None
    return compact_ranks(read[0])


def call_group(name: str | None, desc: str | None, ranks_value, size: int | None = None,
               start: int | None = None, stride: int | None = None) -> dict:
    """A process group as a call (``record_param_comms``) or ``distributedInfo.pg_config`` states it:
    ``{name, desc, dim, size, ranks, ranks_head}``.  ``ranks``: the whole group, compact
    (``"0,1"``), when the trace lists it or a truncated list can be rebuilt
    (:func:`full_group_ranks`), else None; ``ranks_head``: a truncated list's first ranks where it
    could not be; ``size``: ``Group size`` / ``pg_size`` where given, else the whole list's length
    (never a truncated list's)."""
    size = size if size is not None and size > 0 else None
    read = read_group_ranks(ranks_value)
    ranks = head = None
    if read is not None:
        listed, truncated = read
        if truncated:
            ranks = full_group_ranks(listed, size, start, stride)
            head = None if ranks is not None else compact_ranks(listed)
        else:
            ranks = listed
        if ranks is not None:
            size = size or len(ranks)
            ranks = compact_ranks(ranks)
    return {"name": name, "desc": desc, "dim": group_dim(name, desc), "size": size, "ranks": ranks,
            "ranks_head": head}
