"""One identity, one process: the data dir lock, and the coordinator refusing a second process of an identity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protolearn.coordinator.config import CoordinatorSettings
from protolearn.coordinator.core.dispatch import CoordinatorCore
from protolearn.coordinator.errors import Refusal
from protolearn.coordinator.core.run import RunInfo
from protolearn.data_dir_lock import DataDirInUse, DataDirLock
from protolearn.errors import ConfigError
from protolearn.node.join import take_session
from protolearn.protocol import coordination as cm
from tests.support.coordinator import join as join_core
from tests.support.coordinator import make_core

RUN = RunInfo(name="r", run_hash="h" * 64, run_toml="", layers=(1, 1), microbatches_per_step=2, tokens_per_step=8)


def core() -> CoordinatorCore:
    return make_core(RUN, CoordinatorSettings(rate_per_s=1e6, rate_burst=1e6))


def join(c: CoordinatorCore, peer: str, *, connections: int = 1) -> cm.JoinReply:
    return join_core(c, peer, connections=connections, name=peer)


def test_the_coordinators_own_identity_is_never_a_member() -> None:
    c = core()
    with pytest.raises(Refusal) as err:
        join(c, "coord")
    assert err.value.code == "own_identity" and "--data-dir or --name" in err.value.reason
    assert not c.registry.members


def test_a_live_members_second_connected_process_is_refused_and_the_first_keeps_its_place() -> None:
    c = core()
    first = join(c, "a")
    with pytest.raises(Refusal) as err:
        join(c, "a", connections=2)
    assert err.value.code == "identity_in_use" and "one identity runs in one process" in err.value.reason
    assert c.registry.is_live("a") and c.registry.members["a"].stage == first.stage
    # Its previous run died and its connection closed: a restart on the same identity rejoins as before.
    with pytest.raises(Refusal) as again:
        join(c, "a", connections=1)
    assert again.value.code == "already_joined"  # a join that names no session proves nothing: nothing changes
    assert c.registry.is_live("a") and c.registry.members["a"].stage == first.stage


S1, S2 = "1" * 16, "2" * 16


def beat(c: CoordinatorCore, peer: str, session: str, now: float) -> cm.Message:
    return c.handle(peer, cm.Heartbeat(state="training", session=session), now)


def test_a_copy_of_a_live_members_key_is_refused_even_while_its_connection_is_down() -> None:
    # A second process with the member's key (copied to another data dir) joins at a moment when the member's
    # own connection is down (one connection open: the copy's). It names another session: refused, and the
    # member keeps its place, its session and its heartbeats.
    c = core()
    first = join_core(c, "a", 0.0, session=S1)
    assert isinstance(beat(c, "a", S1, 1.0), cm.HeartbeatReply)
    for previous in ("", S2):
        with pytest.raises(Refusal) as err:
            join_core(c, "a", 1.5, session=S2, previous_session=previous, connections=1)
        assert err.value.code == "identity_in_use" and "one identity runs in one process" in err.value.reason
    m = c.registry.members["a"]
    assert m.status == "live" and m.stage == first.stage and m.session == S1
    assert isinstance(beat(c, "a", S1, 2.0), cm.HeartbeatReply)
    # Once the member really stops (no heartbeat for expiry_s), its identity joins as any departed one.
    c.housekeeping(2.0 + c.settings.expiry_s + 1)
    assert not c.registry.is_live("a")
    again = join_core(c, "a", 10.0, session=S2)
    assert again.stage == first.stage and c.registry.members["a"].session == S2


def test_a_retried_join_and_a_restart_on_the_data_dir_take_the_members_place_back_at_once() -> None:
    c = core()
    first = join_core(c, "a", 0.0, session=S1)
    # Its reply was lost and the same process asks again: answered again, the same stage.
    retry = join_core(c, "a", 0.5, session=S1)
    assert retry.stage == first.stage and c.registry.is_live("a")
    # It restarted on its data dir (whose lock says the old process ended) before the coordinator noticed.
    restart = join_core(c, "a", 1.0, session=S2, previous_session=S1, connections=1)
    assert restart.stage == first.stage and restart.rejoined and c.registry.members["a"].session == S2
    assert isinstance(beat(c, "a", S2, 1.5), cm.HeartbeatReply)
    # The process it replaced, were it still running (its data dir copied whole), is told to stop.
    with pytest.raises(Refusal) as err:
        beat(c, "a", S1, 2.0)
    assert err.value.code == "superseded" and "one identity runs in one process" in err.value.reason
    # A successor while the member's connection is still open is a second process with its key: refused.
    with pytest.raises(Refusal) as busy:
        join_core(c, "a", 2.5, session="3" * 16, previous_session=S2, connections=2)
    assert busy.value.code == "identity_in_use" and c.registry.members["a"].session == S2


def test_a_node_names_the_session_its_data_dir_last_had(tmp_path: Path) -> None:
    data = tmp_path / "n"
    first, none = take_session(data)
    second, previous = take_session(data)
    assert none == "" and previous == first and second != first and len(second) == 16
    (data / "session").write_text("not a session\n")
    assert take_session(data)[1] == ""


def test_a_second_lock_on_a_data_dir_names_the_first_holder(tmp_path: Path) -> None:
    with DataDirLock(tmp_path / "n"):
        with pytest.raises(DataDirInUse) as err:
            DataDirLock(tmp_path / "n", what="--name (or --data-dir)").acquire()
        assert f"process {os.getpid()}" in str(err.value) and "--name (or --data-dir)" in str(err.value)
    with DataDirLock(tmp_path / "n"):  # released: free again
        pass


def test_an_unusable_data_dir_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match="cannot use data dir .*file/n"):
        DataDirLock(tmp_path / "file" / "n").acquire()
