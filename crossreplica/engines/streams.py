"""CUDA stream order for in-process collectives.

A CUDA kernel is queued on its thread's current stream and runs later. When
replica threads meet, the thread that computes a collective (the round's leader)
must not read a replica's input before the kernels that produce it have run on
that replica's stream, and the replica must not read its output before the
leader's kernels have run.

Every participant of a round is blocked in the rendezvous while the leader works,
so nothing more is queued on their streams: the leader orders the streams itself.
Each replica deposits its current stream per device (one cheap read); the leader
records an event on every stream that is not its own and makes its stream wait for
it, queues the collective, then records one event on its stream and makes each of
those streams wait for it before it wakes anyone. Nothing blocks the host, no
event is created per call (one pair per device, reused: a wait takes the event's
state when it is queued), and a round where every replica runs on the leader's
stream (the default stream, the common case) queues no event at all. Outputs used
on another stream than the one they were allocated on are marked with
``record_stream``, so the caching allocator does not hand their memory out again
while that stream may still read it.

A replica that runs under ``torch.cuda.stream(s)`` gets the same bytes as one that
does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import torch_private as tp
from .rendezvous import Rendezvous

__all__ = ["FencedRounds", "cuda_devices"]

# A replica's streams: (device, stream data) for each CUDA device its tensors are on, the
# data as torch._C._cuda_getCurrentStream gives it, (stream id, device index, device type):
# cheap to read and to compare, where a torch.cuda.Stream object costs microseconds to make.
_StreamData = tuple[int, int, int]
_Streams = tuple[tuple[torch.device, _StreamData], ...]


def cuda_devices(tensors: Iterable[torch.Tensor]) -> tuple[torch.device, ...]:
    """The distinct CUDA devices of ``tensors``, in first-seen order."""
    seen: dict[torch.device, None] = {}
    for t in tensors:
        if t.is_cuda:
            seen.setdefault(t.device)
    return tuple(seen)


def _stream_data(device: torch.device) -> _StreamData:
    """The calling thread's current stream on ``device``, as stream data."""
    if tp.cuda_current_stream_data is not None:
        return tp.cuda_current_stream_data(device.index)
    stream = torch.cuda.current_stream(device)
    return (stream.stream_id, stream.device_index, stream.device_type)


def _stream(data: _StreamData) -> torch.cuda.Stream:
    return torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])


def _current_streams(tensors: Sequence[torch.Tensor]) -> _Streams:
    """The calling thread's current stream on each CUDA device of ``tensors``."""
    if len(tensors) == 1:  # the common case: one tensor, one device
        t = tensors[0]
        return ((t.device, _stream_data(t.device)),) if t.is_cuda else ()
    return tuple((d, _stream_data(d)) for d in cuda_devices(tensors))


class FencedRounds:
    """Rendezvous rounds on CUDA tensors: the leader's streams wait for every replica's
    inputs, and each replica's streams for the leader's outputs (module docstring)."""

    def __init__(self, rendezvous: Rendezvous):
        self.rendezvous = rendezvous
        self._streams: list[_Streams] = [()] * rendezvous.n
        self._inputs_ready: dict[torch.device, torch.cuda.Event] = {}
        self._outputs_ready: dict[torch.device, torch.cuda.Event] = {}

    def exchange(self, i: int, call: Any, tensors: Sequence[torch.Tensor],
                 lead: Callable[[list[Any], list[Any]], Any],
                 outputs: Callable[[Any], Sequence[Sequence[torch.Tensor] | None]] = lambda result: result,
                 timeout: float | None = None) -> Any:
        """``rendezvous.exchange`` with stream order; ``outputs(result)`` lists each replica's
        output tensors in the leader's ``result`` (default: ``result`` is that list)."""
        self._streams[i] = _current_streams(tensors)
        return self.rendezvous.exchange(
            i, call, tensors, lambda calls, payloads: self._lead(lead, outputs, calls, payloads), timeout)

    @staticmethod
    def _event(events: dict[torch.device, torch.cuda.Event], device: torch.device) -> torch.cuda.Event:
        event = events.get(device)
        if event is None:
            event = events[device] = torch.cuda.Event()
        return event

    def _lead(self, lead: Callable[[list[Any], list[Any]], Any],
              outputs: Callable[[Any], Sequence[Sequence[torch.Tensor] | None]],
              calls: list[Any], payloads: list[Any]) -> Any:
        # The streams that are not the leader's own, per replica (every replica is blocked
        # in this round, so its stream holds exactly the work queued before its call).
        foreign: list[list[tuple[torch.device, _StreamData]]] = []
        mine: dict[torch.device, _StreamData] = {}
        for streams in self._streams:
            others = []
            for device, data in streams:
                own = mine.get(device)
                if own is None:
                    own = mine[device] = _stream_data(device)
                if data != own:
                    others.append((device, data))
            foreign.append(others)
        if not any(foreign):  # every replica on the leader's streams: their order is the queue's
            return lead(calls, payloads)
        leader_streams = {device: _stream(data) for device, data in mine.items()}
        for others in foreign:
            for device, data in others:
                event = self._event(self._inputs_ready, device)
                event.record(_stream(data))
                leader_streams[device].wait_event(event)
        result = lead(calls, payloads)
        done: dict[torch.device, torch.cuda.Event] = {}
        for others, row in zip(foreign, outputs(result)):
            on = {}
            for device, data in others:
                if device not in done:
                    done[device] = self._event(self._outputs_ready, device)
                    done[device].record(leader_streams[device])
                stream = on[device] = _stream(data)
                stream.wait_event(done[device])
            if on and row:
                for t in row:
                    if t.is_cuda and t.device in on:
                        t.record_stream(on[t.device])
        return result
