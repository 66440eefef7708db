"""attention lowerings."""
from __future__ import annotations

import jax.numpy as jnp
import torch

from .registry import register

aten = torch.ops.aten
