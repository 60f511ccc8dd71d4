"""The CROSSREPLICA_* settings: declared once, read when used, validated like arguments.

A bad value of every variable is a ValueError naming it; good values take
effect; ``import crossreplica`` never fails on a bad value; every strategy holds
CROSSREPLICA_TIMEOUT to the rule of ``timeout_seconds``; an unknown variable is
warned about once; docs/settings.md lists every variable.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from harness import REPO, subprocess_env

import crossreplica as cr
from crossreplica import settings
from crossreplica.engines.threads import ThreadsEngine
from crossreplica.logs import ConfigurationWarning, slow_seconds
from crossreplica.elastic.job_store import job_namespace as _job_namespace

_SECONDS = r"must be a positive number of seconds, at most 604800 \(one week\)"
_FLAG = r"must be one of \['1', 'true', 'yes', 'on', '0', 'false', 'no', 'off'\] \(any case\)"
_ADDRESS = r"must be HOST:PORT with a port in 1\.\.65535, e\.g\. 'node0:29400'"
_SECRET = r"must be a string of printable characters, without spaces at its ends, other than 'none'"

# (variable, bad value, what the message says the rule is)
BAD = [
    ("CROSSREPLICA_TIMEOUT", "abc", _SECONDS),
    ("CROSSREPLICA_TIMEOUT", "inf", _SECONDS),
    ("CROSSREPLICA_TIMEOUT", "nan", _SECONDS),
    ("CROSSREPLICA_TIMEOUT", "0", _SECONDS),
    ("CROSSREPLICA_TIMEOUT", "-5", _SECONDS),
    ("CROSSREPLICA_TIMEOUT", "604801", _SECONDS),
    ("CROSSREPLICA_TIMEOUT", "300s", _SECONDS),
    ("CROSSREPLICA_SLOW_SECONDS", "soon", _SECONDS),
    ("CROSSREPLICA_SLOW_SECONDS", "0", _SECONDS),
    ("CROSSREPLICA_SLOW_SECONDS", "-1", _SECONDS),
    ("CROSSREPLICA_SLOW_SECONDS", "inf", _SECONDS),
    ("CROSSREPLICA_HEARTBEAT_SECONDS", "0", _SECONDS),
    ("CROSSREPLICA_HEARTBEAT_SECONDS", "often", _SECONDS),
    ("CROSSREPLICA_CHECK_COLLECTIVES", "enabled", _FLAG),
    ("CROSSREPLICA_CHECK_COLLECTIVES", "2", _FLAG),
    ("CROSSREPLICA_SHARED_MEMORY", "maybe", _FLAG),
    ("CROSSREPLICA_SHARED_MEMORY", "10", _FLAG),
    ("CROSSREPLICA_JOIN", "later", _FLAG),
    ("CROSSREPLICA_COORDINATOR", "node0", _ADDRESS),
    ("CROSSREPLICA_COORDINATOR", "node0:0", _ADDRESS),
    ("CROSSREPLICA_COORDINATOR", ":29400", _ADDRESS),
    ("CROSSREPLICA_COORDINATOR", "node0:http", _ADDRESS),
    ("CROSSREPLICA_LAUNCH_ID", "two words", r"must be printable characters without spaces"),
    ("CROSSREPLICA_JOB_SECRET", "none", _SECRET),
    ("CROSSREPLICA_JOB_SECRET", " padded", _SECRET),
    ("CROSSREPLICA_JOB_SECRET", "tab\tinside", _SECRET),
    ("CROSSREPLICA_PARALLEL_BYTES", "0", "must be a positive int"),
    ("CROSSREPLICA_PARALLEL_BYTES", "-1", "must be a positive int"),
    ("CROSSREPLICA_PARALLEL_BYTES", "2MiB", "must be a positive int"),
    ("CROSSREPLICA_PARALLEL_BYTES", "1.5", "must be a positive int"),
    ("CROSSREPLICA_SHARED_ROWS_MEMBERS", "1", "must be an int >= 2"),
    ("CROSSREPLICA_SHARED_ROWS_MEMBERS", "eight", "must be an int >= 2"),
]


@pytest.fixture(autouse=True)
def _no_unknown_warnings(monkeypatch):
    """Each test starts with no unknown variable warned about yet."""
    monkeypatch.setattr(settings, "_warned", set())


def _no_launcher(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)


def test_every_variable_has_bad_values_tested():
    read = {name for name, s in settings.SETTINGS.items() if s.kind != "script"}
    assert read == {name for name, _, _ in BAD}


@pytest.mark.parametrize("name,raw,rule", BAD, ids=[f"{n}={r!r}" for n, r, _ in BAD])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, name, raw, rule):
    monkeypatch.setenv(name, raw)
    got = re.escape(repr(raw)[1:-1])
    if name == "CROSSREPLICA_JOB_SECRET" and raw != "none":  # a secret is not repeated in a message
        got = rf"a value of {len(raw)} characters \(not shown: a secret\)"
    with pytest.raises(ValueError, match=rf"^environment variable {name} {rule}; got .*{got}"):
        settings.get(name)


@pytest.mark.parametrize("name,raw", [
    ("CROSSREPLICA_TIMEOUT", "abc"), ("CROSSREPLICA_SLOW_SECONDS", "soon"),
    ("CROSSREPLICA_PARALLEL_BYTES", "lots"), ("CROSSREPLICA_SHARED_ROWS_MEMBERS", "1"),
])
def test_building_a_threads_strategy_checks_what_it_reads(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    for build in (cr.OneDeviceStrategy, lambda: cr.MirroredStrategy(num_replicas=2)):
        with pytest.raises(ValueError, match=f"environment variable {name} must be"):
            build()


@pytest.mark.parametrize("name,raw", [
    ("CROSSREPLICA_TIMEOUT", "inf"), ("CROSSREPLICA_SLOW_SECONDS", "0"), ("CROSSREPLICA_CHECK_COLLECTIVES", "sure"),
    ("CROSSREPLICA_SHARED_MEMORY", "auto"), ("CROSSREPLICA_JOB_SECRET", "none"),
    ("CROSSREPLICA_HEARTBEAT_SECONDS", "-1"),
])
def test_multi_worker_checks_its_settings_before_any_set_up(monkeypatch, name, raw):
    _no_launcher(monkeypatch)
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"environment variable {name} must be"):
        cr.MultiWorkerMirroredStrategy()
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- good values

@pytest.mark.parametrize("name,raw,value", [
    ("CROSSREPLICA_TIMEOUT", "12.5", 12.5),
    ("CROSSREPLICA_TIMEOUT", " 7 ", 7.0),
    ("CROSSREPLICA_TIMEOUT", "604800", 604800.0),
    ("CROSSREPLICA_TIMEOUT", "", 300.0),
    ("CROSSREPLICA_SLOW_SECONDS", "0.5", 0.5),
    ("CROSSREPLICA_SLOW_SECONDS", "  ", None),
    ("CROSSREPLICA_HEARTBEAT_SECONDS", "", 2.0),
    ("CROSSREPLICA_HEARTBEAT_SECONDS", "0.5", 0.5),
    ("CROSSREPLICA_CHECK_COLLECTIVES", "YES", True),
    ("CROSSREPLICA_CHECK_COLLECTIVES", " On ", True),
    ("CROSSREPLICA_CHECK_COLLECTIVES", "off", False),
    ("CROSSREPLICA_CHECK_COLLECTIVES", "", False),
    ("CROSSREPLICA_SHARED_MEMORY", "0", False),
    ("CROSSREPLICA_SHARED_MEMORY", "False", False),
    ("CROSSREPLICA_SHARED_MEMORY", "", True),
    ("CROSSREPLICA_JOB_SECRET", "s3cret-of-this-job", "s3cret-of-this-job"),
    ("CROSSREPLICA_JOB_SECRET", "", None),
    ("CROSSREPLICA_PARALLEL_BYTES", "1024", 1024),
    ("CROSSREPLICA_SHARED_ROWS_MEMBERS", "2", 2),
])
def test_good_values(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert settings.get(name) == value


def test_unset_gives_the_defaults(monkeypatch):
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert (settings.timeout(), settings.slow_seconds(), settings.check_collectives(), settings.shared_memory(),
            settings.job_secret(), settings.parallel_bytes(), settings.shared_rows_members()) == \
        (300.0, None, False, True, None, 2 * 1024 * 1024, 8)


def test_a_changed_value_is_read_again(monkeypatch):
    monkeypatch.setenv("CROSSREPLICA_TIMEOUT", "10")
    assert settings.timeout() == 10.0
    monkeypatch.setenv("CROSSREPLICA_TIMEOUT", "20")
    assert settings.timeout() == 20.0
    monkeypatch.setenv("CROSSREPLICA_TIMEOUT", "never")
    with pytest.raises(ValueError, match="CROSSREPLICA_TIMEOUT"):
        settings.timeout()


def test_the_timeout_takes_effect_in_every_strategy(monkeypatch):
    _no_launcher(monkeypatch)
    monkeypatch.setenv("CROSSREPLICA_TIMEOUT", "42")
    assert cr.OneDeviceStrategy().extended.engine.timeout == 42.0
    assert cr.MirroredStrategy(num_replicas=2).extended.engine.timeout == 42.0
    assert cr.MirroredStrategy(num_replicas=2, timeout_seconds=5).extended.engine.timeout == 5.0
    strategy = cr.MultiWorkerMirroredStrategy()
    try:
        assert strategy.extended.engine.timeout == 42.0
    finally:
        strategy.close()


def test_every_strategy_refuses_an_infinite_timeout(monkeypatch):
    """CROSSREPLICA_TIMEOUT=inf is refused by every strategy, as timeout_seconds=inf is."""
    _no_launcher(monkeypatch)
    builders = {"OneDeviceStrategy": cr.OneDeviceStrategy,
                "MirroredStrategy": lambda: cr.MirroredStrategy(num_replicas=2),
                "MultiWorkerMirroredStrategy": cr.MultiWorkerMirroredStrategy}
    monkeypatch.setenv("CROSSREPLICA_TIMEOUT", "inf")
    for what, build in builders.items():
        with pytest.raises(ValueError, match=f"environment variable CROSSREPLICA_TIMEOUT {_SECONDS}; got inf"):
            build()
        assert not dist.is_initialized(), what
    monkeypatch.delenv("CROSSREPLICA_TIMEOUT")
    with pytest.raises(ValueError, match=f"timeout_seconds {_SECONDS}; got inf"):
        cr.MirroredStrategy(num_replicas=2, timeout_seconds=float("inf"))
    with pytest.raises(ValueError, match=f"timeout_seconds {_SECONDS}; got inf"):
        cr.MultiWorkerMirroredStrategy(timeout_seconds=float("inf"))


def test_slow_seconds_takes_effect(monkeypatch):
    monkeypatch.setenv("CROSSREPLICA_SLOW_SECONDS", "0.25")
    assert slow_seconds(300.0) == 0.25
    assert cr.MirroredStrategy(num_replicas=2).extended.engine.rendezvous.slow == 0.25
    monkeypatch.delenv("CROSSREPLICA_SLOW_SECONDS")
    assert slow_seconds(300.0) == 10.0 and slow_seconds(30.0) == 3.0


def test_check_collectives_and_shared_memory_take_effect(monkeypatch):
    _no_launcher(monkeypatch)
    monkeypatch.setenv("CROSSREPLICA_CHECK_COLLECTIVES", "True")
    monkeypatch.setenv("CROSSREPLICA_SHARED_MEMORY", "no")
    strategy = cr.MultiWorkerMirroredStrategy()
    try:
        assert strategy.extended.engine.check_collectives
        assert strategy.extended.engine.shared_memory is None
    finally:
        strategy.close()


def test_the_job_secret_takes_effect(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    spaces = set()
    for secret in ("alpha", "beta"):
        monkeypatch.setenv("CROSSREPLICA_JOB_SECRET", secret)
        spaces.add(_job_namespace())
    assert len(spaces) == 2
    monkeypatch.setenv("CROSSREPLICA_JOB_SECRET", "none")
    with pytest.raises(ValueError, match="CROSSREPLICA_JOB_SECRET"):
        _job_namespace()


def _sum(x):
    return cr.all_reduce(x, "sum")


@pytest.mark.parametrize("members,shared", [("2", True), ("3", False)])
def test_the_threads_engine_knobs_take_effect(monkeypatch, members, shared):
    monkeypatch.setenv("CROSSREPLICA_PARALLEL_BYTES", "4096")
    monkeypatch.setenv("CROSSREPLICA_SHARED_ROWS_MEMBERS", members)
    engine = ThreadsEngine([torch.device("cpu")] * 2, 10.0)
    assert (engine._parallel_bytes, engine._shared_rows_members) == (4096, int(members))
    strategy = cr.MirroredStrategy(num_replicas=2)
    out = strategy.experimental_local_results(strategy.run(_sum, (cr.PerReplica((torch.ones(4), torch.ones(4))),)))
    assert all(torch.equal(t, torch.full((4,), 2.0)) for t in out)
    one_buffer = out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
    assert one_buffer == shared


# --------------------------------------------------------------------------- laziness

def test_import_never_fails_on_a_bad_value():
    """Every variable bad at once: the import succeeds, and each use names its variable."""
    env = subprocess_env()
    env.update({name: raw for name, raw, _ in BAD[::-1]})  # the first bad value of each variable
    code = ("import crossreplica as cr\n"
            "for build in (cr.OneDeviceStrategy, cr.MirroredStrategy):\n"
            "    try:\n"
            "        build()\n"
            "    except ValueError as e:\n"
            "        print(type(e).__name__, e)\n"
            "print(cr.settings.describe())\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["ValueError environment variable CROSSREPLICA_TIMEOUT must be a positive number of "
                         "seconds, at most 604800 (one week); got 'abc'"] * 2
    for name in {name for name, _, _ in BAD}:
        assert any(line.startswith(f"{name}: invalid: environment variable {name} must be") for line in lines), name


# --------------------------------------------------------------------------- unknown variables, docs

def test_an_unknown_variable_is_warned_about_once(monkeypatch):
    monkeypatch.setenv("CROSSREPLICA_TIMOUT", "5")
    with pytest.warns(ConfigurationWarning, match=r"environment variable CROSSREPLICA_TIMOUT is not a crossreplica "
                                                  r"setting and is ignored; did you mean CROSSREPLICA_TIMEOUT\?"):
        settings.timeout()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigurationWarning)
        settings.timeout()  # once only
    monkeypatch.setenv("CROSSREPLICA_XYZZY", "1")
    with pytest.warns(ConfigurationWarning, match=r"CROSSREPLICA_XYZZY is not a crossreplica setting and is "
                                                  r"ignored; the known ones are \['CROSSREPLICA_TIMEOUT'"):
        settings.timeout()


def test_describe_hides_the_secret(monkeypatch):
    monkeypatch.setenv("CROSSREPLICA_JOB_SECRET", "do-not-print-me")
    monkeypatch.setenv("CROSSREPLICA_TIMEOUT", "60")
    text = settings.describe()
    assert "do-not-print-me" not in text and "CROSSREPLICA_JOB_SECRET = <set> (environment)" in text
    assert "CROSSREPLICA_TIMEOUT = 60.0 (environment)" in text


def test_the_docs_list_every_variable():
    doc = (pathlib.Path(REPO) / "docs" / "settings.md").read_text()
    rows = set(re.findall(r"^\| `(CROSSREPLICA_\w+)` \|", doc, re.M))
    assert rows == set(settings.SETTINGS)
    for name, setting in settings.SETTINGS.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}` |"))
        default = setting.default
        if setting.kind != "script" and default is not None and not isinstance(default, bool):
            assert f"`{default:g}`" in row if isinstance(default, float) else f"`{default}`" in row, (name, row)
