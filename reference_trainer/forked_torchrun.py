"""torchrun for the reference trainer, with ranks forked from an agent that imported torch once.

``python -m mfuscope.reference_trainer.forked_torchrun [torchrun options] -m
mfuscope.reference_trainer.train [trainer options]`` takes torchrun's own options
(its parser, its rendezvous, its elastic agent, restarts and failure handling) and
differs in one thing: the agent starts each rank by forking itself after importing
torch, torch._dynamo and the trainer, where torchrun starts a fresh interpreter per
rank.  ``mfuscope train`` launches this way.  Measured on 2 cores (``mfuscope train``,
2 steps of tiny_dense on 2 ranks): 9.9 CPU s through torchrun, 5.1 s forked; each rank
saves its own import of torch and torch._dynamo (2.9 CPU s).

What a forked rank would otherwise inherit from the agent is put back as a fresh
interpreter has it: the signal handlers the agent installed (SIGTERM, SIGINT,
SIGHUP, SIGQUIT raise in the agent, not in a rank), the thread count torchrun asks
for (``OMP_NUM_THREADS``, read by OpenMP when torch loaded, before torchrun set
it), and unbuffered output (torchrun runs ranks with ``python -u``).  No CUDA call
is made in the agent, so forking is safe on a GPU machine (where one has been, the ranks are
spawned instead).
"""
from __future__ import annotations

import os
import signal
import sys
import uuid

from mfuscope.lean_imports import jsonschema_without_iri

from .launch import TRAINER, import_for_the_ranks


def train_rank(*argv: str) -> None:
    """One rank, in a process forked from the agent: a fresh interpreter's state, then the trainer."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from . import train

    rc = train.main(list(argv))
    if rc:
        sys.exit(rc)


def main(argv: list[str] | None = None) -> None:
    jsonschema_without_iri()
    import torch
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    from . import train  # noqa: F401 -- imported once here, inherited by every rank

    args = torchrun.parse_args(argv)
    if not args.module or args.training_script != TRAINER:
        sys.exit(f"forked_torchrun: error: it launches only `-m {TRAINER}` (got {args.training_script!r}); "
                 "use torchrun for other scripts")
    import_for_the_ranks()
    # Forking after CUDA is initialized leaves the ranks without it; nothing imported here does so,
    # and should something start to, the ranks start fresh (as torchrun's) rather than fail.
    args.start_method = "spawn" if torch.cuda.is_initialized() else "fork"
    if args.standalone:  # as torchrun's run(): a rendezvous on this machine, on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    record(elastic_launch(config, entrypoint=train_rank))(*args.training_script_args)


if __name__ == "__main__":
    main()
