"""Run a function on N gloo ranks from a pytest test, in a pool of workers started once per world size.

    results = run_on_ranks(3, my_fn, arg)   # my_fn(rank, world_size, arg) on every rank, in parallel

``my_fn`` must be a module-level function of an importable module (a test module works: pytest puts
every test folder and tests/helpers on sys.path before the first test runs, and the workers inherit it).
Return values come back per rank. An exception on any rank fails the call with every failing rank's traceback; a
call that does not finish within ``timeout`` seconds (e.g. a collective that never matched) kills the pool, which is
started again next time. Starting a pool costs about a second (a fork per rank, below); every later call costs
milliseconds. A worker becomes a rank as bench/harness.py's ``join_group`` makes a benchmark's process one on CPU
(gloo over TCP on 127.0.0.1, one torch thread): written out here so that the tests need nothing from bench/harness.py.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import importlib
import os
import queue
import signal
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

# Ranks fork from a server process that imported torch and zero_ext once (multiprocessing's forkserver, preloaded),
# instead of each starting a fresh interpreter that imports them itself (spawn): about 3 s of CPU per rank on this
# machine, paid again by every pool a test discards. The server runs no torch op, so it holds no thread pool a fork
# could break, and each rank still joins its own gloo group. A rank inherits the server's environment, not the test's
# at the time of the call: the server starts with the first pool, inside _Pool's OMP_NUM_THREADS=1 window.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "zero_ext"])
_POOLS: dict[int, "_Pool"] = {}


def _worker(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    import torch.distributed as dist

    # A rank that does not answer in time is asked, before it is killed, where it is: its Python stacks go to its
    # stderr, which pytest shows with the failing test.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ranks share 2 cores: one thread each keeps them from oversubscribing (and matches torchrun).
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    while True:
        job = inbox.get()
        if job is None:
            break
        module, name, args = job
        try:
            fn = getattr(importlib.import_module(module), name)
            outbox.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (a rendezvous port for a gloo group or a torchrun launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        port = free_port()
        self.outbox = _CTX.Queue()
        self.inboxes = [_CTX.Queue() for _ in range(world_size)]
        env = dict(os.environ)
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            self.procs = [
                _CTX.Process(target=_worker, args=(r, world_size, port, self.inboxes[r], self.outbox), daemon=True)
                for r in range(world_size)
            ]
            for p in self.procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(env)

    def run(self, fn, args, timeout: float):
        for box in self.inboxes:
            box.put((fn.__module__, fn.__name__, args))
        results, failures = {}, {}
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.outbox.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
                self._dump_stacks(missing)
                self.kill()
                details = "".join(f"\n--- rank {r} failed:\n{tb}" for r, tb in sorted(failures.items()))
                where = f"{fn.__name__} on {self.world_size} ranks: ranks {missing}"
                raise TimeoutError(
                    f"{where} did not finish within {timeout} s (their Python stacks are in the captured stderr)"
                    f"{details}"
                ) from None
            (results if ok else failures)[rank] = value
        if failures:
            details = "".join(f"\n--- rank {r}:\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(failures)}:{details}")
        return [results[r] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> None:
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(2)  # faulthandler writes from a signal handler: give it a moment before the kill

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        # Reaped before the next pool spawns: a killed rank's sockets and queue locks are gone by then.
        for p in self.procs:
            p.join(timeout=10)
        _POOLS.pop(self.world_size, None)


def run_on_ranks(world_size: int, fn, *args, timeout: float = 120.0) -> list:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, run concurrently on gloo ranks."""
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.kill()
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool.run(fn, args, timeout)


def discard_pool(world_size: int) -> None:
    """Kill the pool of ``world_size`` workers (e.g. after a test left a collective unmatched in their group)."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.kill()


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


def skip_unless_gpus(world: int) -> None:
    """Skips with the GPU count needed and found, so a GPU session's summary says why nothing ran (one GPU)."""
    import pytest

    found = torch.cuda.device_count()
    if found < world:
        pytest.skip(f"needs {world} GPUs, found {found}")
