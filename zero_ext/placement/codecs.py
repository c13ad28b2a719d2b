"""How a flat group's optimizer state is encoded, apart from where it lives.

A placement (:mod:`.device`, :mod:`.host`, :mod:`.disk`) keeps every kind of the update rule as *bits*, in the
kind's stored dtype, and answers three questions of the :class:`Store` protocol: the bits of a range of a kind
(``stored``), overwrite them (``store``), and the parameters' rank slices over a range (``param_runs``, the master's
high half with ``param_remainders``). A :class:`StateCodec`, made from the rule, turns those bits into the fp32 values
serialisers read and write (state dicts, checkpoints, consolidation, a loaded or followed master):

- fp32 kinds: as kept;
- bf16 moments (``moment_dtype=torch.bfloat16``): widened on read (exact), rounded to nearest even on write;
- int8 moments (``moment_dtype=torch.int8``): codes plus fp32 block scales; dequantized on read, and on write the
  blocks a range touches are requantized with their new absmax (elements outside it, padding in practice, keep their
  values up to that);
- ``param_remainders``: the fp32 master is the bf16 parameter joined with the int16 ``remainder`` kind and a tie bit
  in the sign bit (bit 7 of int8 codes) of the rule's ``tie_kind`` (:mod:`..update.master_split`). Serialisers never
  see the bit: reading the master joins the three, reading the tie kind clears it, writing the master sets it and
  writing the tie kind keeps it.

So any placement composes with any encoding: the placement says where the bits are, the codec what they mean.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ..layout import Bucket, Range
from ..update import blockwise_int8, master_split
from ..update.adamw import MASTER, REMAINDER, UpdateRule


class Store(Protocol):
    """What a codec needs of a placement: a kind's bits over a shard range, and the parameters' rank slices."""

    def stored(self, kind: str, shard_range: Range) -> torch.Tensor: ...

    def store(self, kind: str, shard_range: Range, values: torch.Tensor) -> None: ...

    def param_runs(self, shard_range: Range) -> list[tuple[Range, torch.Tensor]]: ...


def widened(values: torch.Tensor) -> torch.Tensor:
    """A kind's values as serialisers see them: fp32 (a bf16 moment widened, exactly; fp32 as is, not copied)."""
    return values.float() if values.dtype == torch.bfloat16 else values


class StateCodec:
    """The encoding of ``rule``'s kinds: :meth:`read` and :meth:`write` fp32 values over a placement's bits."""

    def __init__(self, rule: UpdateRule):
        self.rule = rule

    def converts(self, kind: str) -> bool:
        """Whether ``kind``'s fp32 values are not its bits (then no writable view of them can be lent)."""
        rule = self.rule
        return (kind == MASTER and rule.param_remainders) or kind == rule.tie_kind or kind in rule.quantized

    def read(self, store: Store, kind: str, shard_range: Range) -> torch.Tensor:
        """``shard_range`` of ``kind`` as fp32 values (a view of the bits where they are fp32 and one run)."""
        if kind == MASTER and self.rule.param_remainders:
            return self._read_joined_master(store, shard_range)
        if kind in self.rule.quantized:
            return self._read_dequantized(store, kind, shard_range)
        if kind == self.rule.tie_kind:  # param_remainders: the tie bits cleared
            return widened(master_split.without_tie(store.stored(kind, shard_range)))
        return widened(store.stored(kind, shard_range))

    def write(self, store: Store, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        """``shard_range`` of ``kind`` := ``values`` (any device; cast to the stored dtype, rounding to nearest
        even)."""
        if kind == MASTER and self.rule.param_remainders:
            return self._write_split_master(store, shard_range, values)
        if kind in self.rule.quantized:
            return self._write_quantized(store, kind, shard_range, values)
        if kind == self.rule.tie_kind:  # param_remainders: the tie bits kept
            old = store.stored(kind, shard_range)
            values = master_split.with_tie(values.detach().to(old.device, old.dtype), master_split.tie_of(old))
        store.store(kind, shard_range, values)

    # ---------------------------------------------------------------- param_remainders: the master in three parts
    def _ties(self, store: Store, shard_range: Range) -> torch.Tensor:
        """The masters' tie bits over ``shard_range`` (bool, on the state's device)."""
        return master_split.tie_of(store.stored(self.rule.tie_kind, shard_range))

    def _set_ties(self, store: Store, shard_range: Range, tie) -> None:
        """The tie kind's sign bits over ``shard_range`` := ``tie`` (None: cleared); its values are kept."""
        kind = self.rule.tie_kind
        old = store.stored(kind, shard_range)
        new = master_split.without_tie(old) if tie is None else master_split.with_tie(old, tie.to(old.device))
        store.store(kind, shard_range, new)

    def clear_ties(self, store: Store, buckets: Sequence[Bucket]) -> None:
        """Every tie bit cleared (a master set from the parameters exactly), bucket by bucket: the temporaries stay
        bounded."""
        for bucket in buckets:
            self._set_ties(store, bucket.shard_range, None)

    def _read_joined_master(self, store: Store, shard_range: Range) -> torch.Tensor:
        remainder = store.stored(REMAINDER, shard_range)
        with torch._C.DisableTorchFunctionSubclass():  # stage 3's shard is a ShardedParameter's storage
            params = torch.cat([v.to(remainder.device) for _, v in store.param_runs(shard_range)])
        return master_split.join(params, remainder, self._ties(store, shard_range).to(remainder.device))

    def _write_split_master(self, store: Store, shard_range: Range, values: torch.Tensor) -> None:
        remainder = store.stored(REMAINDER, shard_range)
        param, low, tie = master_split.split(values.detach().to(remainder.device, torch.float32))
        store.store(REMAINDER, shard_range, low)
        self._set_ties(store, shard_range, tie)
        with torch._C.DisableTorchFunctionSubclass():
            for part, view in store.param_runs(shard_range):
                view.copy_(part.shifted(-shard_range.start).of(param))

    # ---------------------------------------------------------------- int8 moments: codes and block scales
    def _read_dequantized(self, store: Store, kind: str, shard_range: Range) -> torch.Tensor:
        """``shard_range`` of the int8 moment ``kind``, dequantized (fp32; the tie bit ignored)."""
        scale_kind, qmap = self.rule.quantized[kind]
        wide = shard_range.whole_blocks(self.rule.block)  # a shard is whole blocks
        codes, scales = store.stored(kind, wide), store.stored(scale_kind, wide)
        values = blockwise_int8.dequantize(codes, scales, self.rule.block, qmap.to(codes.device))
        return shard_range.shifted(-wide.start).of(values)

    def _write_quantized(self, store: Store, kind: str, shard_range: Range, values: torch.Tensor) -> None:
        """The blocks ``shard_range`` touches requantized with ``values`` in the range; the tie bits kept."""
        scale_kind, qmap = self.rule.quantized[kind]
        wide = shard_range.whole_blocks(self.rule.block)
        full = self._read_dequantized(store, kind, wide).clone()
        shard_range.shifted(-wide.start).of(full).copy_(values.detach().reshape(-1))
        codes, scales = blockwise_int8.quantize(full, self.rule.block, qmap.to(full.device))
        if kind == self.rule.tie_kind:
            codes = master_split.with_tie(codes, master_split.tie_of(store.stored(kind, wide)).to(codes.device))
        store.store(kind, wide, codes)
        store.store(scale_kind, wide, scales)
