"""The sharded optimizer update (ZeRO stage 1) of CrossShardOptimizer.

Design. Each parameter group's parameters are viewed as one flat vector of
``n`` elements, padded to ``k * c`` for a replica group of ``k`` (``c =
ceil(n / k)``). The member at position ``j`` of the group owns elements ``[j*c,
(j+1)*c)``: a step reduce-scatters the flat gradient (the same elementwise
MEAN/SUM as the unsharded all-reduce, so the owner's shard of the gradient is
bitwise the unsharded one), steps an optimizer of the wrapped optimizer's class
over the shard only (its state is 1/k of the unsharded state), and all-gathers
the updated shards into every replica's parameters.

For elementwise optimizers (SGD, Adam, AdamW, RMSprop, ...) the update of each
element depends only on that element, so the parameters are bitwise those of
the unsharded update. Optimizers that look across a tensor (LBFGS, Adafactor,
anything taking norms) see a shard instead of whole tensors: not supported
(closures are refused). A parameter without a gradient in a step counts as a
zero gradient (its optimizer state still advances). ``state_dict()`` is a
collective: it all-gathers every shard's state into the unsharded format, so it
loads into an unsharded optimizer, and ``load_state_dict`` takes that format
back.

In-process with overlap=True (every member of the group a replica thread of this
process, parameters on the CPU) the gradients arrive already all-reduced, and
the flat buffers would only add copies: each member's shard optimizer steps
views of its own parameters' slices in ``[j*c, (j+1)*c)`` (with views of the
reduced gradients), then, between two barriers, each member copies the other
members' updated slices from their parameters (less memory traffic than the
replicated update or the flat path: BENCHMARKS.md, "Training step: 2 in-process
replicas vs one process"). ``state_dict`` gathers the members' slices through a meeting of
the replica threads, in the same unsharded format.
"""

from __future__ import annotations

from typing import Any

import torch

from ..context import ReplicaContext
from ..engines.base import BARRIER, MERGE_CALL, AllGatherParams, Call, Engine, Kind, ReduceScatterParams
from ..engines.wire import execute_on_wire
from ..groups import Groups, group_of
from ..reduce_op import ReduceOp
from .guards import exempt

__all__ = ["ShardedUpdate", "state_bytes"]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors held in ``optimizer.state`` (the memory the sharding saves)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


