"""What a communication event is: its op, its payload in bytes, its group.

Names come from many eras and layers -- NCCL kernels (``ncclKernel_*``,
``ncclDevKernel_*``, ``ncclSymk*``, RCCL's ``ncclDevKernel_Generic``), c10d ops
(``c10d::allreduce_``), profiler annotations (``nccl:all_reduce``,
``gloo:all_reduce``), ``record_param_comms`` fields (``Collective name``) and
mfuscope's own call labels (``mfuscope.comm/<dim>/<op>``, :mod:`mfuscope.labels`).  They all
map to one small vocabulary of ops here.
"""
from __future__ import annotations

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


def normalize_op(name: str | None) -> str | None:
    """Canonical collective op for any name above, or None if it names none."""
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


def dim_from_group_desc(desc: str | None) -> str | None:
    """Dimension from a process-group description: DeviceMesh names groups ``mesh_<dim>``."""
    if not desc:
        return None
    if desc == "default_pg":
        return "world"
    m = re.match(r"^mesh_(\w+)$", desc)
    return m.group(1) if m else None


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


def parse_group_ranks(value) -> str | None:
    """``"[0, 1]"``, ``[0, 1]`` -> ``"0,1"`` (a compact, hashable form)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.strip()
        if not value:
            return None
        try:
            value = json.loads(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return ",".join(str(int(v)) for v in value)
    return str(value)
