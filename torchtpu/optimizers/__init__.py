"""``torch.tpu.optimizers``: optimizers whose whole step is one XLA program.

- ``AdamW``, ``Adam``, ``SGD``, ``Muon``: ``torch.optim``'s classes (subclasses, usable wherever
  torch.optim's are) whose ``step()`` updates every parameter in one program, the parameters
  and state donated (optimizer.py, program.py);
- ``functional``: the same updates as functions of tensor lists (functional.py);
- ``SingleTraceTrainer``: forward, loss, backward and the optimizer step traced once into one
  program per training step (trainer.py).
"""

from . import functional
from .optimizer import SGD, Adam, AdamW, Muon
from .trainer import SingleTraceTrainer

__all__ = ["AdamW", "Adam", "SGD", "Muon", "SingleTraceTrainer", "functional"]
