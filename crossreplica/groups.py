"""Group assignments and meshes: which replicas reduce together.

Every spelling a user may write is validated once here and turned into the
canonical form the rest of the library trusts: a tuple of equal-size tuples of
replica ids that covers ``0..num_replicas-1`` exactly once. Member order within
a group is kept (it is the order all_gather concatenates in); reductions sum in
ascending replica id regardless.

Accepted spellings:
  * ``None``: one group with every replica.
  * 2-D: ``[[0, 1], [2, 3]]``.
  * flat, one group index per replica: ``[0, 0, 1, 1]``.
  * a :class:`Mesh` and axis names: replicas that differ only along those axes.
  * a Mesh, axis names and a group assignment: the assignment splits every
    group of the named axes by *position within that group* (the row-major
    index over the named axes, in the mesh's axis order), as JAX's
    ``axis_index_groups`` index the named axes.

Caches are plain dicts, not ``functools.lru_cache``: torch.compile traces the
group resolution of a compiled replica step, and Dynamo warns about (and
ignores) lru_cache wrappers.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
from collections import abc
from typing import Any, cast
from collections.abc import Mapping, Sequence

from .errors import summarize

__all__ = [
    "Groups",
    "canonical_groups",
    "resolve_groups",
    "contiguous_groups",
    "strided_groups",
    "group_of",
    "mesh_groups",
    "Mesh",
]

Groups = tuple[tuple[int, ...], ...]


def _as_int(x: Any) -> int | None:
    """``x`` as an int (ints, numpy ints, 0-d tensors), or None for anything else."""
    if isinstance(x, (bool, list, tuple)):
        # a row is told from an index before operator.index: torch.compile before 2.12
        # cannot catch the TypeError that raises while it traces
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _as_list(x: Any, argname: str) -> list:
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        x = x.tolist()  # numpy arrays and tensors
    if isinstance(x, (str, bytes)) or not isinstance(x, abc.Sequence):
        raise ValueError(
            f"{argname} must be None, a list of equal-size lists of replica ids "
            f"(e.g. [[0, 1], [2, 3]]) or one group index per replica (e.g. [0, 0, 1, 1]); got {summarize(x)}")
    return list(x)


def canonical_groups(group_assignment: Any, num_replicas: int,
                     argname: str = "group_assignment") -> Groups:
    """Validates ``group_assignment`` for ``num_replicas`` replicas and canonicalises it.

    Raises:
        ValueError: naming the argument, the value and the rule it breaks.
    """
    if group_assignment is None:
        return _all_replicas(num_replicas)
    if isinstance(group_assignment, tuple) and all(type(g) is tuple for g in group_assignment):
        key = (group_assignment, num_replicas, argname)
        try:
            cached = _CANONICAL.get(key)
        except TypeError:  # unhashable member: validate uncached for the message
            return _canonical(group_assignment, num_replicas, argname)
        if cached is None:
            cached = _canonical(group_assignment, num_replicas, argname)
            if len(_CANONICAL) < 256:
                _CANONICAL[key] = cached
        return cached
    return _canonical(group_assignment, num_replicas, argname)


# Canonical forms of already-canonical assignments (the form every layer above passes
# again), and of the one group of every replica: immutable values, so a shared cache.
_CANONICAL: dict[tuple, Groups] = {}
_ALL: dict[int, Groups] = {}


def _all_replicas(n: int) -> Groups:
    groups = _ALL.get(n)
    if groups is None:
        groups = _ALL[n] = (tuple(range(n)),)
    return groups


def _canonical(group_assignment: Any, n: int, argname: str) -> Groups:
    rows = _as_list(group_assignment, argname)
    if not rows:
        raise ValueError(f"{argname} must not be empty; got {summarize(group_assignment)}")
    if len(rows) > n:  # checked first, so a huge value is rejected without walking it
        if _as_int(rows[0]) is not None:
            raise ValueError(
                f"{argname} in the flat form needs one group index per replica ({n} replicas in sync); "
                f"got {len(rows)} entries: {summarize(group_assignment)}")
        raise ValueError(
            f"{argname} has {len(rows)} groups, but {n} replicas are in sync (at most {n} groups); "
            f"got {summarize(group_assignment)}")
    for i, r in enumerate(rows):
        if isinstance(r, bool):
            raise ValueError(
                f"{argname}[{i}] is the bool {summarize(r)}; group indices and replica ids must be ints, "
                f"not bools: got {summarize(group_assignment)}")
    flat = [_as_int(r) for r in rows]
    if all(v is not None for v in flat):
        return _from_flat(cast(list[int], flat), n, argname, group_assignment)
    groups = []
    lengths: list[int] = []
    for i, row in enumerate(rows):
        if _as_int(row) is not None:
            raise ValueError(
                f"{argname} mixes group indices and groups: entry {i} is {summarize(row)}; use either "
                f"[[0, 1], [2, 3]] or [0, 0, 1, 1]; got {summarize(group_assignment)}")
        members = _as_list(row, f"{argname}[{i}]")
        lengths.append(len(members))
        # More than n members must repeat or exceed an id: n + 1 of them show which.
        members = members[:n + 1]
        ids = []
        for m in members:
            v = _as_int(m)
            if v is None:
                raise ValueError(
                    f"{argname}[{i}] must hold integer replica ids;"
                    f" got {summarize(m)} in {summarize(group_assignment)}")
            ids.append(v)
        if not ids:
            raise ValueError(f"{argname}[{i}] is an empty group; got {summarize(group_assignment)}")
        groups.append(tuple(ids))
    size = lengths[0]
    for i, length in enumerate(lengths):
        if length != size:
            raise ValueError(
                f"{argname} must have groups of equal size; group 0 has {size} replicas, group {i} "
                f"has {length}: {summarize(group_assignment)}")
    seen: dict[int, int] = {}
    for i, g in enumerate(groups):
        for r in g:
            if not 0 <= r < n:
                raise ValueError(
                    f"{argname} names replica {r}, outside 0..{n - 1} ({n} replicas in sync): "
                    f"{summarize(group_assignment)}")
            if r in seen:
                where = f"groups {seen[r]} and {i}" if seen[r] != i else f"group {i} twice"
                raise ValueError(
                    f"{argname} must cover replicas 0..{n - 1} exactly once; replica {r} appears in "
                    f"{where}: {summarize(group_assignment)}")
            seen[r] = i
    missing = [r for r in range(n) if r not in seen]
    if missing:
        raise ValueError(
            f"{argname} must cover replicas 0..{n - 1} exactly once; replicas {missing} are in no "
            f"group: {summarize(group_assignment)}")
    return tuple(groups)


def _from_flat(index: list[int], n: int, argname: str, original: Any) -> Groups:
    if len(index) != n:
        raise ValueError(
            f"{argname} in the flat form needs one group index per replica ({n} replicas in sync); "
            f"got {len(index)} entries: {summarize(original)}")
    num_groups = max(index) + 1
    if min(index) < 0 or num_groups > n or set(index) != set(range(num_groups)):
        raise ValueError(
            f"{argname} in the flat form must use group indices 0..G-1 with none skipped; "
            f"got {summarize(original)}")
    groups = tuple(tuple(r for r in range(n) if index[r] == g) for g in range(num_groups))
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"{argname} must have groups of equal size; group sizes are "
            f"{[len(g) for g in groups]}: {summarize(original)}")
    return groups


def resolve_groups(num_replicas: int, group_assignment: Any = None, mesh: "Mesh | None" = None,
                   axes: Any = None) -> Groups:
    """One canonical form from a group assignment, a mesh and axes, or both.

    With a mesh, ``axes`` (default: every axis) names the groups; a
    ``group_assignment`` given as well splits each of them by position within
    the group (0..group_size-1; see the module docstring), e.g. on
    ``Mesh({"data": 2, "model": 4})`` with ``axes="model"``, ``[[0, 1], [2, 3]]``
    pairs neighbouring model positions within every data row.
    """
    if mesh is not None:
        base = mesh_groups(num_replicas, mesh, axes)
        if group_assignment is None:
            return base
        within = canonical_groups(group_assignment, len(base[0]))
        return tuple(tuple(g[p] for p in sub) for g in base for sub in within)
    if axes is not None:
        raise ValueError(f"axes={summarize(axes)} needs a mesh; pass mesh=cr.Mesh(...) as well")
    return canonical_groups(group_assignment, num_replicas)


def mesh_groups(num_replicas: int, mesh: Any, axes: Any) -> Groups:
    """The groups of ``mesh`` along ``axes`` (None: every axis), checked against the replica count."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a cr.Mesh; got {summarize(mesh)}")
    if mesh.size != num_replicas:
        raise ValueError(
            f"mesh {summarize(mesh)} has {mesh.size} devices but {num_replicas} replicas are in sync; "
            f"the axis sizes must multiply to the replica count")
    return mesh.group_assignment(mesh.axis_names if axes is None else axes)


