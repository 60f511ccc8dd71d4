"""crossreplica.testing: replica functions on threads and on worker processes; worker pools
(layouts, reuse, restart after a failure, clean-up) and exceptions rebuilt across processes."""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
import torch

import crossreplica as cr
import crossreplica.testing as crt


def _where(x):
    return os.getpid(), cr.replica_id(), cr.num_replicas(), os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]


def _sum(x):
    return cr.all_reduce(x, "sum")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_default_layouts():
    assert [crt.layout(n) for n in (1, 2, 3, 4, 6, 8)] == [(1, 1), (2, 1), (3, 1), (2, 2), (2, 3), (2, 4)]


def test_default_timeout_is_a_deprecated_name():
    with pytest.warns(DeprecationWarning, match="DEFAULT_TEST_TIMEOUT"):
        assert crt.DEFAULT_TIMEOUT == crt.DEFAULT_TEST_TIMEOUT == 30.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,rpw", [(2, 1), (4, 2), (4, 1), (6, 3)], ids=["2x1", "2x2", "4x1", "2x3"])
def test_layouts_run_in_their_workers(n, rpw):
    out = crt.run_replicas(_where, [None] * n, engine="processes", replicas_per_worker=rpw)
    workers = n // rpw
    assert [r[1:] for r in out] == [(r, n, str(workers), "127.0.0.1") for r in range(n)]
    pids = [r[0] for r in out]
    assert len(set(pids)) == workers and os.getpid() not in pids
    assert all(pids[r] == pids[r - r % rpw] for r in range(n))  # replicas 0..rpw-1 in worker 0, ...


@pytest.mark.parametrize("engine", crt.ENGINES)
def test_results_in_replica_order(engine):
    xs = [torch.full((2,), float(r)) for r in range(4)]
    out = crt.run_replicas(_sum, xs, engine=engine)
    assert len(out) == 4 and all(torch.equal(o, sum(xs)) for o in out)
    assert crt.run_replicas(_rid, num_replicas=3, engine=engine) == [0, 1, 2]


def _rid():
    return cr.replica_id()


def _value_error_on_replica_2(x):
    if cr.replica_id() == 2:
        raise ValueError(f"bad input on replica {cr.replica_id()}")
    return cr.all_reduce(x, "sum")


@pytest.mark.parametrize("engine", crt.ENGINES)
def test_replica_exception_keeps_its_type(engine):
    with pytest.raises(ValueError, match="bad input on replica 2") as info:
        crt.run_replicas(_value_error_on_replica_2, [torch.ones(1)] * 4, engine=engine)
    assert isinstance(info.value, cr.ReplicaError) and info.value.replica_id == 2


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


def _raise_unpicklable(x):
    if cr.replica_id() == 1:
        raise _Unpicklable("cannot travel")
    return cr.all_reduce(x)


@pytest.mark.multiprocess
def test_pool_is_reused_and_restarted_after_a_failure():
    first = crt.run_replicas(_where, [None] * 4, engine="processes")
    pids = {r[0] for r in first}
    assert len(pids) == 2  # 2 workers x 2 replicas
    assert {r[0] for r in crt.run_replicas(_where, [None] * 4, engine="processes")} == pids
    with pytest.raises(crt.RemoteReplicaError, match=r"(?s)_Unpicklable.*cannot travel"):
        crt.run_replicas(_raise_unpicklable, [torch.ones(1)] * 4, engine="processes")
    assert all(_gone(p) for p in pids)  # the failed pool was killed
    again = {r[0] for r in crt.run_replicas(_where, [None] * 4, engine="processes")}
    assert len(again) == 2 and not again & pids  # a fresh pool


@pytest.mark.multiprocess
def test_worker_pool_lifecycle_and_outcome():
    with crt.WorkerPool(2, timeout_seconds=20) as pool:
        assert pool.alive and pool.num_replicas == 2
        out = pool.run(_where, [None, None])
        assert out.ok and out.log == "" and sorted(out.results) == [0, 1]
        assert pool.run(_value_error_on_replica_2, [torch.ones(1)] * 2).ok  # no replica 2 here
        main = pool.run(_worker_rank, mode="main")
        assert main.results == {0: 0, 1: 1}
        pids = {r[0] for r in out.results.values()}
    assert not pool.alive and all(_gone(p) for p in pids)
    with pytest.raises(crt.WorkerPoolError, match="not started"):
        pool.run(_where, [None, None])


