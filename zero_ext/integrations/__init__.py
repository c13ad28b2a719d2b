"""zero_ext inside training frameworks, one module per framework, each an optional extra (nothing here is imported
by ``import zero_ext``):

- :mod:`zero_ext.integrations.transformers` (``pip install "zero_ext[hf]"``): ``ZeroTrainer``, transformers'
  ``Trainer`` training with :class:`zero_ext.ZeroAdamW` instead of ``DDP(model)`` + AdamW, its checkpoints saved and
  resumed through :mod:`zero_ext.checkpoint` at any world size.
"""
