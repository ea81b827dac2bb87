"""The local cluster's network namespaces (cluster/netns.py): names and addresses, the one-line
refusal without the right to make them, and (as root) a real bridge and namespace made and
removed without a trace."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from eagle3_pipeline.cluster import netns
from eagle3_pipeline.core.errors import PipelineError


def test_layout_gives_each_node_its_own_address_and_names_linux_accepts() -> None:
    layout = netns.Layout(port=65535, nodes=9)
    addresses = [layout.address(i) for i in range(9)]
    assert len(set(addresses)) == 9 and addresses[0] == "10.213.255.1"
    assert all(a.startswith("10.213.255.") for a in addresses)
    assert layout.namespace(0) is None  # the head stays where the driver runs
    assert netns.wrap(layout, 0, ["ray"]) == ["ray"]
    assert netns.wrap(layout, 2, ["ray"]) == ["ip", "netns", "exec", "e3-65535-n2", "ray"]
    names = [layout.bridge, *(layout.veth(i) for i in range(1, 9))]
    assert all(len(n) <= 15 for n in names)  # IFNAMSIZ - 1
    assert len(set(names)) == len(names)


def test_no_right_to_make_namespaces_is_one_line_naming_the_fix(monkeypatch) -> None:
    def run(argv, **kw):
        if argv[1] == "route":
            return subprocess.CompletedProcess(argv, 0, "", "")
        denied = "RTNETLINK answers: Operation not permitted\n"
        return subprocess.CompletedProcess(argv, 2, "", denied)

    monkeypatch.setattr(netns.subprocess, "run", run)
    with pytest.raises(PipelineError) as exc:
        netns.create(netns.Layout(6502, 2))
    message = str(exc.value)
    assert "\n" not in message and "Operation not permitted" in message
    assert "without NETNS=1" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_node_namespace_reaches_the_head_over_the_bridge_and_leaves_no_trace() -> None:
    layout = netns.Layout(port=6299, nodes=2)  # 10.213.155.0/24: no test cluster uses it
    netns.create(layout)
    try:
        with pytest.raises(PipelineError, match="already in use"):
            netns.create(layout)  # the subnet is taken: refused before any link is added
        with socket.socket() as server:
            server.bind((layout.address(0), 0))
            server.listen()
            port = server.getsockname()[1]
            code = (
                "import socket; s = socket.create_connection"
                f"(({layout.address(0)!r}, {port}), timeout=5); print(s.getsockname()[0])"
            )
            out = subprocess.run(
                netns.wrap(layout, 1, ["python3", "-c", code]),
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
        assert out.stdout.strip() == layout.address(1)  # the node dials from its own address
    finally:
        netns.remove(layout)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert layout.bridge not in links and layout.veth(1) not in links
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert layout.namespace(1) not in spaces