def group_of(groups: Groups, replica_id: int) -> tuple[int, ...]:
    """The group that holds ``replica_id``."""
    for g in groups:
        if replica_id in g:
            return g
    raise ValueError(f"replica {replica_id} is in none of the groups {groups}")


def _check_positive(name: str, value: Any) -> int:
    v = _as_int(value)
    if v is None or v <= 0:
        raise ValueError(f"{name} must be a positive integer; got {summarize(value)}")
    return v


def contiguous_groups(num_replicas: int, group_size: int) -> Groups:
    """Groups of ``group_size`` consecutive replicas: ``[[0, 1], [2, 3]]`` for 4 and 2.

    This is the assignment distributed batch norm uses (num_shards_per_group).
    """
    n = _check_positive("num_replicas", num_replicas)
    k = _check_positive("num_shards_per_group", group_size)
    if n % k:
        raise ValueError(
            f"num_replicas: {n} mod num_shards_per_group: {k} should be 0, got {n % k}; "
            f"choose a group size that divides the replica count")
    return tuple(tuple(range(g * k, (g + 1) * k)) for g in range(n // k))


def strided_groups(num_replicas: int, group_size: int) -> Groups:
    """Groups of replicas ``num_replicas // group_size`` apart: ``[[0, 2], [1, 3]]`` for 4 and 2."""
    n = _check_positive("num_replicas", num_replicas)
    k = _check_positive("group_size", group_size)
    if n % k:
        raise ValueError(
            f"num_replicas: {n} mod group_size: {k} should be 0, got {n % k}; "
            f"choose a group size that divides the replica count")
    num_groups = n // k
    return tuple(tuple(g + j * num_groups for j in range(k)) for g in range(num_groups))


class Mesh:
    """Replicas laid out row-major on a grid with named axes.

    ``Mesh({"data": 2, "model": 2})`` puts replica ``2 * d + m`` at
    coordinates ``(d, m)``. Reducing over ``("model",)`` reduces within each row.
    """

    def __init__(self, shape: Mapping[str, int]):
        if not isinstance(shape, abc.Mapping) or not shape:
            raise ValueError(
                f"shape must be a non-empty mapping from axis name to size, e.g. "
                f"{{'data': 2, 'model': 2}}; got {summarize(shape)}")
        dims = {}
        for name, size in shape.items():
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"mesh axis names must be non-empty strings;"
                    f" got {summarize(name)} in {summarize(shape)}")
            v = _as_int(size)
            if v is None or v <= 0:
                raise ValueError(
                    f"mesh axis {summarize(name)} must have a positive integer size;"
                    f" got {summarize(size)} in {summarize(shape)}")
            dims[name] = v
        self._shape = dims
        self._names = tuple(dims)
        self._sizes = tuple(dims.values())
        self._strides = tuple(math.prod(self._sizes[i + 1:]) for i in range(len(self._sizes)))
        self._cache: dict[tuple[str, ...], Groups] = {}

    @property
    def shape(self) -> dict[str, int]:
        return dict(self._shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def size(self) -> int:
        return math.prod(self._sizes)

    def __repr__(self) -> str:
        return f"Mesh({self._shape!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and other._shape == self._shape and other._names == self._names

    def __hash__(self) -> int:
        return hash(tuple(self._shape.items()))

    def coordinates(self, replica: int) -> tuple[int, ...]:
        """Coordinates of ``replica``, one per axis in axis order."""
        r = _as_int(replica)
        if r is None or not 0 <= r < self.size:
            raise ValueError(
                f"replica must be an int in [0, {self.size}) for {summarize(self)};"
                f" got {summarize(replica)}")
        return tuple((r // s) % n for s, n in zip(self._strides, self._sizes))

    def replica(self, coords: Sequence[int] | Mapping[str, int]) -> int:
        """The replica at ``coords`` (a sequence in axis order, or a name->index mapping)."""
        if isinstance(coords, abc.Mapping):
            unknown = set(coords) - set(self._names)
            if unknown or len(coords) != len(self._names):
                raise ValueError(
                    f"coords must name every axis of {summarize(self)} ({list(self._names)}) once;"
                    f" got {summarize(coords)}")
            coords = [coords[n] for n in self._names]
        if isinstance(coords, (str, bytes)) or not isinstance(coords, abc.Sequence) \
                or len(coords) != len(self._names):
            raise ValueError(
                f"coords must have one index per axis {list(self._names)}; got {summarize(coords)}")
        r = 0
        for name, c, n, s in zip(self._names, coords, self._sizes, self._strides):
            v = _as_int(c)
            if v is None or not 0 <= v < n:
                raise ValueError(f"coordinate for axis {summarize(name)} must be in [0, {n}); got {summarize(c)}")
            r += v * s
        return r

    def _axes(self, axes: Any) -> tuple[str, ...]:
        """Axis names from names and/or axis indices (Mesh TensorFlow's integer ``mesh_axes``)."""
        if isinstance(axes, (str, numbers.Integral)):
            axes = (axes,)
        if not isinstance(axes, abc.Iterable):
            raise ValueError(
                f"axes must be an axis name or index, or a sequence of them, of {summarize(self)};"
                f" got {summarize(axes)}")
        axes = tuple(self._axis_name(a) for a in axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes must not repeat a name (or its index); got {summarize(axes)}")
        return axes

    def _axis_name(self, a: Any) -> str:
        if isinstance(a, numbers.Integral) and not isinstance(a, bool):
            if not 0 <= int(a) < len(self._names):
                raise ValueError(
                    f"axes holds the index {a}, which is out of range for {summarize(self)}: indices are "
                    f"0..{len(self._names) - 1} ({', '.join(f'{i}={n!r}' for i, n in enumerate(self._names))})")
            return self._names[int(a)]
        if not isinstance(a, str) or a not in self._shape:
            raise ValueError(
                f"axes names {summarize(a)}, which is not an axis of {summarize(self)};"
                f" valid names: {list(self._names)} (or their indices 0..{len(self._names) - 1})")
        return a

    def group_assignment(self, axes: Any) -> Groups:
        """Groups of replicas that share their coordinates on every axis not in ``axes``
        (names, or indices into ``axis_names`` as Mesh TensorFlow's ``mesh_axes``).

        Groups are ordered row-major over the kept axes and members row-major over
        the reduced ones (Mesh TensorFlow's pnum_to_group).
        """
        axes = self._axes(axes)
        groups = self._cache.get(axes)
        if groups is None:
            groups = self._cache[axes] = self._groups(axes)
        return groups

    def _groups(self, axes: tuple[str, ...]) -> Groups:
        kept = [i for i, n in enumerate(self._names) if n not in axes]
        reduced = [i for i, n in enumerate(self._names) if n in axes]
        groups = []
        for kc in itertools.product(*(range(self._sizes[i]) for i in kept)):
            members = []
            for rc in itertools.product(*(range(self._sizes[i]) for i in reduced)):
                coords = [0] * len(self._names)
                for i, c in zip(kept, kc):
                    coords[i] = c
                for i, c in zip(reduced, rc):
                    coords[i] = c
                members.append(sum(c * s for c, s in zip(coords, self._strides)))
            groups.append(tuple(members))
        return tuple(groups)
