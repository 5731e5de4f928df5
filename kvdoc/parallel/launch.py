"""Start ``N`` ranks on this machine with torch.distributed and collect what each returns.

:func:`launch` runs ``fn(rank, world_size, *args)`` on every rank and returns the results, rank
order: here, for one rank and no process group; on ``N`` new processes that join a group at
a free port of ``127.0.0.1`` (no ``torchrun`` needed), each on one torch thread and handing its
result back through a file (forked from multiprocessing's fork server where the platform has
one, :data:`START_METHOD`); or, in a process group already initialized (or started by
``torchrun``), on this process's rank, every rank receiving every result. A rank that raises
makes :func:`launch` raise.

The backend (:func:`choose_backend`): NCCL where CUDA has a GPU per rank, gloo otherwise. NCCL
carries only CUDA tensors, so kvdoc's own runs, on CPU tensors, ask for gloo; the NCCL path has
not been run here (no GPU on the machine that builds the site).

>>> launch(_square_of_rank, 1)
[0]
>>> choose_backend(2, "gloo")
'gloo'
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvdoc.core.cache import check_int

TIMEOUT = timedelta(seconds=120)
"""How long a rank waits in a collective before giving up: a rank that died or took another
branch makes the others fail instead of hanging."""


BACKENDS = ("gloo", "nccl")
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
"""How ranks start: forked by a fork server that has imported only what
``multiprocessing.set_forkserver_preload`` named (no OpenMP threads to hang a fork), so with
torch and kvdoc preloaded a rank starts in milliseconds, not seconds; else spawned."""


def choose_backend(world_size: int, requested: str | None = None) -> str:
    """``requested`` (refused if unknown, or ``"nccl"`` with fewer GPUs than ranks), or, when
    None, ``"nccl"`` if CUDA has ``world_size`` GPUs, else ``"gloo"``."""
    check_int("world_size", world_size)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested is None:
        return "nccl" if gpus >= world_size else "gloo"
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; known: {', '.join(BACKENDS)}")
    if requested == "nccl" and gpus < world_size:
        raise ValueError(f"the nccl backend needs one CUDA GPU per rank: {world_size} ranks, "
                         f"{gpus} GPU(s) here; use gloo")
    return requested


def stop_fork_server() -> None:
    """Stop multiprocessing's fork server if this process started one, and wait for it: it
    reaps what it forked (ranks, pool workers), so their CPU time then counts in this process's
    children's (``time``, ``getrusage``), as a spawned process's does."""
    from multiprocessing import forkserver

    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)  # no public way
    if stop is not None:
        stop()


def free_port() -> int:
    """A TCP port on ``127.0.0.1`` that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _square_of_rank(rank: int, world_size: int) -> int:
    return rank * rank


def _entry(rank: int, world_size: int, port: int, folder: str, backend: str) -> None:
    torch.set_num_threads(1)  # N ranks share the machine's cores
    fn, args = torch.load(os.path.join(folder, "call.pt"), weights_only=False)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(folder, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def together(rank: int, world_size: int, calls: list[tuple[Callable[..., Any], tuple]]) -> list:
    """``[fn(rank, world_size, *args) for fn, args in calls]``: several runs on one launch.

    >>> launch(together, 1, [(_square_of_rank, ()), (_square_of_rank, ())])
    [[0, 0]]
    """
    return [fn(rank, world_size, *args) for fn, args in calls]


def launch(fn: Callable[..., Any], world_size: int, *args: Any,
           backend: str | None = None) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each on its own rank,
    on :func:`choose_backend` ``(world_size, backend)``; ``fn`` and ``args`` must pickle. A
    ValueError for a ``world_size`` other than this process's group's, or a refused backend."""
    backend = choose_backend(world_size, backend)
    if not dist.is_initialized() and "TORCHELASTIC_RUN_ID" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=TIMEOUT)  # torchrun's rank and rendezvous
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"this process group has {dist.get_world_size()} ranks, "
                             f"the run needs {world_size}")
        mine = fn(dist.get_rank(), world_size, *args)
        results: list[Any] = [None] * world_size
        dist.all_gather_object(results, mine)
        return results
    if world_size == 1:
        return [fn(0, 1, *args)]
    with tempfile.TemporaryDirectory(prefix="kvdoc-ranks-") as folder:
        # through a file, not the start arguments: a fork server passes a tensor's shared memory
        # as a file descriptor, and refuses more than a few hundred of them
        torch.save((fn, args), os.path.join(folder, "call.pt"))
        mp.start_processes(_entry, args=(world_size, free_port(), folder, backend),
                           nprocs=world_size, join=True, start_method=START_METHOD)
        return [torch.load(os.path.join(folder, f"{rank}.pt"), weights_only=False)
                for rank in range(world_size)]
