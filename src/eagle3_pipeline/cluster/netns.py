"""Network namespaces for the local cluster: each node its own address, as on separate machines.

`make cluster-local NODES=2 NETNS=1` puts every node but the head in its own network namespace,
joined to the head's by a Linux bridge on a private /24 (10.213.<port % 256>.0/24): the head
(where the driver runs, in this machine's namespace) is .1, node i is .(10 + i). A bind to the
wrong address, a Mooncake client registering another node's hostname or a collective that
picks an interface by hostname then fails here as it would between machines, instead of
passing because every node shares one address. Traffic stays on the bridge: no forwarding,
no route to the outside. Needs root (CAP_NET_ADMIN) and iproute2's `ip`.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from eagle3_pipeline.core.errors import PipelineError

SUBNET = "10.213.{}.0/24"


@dataclass(frozen=True)
class Layout:
    """The names and addresses of one local cluster's namespaces (all derived from its port)."""

    port: int
    nodes: int

    @property
    def octet(self) -> int:
        return self.port % 256

    @property
    def bridge(self) -> str:
        return f"e3b{self.port}"

    def namespace(self, i: int) -> str | None:
        """Node i's namespace (None for the head, which stays in this machine's)."""
        return None if i == 0 else f"e3-{self.port}-n{i}"

    def address(self, i: int) -> str:
        return f"10.213.{self.octet}.{1 if i == 0 else 10 + i}"

    def veth(self, i: int) -> str:
        return f"e3v{self.port}n{i}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip ARGS`; with `check`, a failure is one line naming the command and the fix."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and out.returncode != 0:
        first = (out.stderr.strip().splitlines() or ["no message"])[0]
        raise PipelineError(
            f"local cluster: `ip {' '.join(args)}` failed ({first}): network namespaces need "
            "root (CAP_NET_ADMIN); run without NETNS=1 to share this machine's address"
        )
    return out


def create(layout: Layout) -> None:
    """The bridge with the head's address, and a namespace per other node, each with a veth on
    the bridge, its address and loopback up. Refuses when the subnet is already routed here."""
    if shutil.which("ip") is None:
        raise PipelineError("local cluster: NETNS=1 needs iproute2's `ip` (apt install iproute2)")
    subnet = SUBNET.format(layout.octet)
    routes = _ip("route", "show", subnet, check=False).stdout.strip()
    if routes:
        raise PipelineError(
            f"local cluster: {subnet} is already in use here ({routes.splitlines()[0]}): "
            "make cluster-down, or start on another --port"
        )
    _ip("link", "add", layout.bridge, "type", "bridge")
    _ip("addr", "add", f"{layout.address(0)}/24", "dev", layout.bridge)
    _ip("link", "set", layout.bridge, "up")
    for i in range(1, layout.nodes):
        ns, veth = layout.namespace(i), layout.veth(i)
        assert ns is not None
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", layout.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{layout.address(i)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def wrap(layout: Layout, i: int, cmd: list[str]) -> list[str]:
    """`cmd` run inside node i's namespace (unchanged for the head)."""
    ns = layout.namespace(i)
    return cmd if ns is None else ["ip", "netns", "exec", ns, *cmd]


def remove(layout: Layout) -> None:
    """Delete the namespaces (their veths go with them) and the bridge; what is gone is skipped."""
    for i in range(1, layout.nodes):
        ns = layout.namespace(i)
        assert ns is not None
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", layout.veth(i), check=False)
    _ip("link", "del", layout.bridge, check=False)