def _worker_rank(strategy):
    return strategy.extended.worker_rank


@pytest.mark.multiprocess
def test_starting_a_pool_keeps_the_callers_signal_handlers():
    """torch's launcher replaces them with one that raises its own exception; Ctrl-C in a
    program that started a pool must still be a KeyboardInterrupt."""
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]
    before = {sig: signal.getsignal(sig) for sig in signals}

    def mine(signum, frame):
        raise AssertionError("not called")

    try:
        for sig in signals:
            signal.signal(sig, mine)
        with crt.WorkerPool(2, timeout_seconds=20) as pool:
            assert pool.run(_worker_rank, mode="main").results == {0: 0, 1: 1}
            assert all(signal.getsignal(sig) is mine for sig in signals)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with crt.WorkerPool(1, timeout_seconds=20):
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.multiprocess
def test_launch_reports_every_worker():
    out = crt.launch(_value_error_on_replica_2, [torch.ones(1)] * 4, replicas_per_worker=1)
    assert not out.ok and set(out.failures) == {0, 1, 2, 3} and not out.exitcodes
    culprit = out.failures[2]
    assert culprit.is_instance("ValueError") and "bad input on replica 2" in culprit.message
    assert isinstance(culprit.exception(), ValueError)
    assert all(f.is_instance("ReplicaError") for f in out.failures.values())


@pytest.mark.multiprocess
def test_run_workers():
    assert crt.run_workers(_worker_rank, 2) == [0, 1]


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="engine must be one of \\['threads', 'processes'\\]; got 'gpu'"):
        crt.run_replicas(_sum, [torch.ones(1)] * 2, engine="gpu")
    with pytest.raises(ValueError, match="per-replica argument 1 must have one entry per replica \\(2\\); got 3"):
        crt.run_replicas(_sum, [1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="num_replicas is required"):
        crt.run_replicas(_rid)
    with pytest.raises(ValueError, match="replicas_per_worker must be a positive int dividing num_replicas=4; got 3"):
        crt.run_replicas(_sum, [1] * 4, engine="processes", replicas_per_worker=3)
    with pytest.raises(ValueError, match="num_workers must be a positive int; got 0"):
        crt.WorkerPool(0)
    with pytest.raises(ValueError, match="fn must be a function defined at module level"):
        crt.run_replicas(lambda x: x, [1, 2], engine="processes")


def _host_view(strategy, tag):
    """What a worker sees of its host: name, environment, and which of the workers' marker
    files its /dev/shm and /tmp hold once every worker has written its own."""
    import socket

    rank = strategy.extended.worker_rank
    for d in ("/dev/shm", "/tmp"):
        pathlib.Path(d, f"{tag}-{rank}").touch()
    strategy.extended.barrier()
    seen = {d: sorted(f for f in os.listdir(d) if f.startswith(tag)) for d in ("/dev/shm", "/tmp")}
    env = {k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                      "MASTER_ADDR")}
    return socket.gethostname(), env, seen


@pytest.mark.multiprocess
@pytest.mark.hosts
def test_workers_on_simulated_hosts_see_their_own_host(simulated_hosts):
    hosts, tag = simulated_hosts, f"crt-{os.getpid()}"
    got = crt.run_workers(_host_view, 4, args=(tag,), hosts=hosts)
    for rank, (name, env, seen) in enumerate(got):
        host, local = divmod(rank, 2)
        assert name == hosts.hostnames[host]
        assert env == {"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(host),
                       "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": hosts.addresses[0]}
        assert seen == {d: [f"{tag}-{2 * host}", f"{tag}-{2 * host + 1}"] for d in ("/dev/shm", "/tmp")}
    assert not [f for d in ("/dev/shm", "/tmp") for f in os.listdir(d) if f.startswith(tag)]  # none here


@pytest.mark.hosts
def test_bad_host_arguments_say_what_was_expected(simulated_hosts):
    with pytest.raises(ValueError, match="hosts needs engine='processes'"):
        crt.run_replicas(_sum, [torch.ones(1)] * 2, hosts=simulated_hosts)
    with pytest.raises(ValueError, match="num_workers must be a multiple of the 2 simulated hosts; got 3"):
        crt.WorkerPool(3, hosts=simulated_hosts)
    with pytest.raises(ValueError, match="host must be an int in \\[0, 2\\); got 2"):
        simulated_hosts.host(2)
