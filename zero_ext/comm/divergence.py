"""Rank-dependent control flow is diagnosed, never a silent hang: when a zero_ext collective has waited
``collective_timeout`` seconds, the ranks compare their positions out of band (the process group's store) and,
where they differ, every waiting rank raises :class:`RanksDiverged` naming where each rank is.

Stage 3's gathers are collectives issued from the model's hooks, so every rank must run the same modules in the
same order. When one does not (``if rank == 0: evaluate(model)`` outside ``opt.gathered_params()``, a generation
loop whose length differs per rank, a module run on one rank only, a rank skipping ``backward()`` or ``step()``)
the collectives pair up wrongly and the job waits forever (DeepSpeed #860, #7844): rank 0 in a parameter gather,
rank 1 in a staging acquire. Here:

- Each rank keeps its :class:`~zero_ext.comm.base.Position` (its communicator's): how many zero_ext collectives it issued and, for the last :data:`RING`,
  what each was (kind, elements, bucket, phase, module, step). The hooks set the phase and module, the callers
  the bucket: a few attribute writes per collective, no communication.
- A wait (:class:`DivergenceWatch`, through :meth:`zero_ext.comm.Pending.wait`) blocks on the collective with a
  deadline (``work.wait(timeout)``: the same condition-variable wait as without one, so a collective that finishes
  in time costs nothing more). Past the deadline the rank posts its position to the store and reads every rank's
  until the collective finishes (slow, not wrong: its key is deleted and training goes on), or the positions show
  a divergence: two ranks issued different collectives at the same count, one waits in a collective while another
  waits to enter ``gathered_params()``, or they are more than :data:`RING` collectives apart. A rank that posts
  nothing within another ``collective_timeout`` (it issues no zero_ext collective: it runs something else, has
  finished, or is slower than the timeout allows) is a divergence too. A rank that raised leaves its post, so
  that every rank waiting later raises the same diagnosis.
- ``gathered_params()`` is collective: at stage 3 its entry is a store barrier (two store round trips), so a rank
  entering it alone waits there, out of every collective, and is diagnosed as above instead of pairing its
  gathers with the others' training gathers.
- Stage 3 starts every forward and backward with :meth:`DivergenceWatch.boundary`: one 3-element all-gather on the
  host group of (step, phase, collectives issued), compared on every rank. gloo kills a process that receives a
  larger message than the collective it posted ("op.preamble.length <= op.nbytes", in gloo's own thread, before
  any timeout), and that is what followed when rank 0 evaluated or generated outside ``gathered_params()`` while
  rank 1 trained (measured on the tests' model: rank 0's training forward paired its gathers with rank 1's
  backward ones, 2304 elements into 1280). The check has the same size on every rank, so it pairs with whatever
  stands in its place, and it is the first collective of a phase: ranks that parted at a phase boundary (the
  evaluation, generation of different lengths, a skipped backward or step) raise there, before any mismatched
  gather. It also bounds how far apart the hosts of NCCL ranks get (a phase), which never block otherwise.

What still dies in gloo: a divergence *inside* a phase (a module run on some ranks only, data-dependent routing
that skips a module on one rank) whose first mismatched collective sends a larger message than the receiver
posted. The receiving process is killed by gloo at once; the others' waits then fail with gloo's "Connection
reset/closed by peer" (no hang, but gloo's words). Where the message is not larger (the tests' extra module), the
ranks wait and the comparison above names the first collective at which they differ.

On NCCL the host does not block in ``Pending.wait`` (the stream waits): a divergence is found where the host waits
(the phase checks, step()'s host collective, a gathered_params() entry), and then the NCCL communicator is aborted
(:meth:`zero_ext.comm.Communicator.abort`), so that nothing waits for NCCL's watchdog. Not run here (no GPU).
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .collectives import all_gather_flat

# Collectives remembered per rank. The phase checks keep diverged ranks within a phase of each other (at most 2
# collectives apart in the tests); 64 covers a phase of a model with up to ~30 buckets (a gather and a
# reduce-scatter each).
RING = 64

GUIDE = (
    "At stage 3 every parameter gather is a collective issued from the model's hooks, so every rank must run the "
    "same modules in the same order, the same number of forwards and backwards, and call step() together. Evaluate "
    "or generate on one rank inside `with opt.gathered_params():` (every rank enters it; a forward inside issues no "
    "collective), make per-rank loops run the same number of iterations (pad or truncate to a common length), and "
    "enter gathered_params() on every rank (docs/stage3.md). If the ranks are merely slow, raise "
    "ZeroAdamW(collective_timeout=...)"
)


BOUNDARIES = ("forward", "forward (no_grad)", "backward")  # the phases boundary() checks


class RanksDiverged(RuntimeError):
    """The ranks stopped issuing the same zero_ext collectives (rank-dependent control flow); raised on every rank
    that waits in one, naming where each rank is."""


def describe(entry) -> str:
    """``(count, kind, numel, bucket, phase, module, step)`` in words."""
    count, kind, numel, bucket, phase, module, step = entry
    where = f"bucket {tuple(bucket)}" if bucket is not None else "no bucket"
    module = f" of module {module!r}" if module else ""
    return f"#{count} {kind} of {numel} elements ({where}), {phase}{module}, step {step}"


def _timed_out(error: RuntimeError) -> bool:
    text = str(error).lower()  # work.wait: "Operation timed out!"; store.wait: "Wait timeout ..."
    return "timed out" in text or "timeout" in text


def wait_for(work, seconds: float) -> bool:
    """Block on ``work`` at most ``seconds``; whether it finished (an error of the collective itself raises)."""
    try:
        work.wait(datetime.timedelta(seconds=seconds))
        return True
    except RuntimeError as e:
        if not _timed_out(e):
            raise
        return False


class DivergenceWatch:
    """The waits of one communicator's collectives, with the out-of-band check past ``timeout`` seconds."""

    # Watches built per process group: building an optimizer is collective over its group, so every rank of the
    # group numbers its watches alike and their store keys pair up (a rank's optimizers over other groups aside).
    _instances: dict[str, int] = {}

    def __init__(self, comm, timeout: float):
        self.comm, self.timeout = comm, float(timeout)
        self.limit = datetime.timedelta(seconds=self.timeout)  # the deadline of every wait (Pending.wait's own)
        self._poll = min(2.0, max(0.05, self.timeout / 20))
        name = self._group().group_name
        number = DivergenceWatch._instances[name] = DivergenceWatch._instances.get(name, 0) + 1
        self._prefix = f"zero_ext/divergence/{number}/"  # the group's store has the group's own prefix
        self._store = None  # found on the slow path only
        self._entries = 0  # gathered_params() entries

    # ---------------------------------------------------------------- the two kinds of wait
    def wait(self, work, seq: int) -> None:
        """Wait for collective ``seq``'s ``work``; raises :class:`RanksDiverged` where the ranks parted."""
        try:
            work.wait(self.limit)  # fast path: the ordinary wait, with a deadline
        except RuntimeError as e:
            self.waited_past_deadline(e, work, seq)

    def waited_past_deadline(self, error: RuntimeError, work, seq: int) -> None:
        """A wait for collective ``seq``'s ``work`` with :attr:`limit` raised ``error``: anything but the deadline is
        raised again; past the deadline the ranks' positions are compared (the slow path; the fast path is
        :meth:`zero_ext.comm.Pending.wait`'s own wait with the deadline, or :meth:`wait`)."""
        if not _timed_out(error):
            raise error
        self._diagnose(lambda seconds: wait_for(work, seconds), {"in": "collective", "seq": seq})

    def enter_gathered(self) -> None:
        """``gathered_params()`` entry, stage 3: a store barrier of every rank, before any of its gathers."""
        self._entries += 1
        store, world = self._get_store(), self.comm.process_count
        key = f"{self._prefix}gathered/{self._entries}"
        if store.add(key, 1) >= world:
            store.set(key + "/all", b"1")
            if self._entries > 1:  # every rank is here, so past the previous entry's wait: its keys can go
                previous = f"{self._prefix}gathered/{self._entries - 1}"
                store.delete_key(previous)
                store.delete_key(previous + "/all")
            return

        def arrived(seconds: float) -> bool:
            try:
                store.wait([key + "/all"], datetime.timedelta(seconds=seconds))
                return True
            except (RuntimeError, dist.DistStoreError) as e:
                if not _timed_out(e):
                    raise
                return False

        if not arrived(self.timeout):
            self._diagnose(arrived, {"in": "gathered_params", "entry": self._entries})

    def boundary(self, phase: str) -> None:
        """Stage 3, at the start of every forward and backward: every rank's (step, phase, collectives issued so
        far), gathered on the host group and compared. gloo kills a process that receives a larger message than
        the collective it posted ("op.preamble.length <= op.nbytes"), before any timeout, which is what follows
        when one rank evaluates or generates while another trains: this one tiny collective per phase (the same
        size on every rank, so it pairs with anything in its place) finds such a divergence before the first
        mismatched gather."""
        pos, world = self.comm.position, self.comm.process_count
        code = BOUNDARIES.index(phase)
        mine = torch.tensor([pos.step, code, pos.count], dtype=torch.int64)
        everyone = torch.empty(world * 3, dtype=torch.int64)
        seq = pos.issued("phase_check", 3)
        group = self.comm.cpu_group
        self.wait(all_gather_flat(everyone, mine, group=group, async_op=True), seq)
        rows = everyone.view(world, 3).tolist()
        if any(row != rows[0] for row in rows):
            lines = [
                f"zero_ext.ZeroAdamW: the ranks stopped running the same modules (rank-dependent control flow; "
                f"checked at the start of a {phase} on rank {self.comm.process_rank}). Where each rank is:"
            ]
            for r, (step, c, count) in enumerate(rows):
                lines.append(f"  rank {r}: starting a {BOUNDARIES[c]} at step {step}, {count} collectives issued")
            lines.append(GUIDE)
            self.comm.abort()  # NCCL: the device may hold collectives issued before this check that never pair
            raise RanksDiverged("\n".join(lines))

    # ---------------------------------------------------------------- the slow path
    def _group(self):
        return self.comm.group if self.comm.group is not None else dist.distributed_c10d._get_default_group()

    def _get_store(self):
        if self._store is None:
            self._store = dist.distributed_c10d._get_process_group_store(self._group())
        return self._store

    def _key(self, rank: int) -> str:
        return f"{self._prefix}rank/{rank}"

    def _post(self, waiting: dict, raised: Optional[str] = None) -> None:
        pos = self.comm.position
        post = dict(rank=self.comm.process_rank, count=pos.count, waiting=waiting, ring=pos.recent(), phase=pos.phase,
                    module=pos.module, step=pos.step, raised=raised)  # fmt: skip
        self._get_store().set(self._key(self.comm.process_rank), json.dumps(post))

    def _read(self) -> dict[int, dict]:
        store, posts = self._get_store(), {}
        for r in range(self.comm.process_count):
            key = self._key(r)
            if store.check([key]):
                posts[r] = json.loads(store.get(key))
        return posts

    def _diagnose(self, done: Callable[[float], bool], waiting: dict) -> None:
        self._post(waiting)
        since = time.monotonic()
        while True:
            if done(self._poll):
                self._get_store().delete_key(self._key(self.comm.process_rank))  # slow, not wrong
                return
            posts = self._read()
            verdict = divergence(posts, self.comm.process_count)
            missing = [r for r in range(self.comm.process_count) if r not in posts]
            if verdict is None and missing and time.monotonic() - since > self.timeout:
                verdict = (
                    f"rank(s) {missing} issued no zero_ext collective for {2 * self.timeout:g} s while the others "
                    "waited in one: they run something else (their own forward, evaluation, a loop of another "
                    "length), have finished training, or are slower than collective_timeout allows"
                )
            if verdict is not None:
                message = self._message(verdict, posts, missing)
                self._post(waiting, raised=verdict)
                self.comm.abort()
                raise RanksDiverged(message)

    def _message(self, verdict: str, posts: dict[int, dict], missing: list[int]) -> str:
        lines = [
            f"zero_ext.ZeroAdamW: the ranks stopped running the same collectives (rank-dependent control flow; seen "
            f"by rank {self.comm.process_rank} after waiting {self.timeout:g} s): {verdict}. Where each rank is:"
        ]
        for r in range(self.comm.process_count):
            lines.append(f"  rank {r}: " + (where(posts[r]) if r in posts else "not waiting in a zero_ext collective"))
        lines.append(GUIDE)
        return "\n".join(lines)