class _Layout:
    __slots__ = ("chunk", "flats", "groups", "k", "pos", "shards", "sizes")

    def __init__(self, groups: Groups, pos: int, k: int, param_groups: list[dict[str, Any]]):
        self.groups, self.pos, self.k = groups, pos, k
        self.sizes = [sum(p.numel() for p in g["params"]) for g in param_groups]
        self.chunk = [-(-n // k) for n in self.sizes]
        self.shards: list[torch.Tensor] = []
        for g, c in zip(param_groups, self.chunk):
            params = g["params"]
            if len({(p.dtype, p.device) for p in params}) > 1:
                raise ValueError("shard_optimizer_state=True needs one dtype and device per parameter group; "
                                 "put parameters of other dtypes or devices in groups of their own")
            self.shards.append(torch.zeros(c, dtype=params[0].dtype, device=params[0].device))
        # Persistent flat gradients (padding stays zero): no fresh pages every step.
        self.flats = [torch.zeros(c * k, dtype=s.dtype, device=s.device) for s, c in zip(self.shards, self.chunk)]


class _Views:
    """The in-process form: this member's slices of its own parameters, and every
    member's parameters (to copy their updated slices from)."""

    __slots__ = ("groups", "pos", "k", "slices", "views", "zeros", "members", "ranges", "ptrs")

    def __init__(self, groups: Groups, pos: int, k: int, param_groups: list[dict[str, Any]],
                 members: list[list[list[torch.Tensor]]]):
        self.groups, self.pos, self.k, self.members = groups, pos, k, members
        #: per param group, per member: [(parameter index, start, stop)] within each flattened parameter
        self.ranges: list[list[list[tuple[int, int, int]]]] = []
        for g in param_groups:
            sizes = [p.numel() for p in g["params"]]
            c = -(-sum(sizes) // k)
            per_member = []
            for j in range(k):
                lo, hi, off, mine = j * c, (j + 1) * c, 0, []
                for index, n in enumerate(sizes):
                    a, b = max(lo, off), min(hi, off + n)
                    if a < b:
                        mine.append((index, a - off, b - off))
                    off += n
                per_member.append(mine)
            self.ranges.append(per_member)
        self.slices = [r[pos] for r in self.ranges]
        self.views = [[g["params"][i].detach().view(-1)[a:b] for i, a, b in mine]
                      for g, mine in zip(param_groups, self.slices)]
        self.ptrs = _data_ptrs(param_groups)  # the storage the views alias
        self.zeros: dict[int, torch.Tensor] = {}  # the gradient of a slice whose parameter has none


class ShardedUpdate:
    """The shard optimizer and layout of one CrossShardOptimizer replica."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.inner: torch.optim.Optimizer | None = None
        self.layout: _Layout | None = None
        self.views: _Views | None = None
        self._pending_state: dict[str, Any] | None = None

    def _setup(self, groups: Groups, rid: int) -> _Layout:
        if self.layout is not None and self.layout.groups == groups:
            return self.layout
        group = group_of(groups, rid)
        layout = _Layout(groups, group.index(rid), len(group), self.optimizer.param_groups)
        self.layout = layout
        self.inner = type(self.optimizer)([self._hyper(g, [s]) for g, s in
                                           zip(self.optimizer.param_groups, layout.shards)])  # type: ignore[call-arg]
        exempt(self.inner)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._load(state)
        return layout

    @staticmethod
    def _hyper(group: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
        return {**{k: v for k, v in group.items() if k != "params"}, "params": params}

    def _inner(self) -> torch.optim.Optimizer:
        """The optimizer of this replica's shard (set up on the first step or state call)."""
        if self.inner is None:
            raise RuntimeError("the sharded update has no shard optimizer yet; it is set up on the first step")
        return self.inner

    def step(self, rctx: ReplicaContext, groups: Groups, op: ReduceOp, reduced: bool = False,
             in_place: bool = False) -> None:
        """One sharded update; ``reduced``: the gradients are already all-reduced
        (``synchronize()``, or overlap), so this replica's shard is its slice of them;
        ``in_place``: every step comes reduced (overlap), so the in-process form may serve."""
        rid, engine = rctx.replica_id_in_sync_group, rctx.engine
        _reject_sparse(self.optimizer.param_groups)  # before any engine call: no peer left waiting
        if self.views is not None or (in_place and reduced and self.layout is None
                                      and _one_process(engine, groups, rid, self.optimizer.param_groups)):
            self._view_step(rctx, groups)
            return
        layout = self._setup(groups, rid)
        inner = self._inner()
        for i, g in enumerate(self.optimizer.param_groups):
            params, c = g["params"], layout.chunk[i]
            flat = layout.flats[i]
            offset = 0
            for p in params:
                view = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                offset += p.numel()
            if reduced:
                grad = flat[layout.pos * c:(layout.pos + 1) * c]
            else:
                call = Call.of(Kind.REDUCE_SCATTER, groups, ReduceScatterParams(op, (0,)), [flat])
                (grad,) = execute_on_wire(engine, rid, call, [flat])
            shard = layout.shards[i]
            lo, hi = layout.pos * c, min((layout.pos + 1) * c, layout.sizes[i])
            with torch.no_grad():  # the parameters may have changed since the last step (a load)
                offset = 0
                for p in params:
                    a, b = max(lo, offset), min(hi, offset + p.numel())
                    if a < b:
                        shard[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - offset:b - offset])
                    offset += p.numel()
            shard.grad = grad
            inner.param_groups[i].update({k2: v for k2, v in g.items() if k2 != "params"})
        inner.step()
        for i, g in enumerate(self.optimizer.param_groups):
            shard = layout.shards[i]
            gathered = Call.of(Kind.ALL_GATHER, groups, AllGatherParams((0,)), [shard])
            (full,) = execute_on_wire(engine, rid, gathered, [shard])
            offset = 0
            with torch.no_grad():
                for p in g["params"]:
                    p.copy_(full[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    # ------------------------------------------------------------ in-process form

    def _view_setup(self, rctx: ReplicaContext, groups: Groups) -> _Views:
        rid, engine = rctx.replica_id_in_sync_group, rctx.engine
        if self.views is not None and self.views.groups == groups:
            return self.views
        group = group_of(groups, rid)
        mine = [list(g["params"]) for g in self.optimizer.param_groups]
        every = engine.exchange_objects(rid, MERGE_CALL, (rid, mine), _every)  # one meeting, at set-up
        views = _Views(groups, group.index(rid), len(group), self.optimizer.param_groups,
                       [every[member] for member in group])
        self.views = views
        self.inner = type(self.optimizer)([self._hyper(g, v) for g, v in
                                           zip(self.optimizer.param_groups, views.views)])  # type: ignore[call-arg]
        exempt(self.inner)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._load(state)
        return views

    def _view_step(self, rctx: ReplicaContext, groups: Groups) -> None:
        """Steps this member's slices of its own parameters, then copies the others' slices."""
        views = self._view_setup(rctx, groups)
        inner = self._inner()
        if _data_ptrs(self.optimizer.param_groups) != views.ptrs:
            self._realias(views, inner)  # a parameter's storage was replaced (p.data = ...)
        for i, g in enumerate(self.optimizer.param_groups):
            for view, (index, a, b) in zip(views.views[i], views.slices[i]):
                grad = g["params"][index].grad
                if grad is None:
                    grad = views.zeros.get(id(view))
                    if grad is None:
                        grad = views.zeros[id(view)] = torch.zeros_like(view)
                else:
                    grad = grad.reshape(-1)[a:b]
                view.grad = grad
            inner.param_groups[i].update({k2: v for k2, v in g.items() if k2 != "params"})
        inner.step()
        for vs in views.views:
            for view in vs:
                view.grad = None  # the reduced gradients are not kept alive until the next step
        rid = rctx.replica_id_in_sync_group
        rctx.engine.exchange_objects(rid, BARRIER, None, None)  # every member's slices are updated
        with torch.no_grad():
            for i, g in enumerate(self.optimizer.param_groups):
                own = g["params"]
                for j, member in enumerate(views.members):
                    if j == views.pos:
                        continue
                    for index, a, b in views.ranges[i][j]:
                        own[index].view(-1)[a:b].copy_(member[i][index].detach().view(-1)[a:b])
        # Nobody returns (and perhaps changes its parameters in place) while another copies from them.
        rctx.engine.exchange_objects(rid, BARRIER, None, None)

    def _realias(self, views: _Views, inner: torch.optim.Optimizer) -> None:
        """Points the shard optimizer's views at the parameters' current storage, keeping
        their state."""
        for i, g in enumerate(self.optimizer.param_groups):
            fresh = [g["params"][index].detach().view(-1)[a:b] for index, a, b in views.slices[i]]
            for old, new in zip(views.views[i], fresh):
                if old in inner.state:
                    inner.state[new] = inner.state.pop(old)
            views.views[i] = fresh
            inner.param_groups[i]["params"] = fresh
        views.ptrs = _data_ptrs(self.optimizer.param_groups)

    def _view_state_dict(self, rctx: ReplicaContext, groups: Groups) -> dict[str, Any]:
        """The unsharded state dict from every member's slices (a meeting of the replica threads)."""
        views = self._view_setup(rctx, groups)
        inner = self._inner()
        rid = rctx.replica_id_in_sync_group
        mine = [[inner.state.get(v, {}) for v in vs] for vs in views.views]
        every = rctx.engine.exchange_objects(rid, MERGE_CALL, (rid, mine), _every)
        states = [every[member] for member in group_of(groups, rid)]
        out = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        index = 0
        for i, g in enumerate(self.optimizer.param_groups):
            for p_index, p in enumerate(g["params"]):
                pieces = [(states[j][i][n], a, b) for j in range(views.k)
                          for n, (q, a, b) in enumerate(views.ranges[i][j]) if q == p_index]
                entry: dict[str, Any] = {}
                for key, v in (pieces[0][0].items() if pieces and pieces[0][0] else ()):
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == pieces[0][2] - pieces[0][1]:
                        entry[key] = torch.cat([s[key] for s, _, _ in pieces]).view_as(p).clone()
                    else:
                        entry[key] = v.clone() if isinstance(v, torch.Tensor) else v
                if entry:
                    state[index] = entry
                index += 1
        out["state"] = state
        return out

    # ------------------------------------------------------------ state

    def state_dict(self, rctx: ReplicaContext, groups: Groups) -> dict[str, Any]:
        """The unsharded state dict (a collective: every replica of the group calls it)."""
        if self.views is not None:
            return self._view_state_dict(rctx, groups)
        rid, engine = rctx.replica_id_in_sync_group, rctx.engine
        layout = self._setup(groups, rid)
        inner = self._inner()
        out = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        index = 0
        for i, g in enumerate(self.optimizer.param_groups):
            own = inner.state.get(layout.shards[i], {})
            full: dict[str, Any] = {}
            for key in sorted(own):
                v = own[key]
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == layout.chunk[i]:
                    call = Call.of(Kind.ALL_GATHER, groups, AllGatherParams((0,)), [v])
                    (v,) = execute_on_wire(engine, rid, call, [v])
                full[key] = v
            offset = 0
            for p in g["params"]:
                if full:
                    state[index] = {key: (v[offset:offset + p.numel()].view_as(p).clone()
                                          if isinstance(v, torch.Tensor) and v.dim() == 1
                                          and v.numel() == layout.chunk[i] * layout.k else
                                          (v.clone() if isinstance(v, torch.Tensor) else v))
                                    for key, v in full.items()}
                offset += p.numel()
                index += 1
        out["state"] = state
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the unsharded format: hyperparameters into the wrapped optimizer, each
        replica's shard of the state into its shard optimizer (at the next step if
        the layout is not known yet)."""
        self.optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        if self.layout is None and self.views is None:
            self._pending_state = state_dict
        else:
            self._load(state_dict)

    def _load(self, state_dict: dict[str, Any]) -> None:
        if self.views is not None:
            self._load_views(state_dict, self.views)
            return
        layout, inner = self.layout, self._inner()
        if layout is None:
            raise RuntimeError("the sharded update has no layout yet; it is set up on the first step")
        saved = {int(k): v for k, v in state_dict["state"].items()}
        index = 0
        for i, g in enumerate(self.optimizer.param_groups):
            params = g["params"]
            entries = [saved.get(index + j) for j in range(len(params))]
            index += len(params)
            shard = layout.shards[i]
            if not entries or entries[0] is None:
                continue
            own: dict[str, Any] = {}
            c, lo = layout.chunk[i], layout.pos * layout.chunk[i]
            for key, v in entries[0].items():
                if isinstance(v, torch.Tensor) and v.shape == params[0].shape and v.dim() > 0:
                    flat = torch.zeros(c * layout.k, dtype=v.dtype, device=shard.device)
                    flat[:layout.sizes[i]] = torch.cat([e[key].reshape(-1).to(shard.device)
                                                        for e in entries if e is not None])
                    own[key] = flat[lo:lo + c].clone()
                else:
                    own[key] = v.clone() if isinstance(v, torch.Tensor) else v
            inner.state[shard] = own


    def _load_views(self, state_dict: dict[str, Any], views: _Views) -> None:
        inner = self._inner()
        saved = {int(k): v for k, v in state_dict["state"].items()}
        index = 0
        for i, g in enumerate(self.optimizer.param_groups):
            for view, (p_index, a, b) in zip(views.views[i], views.slices[i]):
                entry = saved.get(index + p_index)
                if entry is None:
                    continue
                shape = g["params"][p_index].shape
                inner.state[view] = {key: (v.reshape(-1)[a:b].clone().to(view.device)
                                           if isinstance(v, torch.Tensor) and v.shape == shape and v.dim() > 0 else
                                           (v.clone() if isinstance(v, torch.Tensor) else v))
                                     for key, v in entry.items()}
            index += len(g["params"])


def _data_ptrs(param_groups: list[dict]) -> list[int]:
    return [p.data_ptr() for g in param_groups for p in g["params"]]


def _every(calls: list[Any], objs: list[tuple[int, Any]]) -> dict[int, Any]:
    """A meeting's result: every replica's object by replica id."""
    return dict(objs)


def _one_process(engine: Engine, groups: Groups, rid: int, param_groups: list[dict]) -> bool:
    """Whether every member of ``rid``'s group is a replica thread of this process (the
    threads engine) and every parameter a contiguous CPU tensor: the in-process form."""
    return (engine.in_process and set(group_of(groups, rid)) <= set(engine.local_replica_ids)
            and all(p.device.type == "cpu" and p.is_contiguous() for g in param_groups for p in g["params"]))


def _reject_sparse(param_groups: list[dict]) -> None:
    for i, g in enumerate(param_groups):
        for j, p in enumerate(g["params"]):
            if p.grad is not None and p.grad.layout is not torch.strided:
                raise ValueError(
                    f"shard_optimizer_state=True does not support sparse gradients; parameter {j} of "
                    f"param group {i} (shape {list(p.shape)}) has a {p.grad.layout} gradient: use "
                    f"shard_optimizer_state=False, or a dense gradient (e.g. nn.Embedding(sparse=False))")
