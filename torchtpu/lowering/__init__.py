"""The lowering table. Importing this package fills ``registry.LOWERINGS``.

One module per op family; each registers pure JAX functions with ``registry.register``.
"""
from . import registry  # noqa: F401
from . import (  # noqa: F401
    activations,
    asserts,
    attention,
    control_flow,  # fills hops.HOPS
    copy,
    elementwise,
    factories,
    fft,
    flex_attention,  # fills hops.HOPS
    foreach,
    graph_ops,
    grouped_mm,
    indexing,
    linalg,
    nested,
    losses,
    nn,
    optim,
    random,
    reductions,
    rnn,
    shape,
)

foreach.register_all()  # maps base lowerings over lists: needs every family registered first
