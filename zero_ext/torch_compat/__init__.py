"""What makes ZeroAdamW pass where torch.optim.Optimizer is expected: torch's state-dict hooks, ``opt.state``
read as a mapping, torch's argument checks and messages, hand-assigned gradients. The optimizer calls into here;
nothing here imports the optimizer."""
