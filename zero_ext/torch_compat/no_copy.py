"""Copying or pickling a ZeroAdamW is refused. It holds hooks on the model and its parameters, flat buffers the
parameters' data point into, the state of this rank's shard only (possibly in files) and a process group: a copy
would either share all of that with the original (two optimizers reducing every gradient) or lack it.
torch.optim.Optimizer would copy (``copy.deepcopy``) or pickle (its ``__getstate__``) a half-built object that fails
later; these raise at once, naming what to do instead."""

from __future__ import annotations

from typing import NoReturn

_MESSAGE = (
    "zero_ext.ZeroAdamW cannot be copied or pickled ({how}): it holds hooks on the model, the flat buffers its "
    "parameters point into, this rank's shard of the state and a process group. To copy the state, save it: "
    "opt.state_dict() (this rank's shard, same layout) or zero_ext.checkpoint.save(path, opt) (on every rank; loads "
    "at any world size); then build a new ZeroAdamW over the new parameters and load it into that one"
)


def refuse(how: str):
    def refused(self, *args, **kwargs) -> NoReturn:
        raise TypeError(_MESSAGE.format(how=how))

    refused.__name__ = how
    return refused


deepcopy_refused = refuse("__deepcopy__")
copy_refused = refuse("__copy__")
getstate_refused = refuse("__getstate__")
reduce_refused = refuse("__reduce_ex__")