def where(post: dict) -> str:
    """One rank's position in words."""
    waiting, ring = post["waiting"], post["ring"]
    module = f" of module {post['module']!r}" if post["module"] else ""
    if waiting["in"] == "gathered_params":
        head = f"waiting for every rank to enter gathered_params() (entry {waiting['entry']})"
    else:
        entry = next((e for e in ring if e[0] == waiting["seq"]), None)
        head = f"waiting in collective {describe(entry)}" if entry else f"waiting in collective #{waiting['seq']}"
    return f"{head}; {post['count']} collectives issued, now in {post['phase']}{module} at step {post['step']}"


def _identity(entry) -> tuple:
    """What must be equal across ranks at the same count: kind, elements, bucket and step."""
    return (entry[1], entry[2], None if entry[3] is None else tuple(entry[3]), entry[6])


def divergence(posts: dict[int, dict], world: int) -> Optional[str]:
    """Why the posted positions cannot belong to ranks running the same collectives, or None (maybe slow)."""
    raised = [(r, p["raised"]) for r, p in sorted(posts.items()) if p["raised"]]
    if raised:
        return f"{raised[0][1]} (found by rank {raised[0][0]})"
    entering = sorted(r for r, p in posts.items() if p["waiting"]["in"] == "gathered_params")
    if entering and len(entering) < len(posts):
        others = sorted(set(posts) - set(entering))
        return f"rank(s) {entering} wait to enter gathered_params() while rank(s) {others} wait in a collective"
    if len({p["waiting"].get("entry") for p in posts.values()}) > 1:
        return "the ranks wait at different gathered_params() entries"
    by_count: dict[int, dict[int, list]] = {}
    for r, p in posts.items():
        for e in p["ring"]:
            by_count.setdefault(e[0], {})[r] = e
    for count in sorted(by_count):
        entries = by_count[count]
        if len({_identity(e) for e in entries.values()}) > 1:
            parts = "; ".join(f"rank {r} {describe(e)}" for r, e in sorted(entries.items()))
            return f"they first differ at collective #{count}: {parts}"
    seqs = [p["waiting"]["seq"] for p in posts.values() if p["waiting"]["in"] == "collective"]
    if seqs and max(p["count"] for p in posts.values()) - min(seqs) >= RING:
        return f"one rank waits in collective #{min(seqs)} while another has issued {RING} or more beyond it"
    return None
