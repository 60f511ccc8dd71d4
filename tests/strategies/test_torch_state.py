"""Every replica runs under the caller's thread-local torch state, on every engine."""

from __future__ import annotations

import contextlib

import pytest
import torch

import crossreplica as cr
from crossreplica import torch_state
from crossreplica.testing import run_workers

pytestmark = pytest.mark.fidelity


def _observe(x):
    """What a replica sees and computes: the states, and a result that depends on them."""
    w = torch.linspace(-1, 1, 16).reshape(4, 4)
    y = x @ w
    return {"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
            "autocast_cpu": torch.is_autocast_enabled("cpu"), "autocast_dtype": torch.get_autocast_dtype("cpu"),
            "cache": torch.is_autocast_cache_enabled(), "device": torch.get_default_device().type,
            "y_dtype": y.dtype, "y_requires_grad": y.requires_grad, "new": torch.empty(0).device.type,
            "y": y.detach().float().clone() if not y.is_inference() else y.float().clone()}


def _replica(x):
    out = _observe(x)
    merged = cr.get_replica_context().merge_call(lambda s: _observe(torch.ones(4, 4)))
    out["merge"] = {k: v for k, v in merged.items() if k != "y"}
    return out


CONTEXTS = {
    "plain": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "set_grad_enabled_false": lambda: torch.set_grad_enabled(False),
    "enable_grad_in_no_grad": lambda: _nested(torch.no_grad(), torch.enable_grad()),
    "inference_mode": torch.inference_mode,
    "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast_fp16_nocache": lambda: torch.autocast("cpu", dtype=torch.float16, cache_enabled=False),
    "device_meta": lambda: torch.device("meta"),
}


@contextlib.contextmanager
def _nested(*cms):
    with contextlib.ExitStack() as stack:
        for cm in cms:
            stack.enter_context(cm)
        yield


def _reference(name):
    """The plain-torch reference: the caller's thread on one device."""
    x = torch.ones(4, 4, requires_grad=True)
    with CONTEXTS[name]():
        out = _observe(x)
        out["merge"] = {k: v for k, v in _observe(torch.ones(4, 4)).items() if k != "y"}
    return out


def _strategy_main(strategy):
    """Runs every context's replica function through ``strategy``; local results per context."""
    results = {}
    for name, cm in CONTEXTS.items():
        x = torch.ones(4, 4, requires_grad=True)
        with cm():
            out = strategy.run(_replica, args=(x,))
        results[name] = list(strategy.experimental_local_results(out))
    return results


def _check(results):
    for name in CONTEXTS:
        ref = _reference(name)
        for got in results[name]:
            for k in ref:
                if k == "y":
                    if ref["device"] != "meta":
                        assert torch.equal(got[k], ref[k]), name
                else:
                    assert got[k] == ref[k], (name, k, got[k], ref[k])


def test_caller_state_threads():
    _check(_strategy_main(cr.MirroredStrategy(num_replicas=2)))


def test_caller_state_one_device():
    _check(_strategy_main(cr.OneDeviceStrategy()))


@pytest.mark.multiprocess
def test_caller_state_processes():
    for worker in run_workers(_strategy_main, 2, replicas_per_worker=2):
        _check(worker)


def test_capture_default_is_shared_and_cheap():
    assert torch_state.capture() is torch_state.capture()
    with torch.no_grad():
        s = torch_state.capture()
    assert not s.grad
    with torch_state.applied(s):
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


def test_saved_tensor_hooks_reach_replicas():
    seen = []

    def pack(t):
        seen.append(1)
        return t

    def fn(x):
        return (x * x).sum()

    strategy = cr.MirroredStrategy(num_replicas=2)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        strategy.run(fn, args=(torch.ones(3, requires_grad=True),))
    assert len(seen) == 4  # x saved twice per replica by mul, on 2 replicas
