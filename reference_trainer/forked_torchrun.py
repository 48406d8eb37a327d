"""torchrun for the reference trainer, with ranks forked from a process that imported torch once.

``python -m mfuscope.reference_trainer.forked_torchrun [torchrun options] -m
mfuscope.reference_trainer.train [trainer options]`` takes torchrun's own options
(its parser, its rendezvous, its elastic agent, restarts and failure handling) and
differs in one thing: each rank is forked from a fork server that imported torch,
torch._dynamo and the trainer once (:mod:`.rank_imports`), where torchrun starts a
fresh interpreter per rank.  ``mfuscope train`` launches this way.  Measured on 2
cores, the machine's CPU seconds for the whole job, tiny_dense: 2 ranks, 2 steps 9.7-10.0
through torchrun, 5.3-5.8 forked; 8 ranks (dp_shard=2,tp=2,pp=2, 5 steps, traced) 55-57
against 27-30, 29 s of wall time against 16-17.

Not forked from the agent itself: it runs threads (the rendezvous store's), and a
rank forked while one of them held a lock inherits the lock held forever (measured:
an 8-rank run hung in its first connection, glibc's resolver lock taken by the
agent's thread at the fork).  The fork server is a fresh interpreter that runs
nothing but the forks (its other threads are the idle pools of OpenBLAS and jemalloc,
which prepare themselves for a fork, as under the tests' fork launcher); it is started
after torchrun has set the ranks' environment (``OMP_NUM_THREADS``), and its children
get a fresh interpreter's signal handlers.
"""
from __future__ import annotations

import multiprocessing
import sys
import uuid

from .launch import TRAINER, train_rank

#: What the fork server imports before it forks the first rank.
PRELOAD = "mfuscope.reference_trainer.rank_imports"


def main(argv: list[str] | None = None) -> None:
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(argv)
    if not args.module or args.training_script != TRAINER:
        sys.exit(f"forked_torchrun: error: it launches only `-m {TRAINER}` (got {args.training_script!r}); "
                 "use torchrun for other scripts")
    args.start_method = "forkserver"
    multiprocessing.set_forkserver_preload([PRELOAD])
    if args.standalone:  # as torchrun's run(): a rendezvous on this machine, on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    record(elastic_launch(config, entrypoint=train_rank))(*args.training_script_args)


if __name__ == "__main__":
    main()
