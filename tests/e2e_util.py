"""What the end-to-end scripts share: free ports, checks, one node's certs and config."""

import os
import socket
import subprocess
import tempfile
from dataclasses import dataclass


def free_tcp_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_udp_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


@dataclass
class NodeSetup:
    """A node's run directory (certificates, `node.toml`) and ports, all on 127.0.0.1."""
    tmp: str
    config_path: str
    engine_port: int
    http_port: int
    admin_port: int
    quic_port: int


def node_setup(binary, node_id, admin_token, prefix, engine_extra=""):
    """Certificates and a config for one node beside an emulator (kind `sglang`) on a
    free port; `engine_extra` is more `[engine]` keys."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    subprocess.run([binary, "certs", "--out", os.path.join(tmp, "certs"), "--nodes", node_id],
                   check=True, stdout=subprocess.DEVNULL)
    engine_port, http_port, admin_port, quic_port = (
        free_tcp_port(), free_tcp_port(), free_tcp_port(), free_udp_port())
    config = f"""
[node]
id = "{node_id}"
region = "{node_id}"

[listen]
http = "127.0.0.1:{http_port}"
quic = "127.0.0.1:{quic_port}"
admin = "127.0.0.1:{admin_port}"

[engine]
url = "http://127.0.0.1:{engine_port}"
kind = "sglang"
{engine_extra}
[tls]
ca = "certs/ca.pem"
cert = "certs/{node_id}.pem"
key = "certs/{node_id}.key"

[admin]
token = "{admin_token}"
"""
    config_path = os.path.join(tmp, "node.toml")
    with open(config_path, "w") as f:
        f.write(config)
    return NodeSetup(tmp, config_path, engine_port, http_port, admin_port, quic_port)
