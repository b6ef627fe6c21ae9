"""The line to paste works on another machine: two network namespaces with real (non-loopback) addresses.

The coordinator listens on the wildcard in one namespace and must print the address of its interface
first (it printed 127.0.0.1, and looked up others by hostname). A node in the other namespace joins with
exactly that line, is found reachable at its own interface's address, trains the run and finishes.
Neither namespace has a default route, so the address can only come from the interface itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.netns import lan, lan_unavailable
from protolearn.supervisor import Supervisor
from tests.support.cli import CLI
from tests.support.swarm import TINY

UNAVAILABLE = lan_unavailable()
DEADLINE_S = 240.0


@pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")
def test_the_printed_address_is_the_interfaces_and_a_node_on_another_machine_joins_with_it(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(TINY.format(steps=4, codec="none", layers=1, stages=1))
    with lan() as net:
        s = Supervisor(tmp_path)
        s.spawn("coord", "coordinator", "start", "--listen", "/ip4/0.0.0.0/tcp/0", "--config", str(config),
                "--data-dir", str(tmp_path / "coord"), prefix=net.argv(net.a, []))
        try:
            line = s.wait_first_line("coord", 90)
            assert line.startswith(f"/ip4/{net.a_ip}/tcp/") and "/p2p/12D3KooW" in line, line
            said = (tmp_path / "coord.err").read_text()
            assert f"join with: protolearn node join --coordinator {line}" in said and "this machine only" in said, said

            node = s.spawn("n", "node", "join", "--coordinator", line, "--listen", "/ip4/0.0.0.0/tcp/0", "--data-dir", str(tmp_path / "n"),
                           "--name", "far-box", "--device", "cpu", "--threads", "1", prefix=net.argv(net.b, []))
            assert node.wait(timeout=DEADLINE_S) == 0, s.err("n")
            events = s.events("n")
            reach = next(e for e in events if e["event"] == "reachability")
            assert reach["verdict"] == "public" and reach["addrs"][0].startswith(f"/ip4/{net.b_ip}/"), reach
            assert sum(e["event"] == "step" for e in events) == 4
            st = net.run(net.b, [*CLI, "swarm", "status", "--coordinator", line, "--json"], capture_output=True, text=True, timeout=60)
            assert st.returncode == 0, st.stderr
            assert json.loads(st.stdout)["verdict"] == "finished"
        finally:
            s.stop(grace_s=20)
