"""Cross-replica collectives, called inside a replica function (nests in, nests out).

The semantic layer over the engine contract; it never moves bytes itself.
One concept per module:

* ``api.py``: the public collectives; validate once at the boundary, then call.
* ``leaves.py``: nests, numbers and argument checks, canonicalised once.
* ``autodiff.py``: the eager call (the engine, or an autograd Function when
  autograd or torch.vmap needs one) and the dual-collective table, beside the
  forward: every backward is itself differentiable.
* ``compiled.py``: the collectives as ``torch.library`` custom operators, with
  fake implementations and the same backward, for ``torch.compile``.

Semantics, dtype rules and the differentiability table: docs/collectives.md.
"""

from .api import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    collective_permute,
    cross_replica_average,
    cross_replica_mean,
    cross_replica_sum,
    num_replicas,
    reduce_scatter,
    replica_id,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "collective_permute",
    "cross_replica_average",
    "cross_replica_mean",
    "cross_replica_sum",
    "num_replicas",
    "reduce_scatter",
    "replica_id",
]
