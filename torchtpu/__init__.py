"""torchtpu: PyTorch's "tpu" device on any PJRT backend (TPU, GPU or CPU) through JAX.

``import torch`` loads this through the ``torch.backends`` entry point; set
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to turn that off and ``import torchtpu`` explicitly.
"""
from ._version import __version__

__all__ = ["__version__"]


def _autoload() -> None:
    """The ``torch.backends`` entry point: importing this module did the work.

    Defined before the imports below: when ``import torchtpu`` (or ``python -m torchtpu.x``)
    comes first, its ``import torch`` calls this entry point on the half-initialised module.
    """


from .runtime import devices as _devices  # noqa: F401  (enables jax x64 first)
from .device.registration import register as _register

_register()

from .distributed import register as _register_distributed  # noqa: E402

_register_distributed()  # c10d backend "tpu_dist"; joins a cluster lazily

import torch as _torch  # noqa: E402

from . import optimizers as _optimizers  # noqa: E402

_torch.tpu.optimizers = _optimizers  # torch.tpu.optimizers


# torch.tpu.ops: the ops layer sits above the device layer (its ops register kernels for
# "tpu"), so it is attached to torch.tpu here rather than imported by device/tpu_module.py
from . import ops as _ops  # noqa: E402
from .device import tpu_module as _tpu_module  # noqa: E402

_tpu_module.ops = _ops

from .integrations import install as _install_integrations  # noqa: E402

_install_integrations()

from .runtime.program_cache import load_working_set as _load_working_set  # noqa: E402

_load_working_set()  # a warm start: the programs this command line used last time, ahead
