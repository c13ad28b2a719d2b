"""zero_ext inside training frameworks, one module per framework, each an optional extra (nothing here is imported
by ``import zero_ext``):

- :mod:`zero_ext.integrations.transformers` (``pip install "zero_ext[hf]"``): ``ZeroTrainer``, transformers'
  ``Trainer`` training with :class:`zero_ext.ZeroAdamW` instead of ``DDP(model)`` + AdamW, its checkpoints saved and
  resumed through :mod:`zero_ext.checkpoint` at any world size.
- :mod:`zero_ext.integrations.lightning` (``pip install "zero_ext[lightning]"``): ``ZeroStrategy``, a PyTorch
  Lightning strategy training with ZeroAdamW (no DDP wrapper, checkpoint directories of shards).
- :mod:`zero_ext.integrations.accelerate` (``pip install "zero_ext[accelerate]"``): ``ZeroAccelerator``, an
  ``accelerate.Accelerator`` whose ``prepare`` hands out a ZeroAdamW and no DDP wrapper.

:mod:`zero_ext.integrations.optimizer_swap` holds what the three share (it imports none of the frameworks).
"""
