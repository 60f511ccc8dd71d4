"""CUDA stream order for in-process collectives.

A CUDA kernel is queued on its thread's current stream and runs later. When
replica threads meet, the thread that computes a collective (the round's leader)
must not read a replica's input before the kernels that produce it have run on
that replica's stream, and the replica must not read its output before the
leader's kernels have run. A :class:`Fence` records an event on every stream a
thread's tensors live on; the other side makes its own streams wait for it.
Nothing blocks the host. Outputs used on another stream than the one they were
allocated on are marked with ``record_stream``, so the caching allocator does
not hand their memory out again while that stream may still read it.

With every thread on the default stream (the common case) the waits are no-ops
on the GPU; a replica that runs under ``torch.cuda.stream(s)`` gets the same
bytes as one that does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .rendezvous import Rendezvous

__all__ = ["Fence", "FencedRounds", "cuda_devices"]


def cuda_devices(tensors: Iterable[torch.Tensor]) -> tuple[torch.device, ...]:
    """The distinct CUDA devices of ``tensors``, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for t in tensors:
        if t.is_cuda:
            seen.setdefault(t.device)
    return tuple(seen)


class Fence:
    """The calling thread's current stream on each of ``devices``, with an event recorded
    on it now: what the thread has queued so far on those devices."""

    __slots__ = ("streams", "events")

    def __init__(self, devices: Iterable[torch.device]):
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.events: list[tuple[torch.device, torch.cuda.Event]] = []
        for device in devices:
            stream = torch.cuda.current_stream(device)
            event = torch.cuda.Event()
            event.record(stream)
            self.streams[device] = stream
            self.events.append((device, event))

    def wait(self) -> None:
        """The calling thread's current streams wait (on the GPU) for the recorded work."""
        for device, event in self.events:
            torch.cuda.current_stream(device).wait_event(event)

    def hand_over(self, tensors: Iterable[torch.Tensor]) -> None:
        """Marks ``tensors``, made on the calling thread's streams, as used on this fence's
        streams too (the caching allocator then keeps their memory until both are done)."""
        for t in tensors:
            if t.is_cuda:
                stream = self.streams.get(t.device)
                if stream is not None and stream != torch.cuda.current_stream(t.device):
                    t.record_stream(stream)


class FencedRounds:
    """Rendezvous rounds on CUDA tensors: the leader's streams wait for every replica's
    inputs, and each replica's streams for the leader's outputs."""

    def __init__(self, rendezvous: Rendezvous):
        self.rendezvous = rendezvous
        self._fences: list[Fence | None] = [None] * rendezvous.n

    def exchange(self, i: int, call: Any, tensors: Sequence[torch.Tensor],
                 lead: Callable[[list[Any], list[Any]], Any],
                 outputs: Callable[[Any], Sequence[Sequence[torch.Tensor] | None]] = lambda result: result,
                 timeout: float | None = None) -> Any:
        """``rendezvous.exchange`` with fences; ``outputs(result)`` lists each replica's
        output tensors in the leader's ``result`` (default: ``result`` is that list)."""
        self._fences[i] = Fence(cuda_devices(tensors))
        result, done = self.rendezvous.exchange(
            i, call, tensors, lambda calls, payloads: self._lead(lead, outputs, calls, payloads), timeout)
        done.wait()
        return result

    def _lead(self, lead: Callable[[list[Any], list[Any]], Any],
              outputs: Callable[[Any], Sequence[Sequence[torch.Tensor] | None]],
              calls: list[Any], payloads: list[Any]) -> tuple[Any, Fence]:
        fences = self._fences
        for fence in fences:
            if fence is not None:
                fence.wait()
        result = lead(calls, payloads)
        outs = outputs(result)
        done = Fence(cuda_devices(t for row in outs if row for t in row))
        for fence, row in zip(fences, outs):
            if fence is not None and row:
                fence.hand_over(row)
        return result, done
