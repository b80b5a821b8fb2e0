"""Layers on other machines: llama.cpp's RPC backend (ggml-rpc), built into pykvcache's libraries.

On each helper machine run `pykvcache rpc-server --host 0.0.0.0 --port 50052` (it serves that machine's CPU, or GPU
where the build has one); on the main machine pass `Llama(..., rpc_servers="host1:50052,host2:50052",
n_gpu_layers=-1)` or `pykvcache serve --rpc_servers ...`: the model's layers, and their KV caches with a policy,
are spread over the servers. The protocol is unauthenticated: keep it on a trusted network.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import struct
import sys
from functools import lru_cache
from typing import List, Optional

from ._native import _lib_file

GGML_BACKEND_DEVICE_TYPE_CPU = 0
GGML_BACKEND_DEVICE_TYPE_GPU = 1


class RPCError(RuntimeError):
    """An RPC server cannot be reached or started."""


@lru_cache(maxsize=1)
def _libs():
    base = ctypes.CDLL(str(_lib_file("ggml-base")), mode=ctypes.RTLD_GLOBAL)
    ggml = ctypes.CDLL(str(_lib_file("ggml")), mode=ctypes.RTLD_GLOBAL)
    path = _lib_file("ggml-rpc")
    if not path.is_file():
        raise RPCError(f"this build of pykvcache has no RPC backend ({path} is missing): rebuild with -DGGML_RPC=ON")
    rpc = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                                   ctypes.POINTER(ctypes.c_void_p)]
    ggml.ggml_backend_register.restype = None
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    return base, ggml, rpc


_added: List[str] = []


def add_servers(servers: str) -> List[str]:
    """Register RPC servers ("host:port,host:port") as devices for the models loaded next; returns them as ip:port."""
    if not isinstance(servers, str):
        raise RPCError(f"rpc_servers must be a string \"host:port[,host:port...]\" (got {type(servers).__name__})")
    if ";" in servers:
        raise RPCError(f"rpc_servers '{servers}': separate servers with commas (host:port,host:port)")
    given = [s.strip() for s in servers.split(",") if s.strip()]
    if not given:
        raise RPCError("no RPC servers given (expected host:port[,host:port...])")
    endpoints: List[str] = []
    _, ggml, rpc = _libs()
    for name in given:
        host, _, port = name.rpartition(":")
        if not host or not port.isdigit():
            raise RPCError(f"RPC server '{name}' is not host:port")
        if not 1 <= int(port) <= 65535:
            raise RPCError(f"RPC server '{name}': port must be in 1..65535")
        # one device per server: ggml-rpc keeps a connection per endpoint string, and a server serves one client at a
        # time, so `localhost:P` after `127.0.0.1:P` (two devices, two connections) waited for ever at the next load
        try:
            host = socket.gethostbyname(host)
        except OSError as exc:
            raise RPCError(f"RPC server {name} cannot be reached: cannot resolve host '{host}' "
                           f"({exc.strerror or exc})") from None
        ep = f"{host}:{int(port)}"
        if ep not in endpoints:
            endpoints.append(ep)
        if ep in _added:
            continue  # checked by check_registered() before each model load
        # ggml-rpc aborts the process on a server that cannot be reached or answers wrong, and waits for ever on one
        # that never answers: ask first, with a timeout
        _hello(name, host, int(port))
        reg = rpc.ggml_backend_rpc_add_server(ep.encode())
        if not reg:
            raise RPCError(f"RPC server {name} cannot be reached (is `pykvcache rpc-server` running there?)")
        ggml.ggml_backend_register(reg)
        _added.append(ep)
    return endpoints


def check_registered(timeout: float = 5.0) -> None:
    """Raise RPCError where a server registered earlier in this process no longer accepts connections."""
    # ggml-rpc keeps every server it was given as a device of the process and asks each for its memory at every model
    # load, even one that offloads nothing: a server gone since aborts the process there, with no message. A connection
    # (not the handshake: the server serves one client at a time, maybe a live model of this process) tells first.
    for ep in _added:
        host, _, port = ep.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                pass
        except OSError as exc:
            raise RPCError(f"RPC server {ep}, added earlier in this process, cannot be reached now "
                           f"({exc.strerror or exc}): ggml-rpc keeps it as a device and would abort the process at any "
                           f"model load; start it again at that address, or load models in a new process") from None


# ggml-rpc's handshake (ggml-rpc.cpp): the HELLO command (14), its request (the connection's capabilities, 24 bytes;
# none here), and a reply of 28 bytes: the protocol's version (major, minor, patch, padding) and the server's capabilities
RPC_CMD_HELLO = 14
RPC_CONN_CAPS_SIZE = 24
RPC_HELLO_REPLY_SIZE = 4 + RPC_CONN_CAPS_SIZE


def _hello(ep: str, host: str, port: int, timeout: float = 5.0) -> None:
    """Check that an RPC server answers ggml-rpc's handshake within the timeout (RPCError otherwise)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(bytes([RPC_CMD_HELLO]) + struct.pack("<Q", RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
            reply = b""
            while len(reply) < 8 + RPC_HELLO_REPLY_SIZE:
                part = sock.recv(8 + RPC_HELLO_REPLY_SIZE - len(reply))
                if not part:
                    break
                reply += part
    except socket.timeout:
        raise RPCError(f"RPC server {ep} did not answer ggml-rpc's handshake in {timeout:g} s: is it a "
                       f"`pykvcache rpc-server`?") from None
    except OSError as exc:
        raise RPCError(f"RPC server {ep} cannot be reached ({exc.strerror or exc}); is `pykvcache rpc-server` "
                       f"running there?") from None
    if len(reply) < 8 + RPC_HELLO_REPLY_SIZE or struct.unpack("<Q", reply[:8])[0] != RPC_HELLO_REPLY_SIZE:
        raise RPCError(f"RPC server {ep} did not answer ggml-rpc's handshake (it answered {len(reply)} bytes): is it "
                       f"a `pykvcache rpc-server`?")


def listen_address(host: str, port: int) -> str:
    """The numeric address ggml-rpc listens on for host (a name is resolved), checked free to bind on port."""
    if not 1 <= port <= 65535:
        raise RPCError(f"port must be in 1..65535 (got {port})")
    try:
        ip = socket.gethostbyname(host)
    except OSError as exc:
        raise RPCError(f"cannot resolve host '{host}' ({exc.strerror or exc})") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as exc:
            raise RPCError(f"cannot listen on {ip}:{port} ({exc.strerror or exc})") from None
    return ip


def serve(host: str, port: int, threads: int, cache_dir: Optional[str] = None) -> None:
    """Serve this machine's device (GPU if the build has one, else CPU) to RPC clients until killed."""
    if threads < 1:
        raise RPCError(f"threads must be >= 1 (got {threads})")
    host = listen_address(host, port)
    if cache_dir:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as exc:
            raise RPCError(f"cannot use the cache folder {cache_dir} ({exc.strerror or exc})") from None
    _, ggml, rpc = _libs()
    dev = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU) or ggml.ggml_backend_dev_by_type(
        GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise RPCError("no ggml device to serve")
    devices = (ctypes.c_void_p * 1)(dev)
    endpoint = f"{host}:{port}".encode()
    rpc.ggml_backend_rpc_start_server(endpoint, cache_dir.encode() if cache_dir else None, threads, 1, devices)
    raise RPCError(f"the RPC server could not start on {host}:{port}")


def main(argv: Optional[List[str]] = None) -> int:
    """`pykvcache rpc-server`: serve this machine's device to pykvcache clients."""
    ap = argparse.ArgumentParser(prog="pykvcache rpc-server", description=__doc__.splitlines()[0] + " Serves this "
                                 "machine's GPU (or CPU) to clients that pass rpc_servers=host:port.")
    ap.add_argument("--host", default="127.0.0.1", help="address or host name to listen on (default: 127.0.0.1; the "
                    "protocol is unauthenticated, expose it on trusted networks only)")
    ap.add_argument("-p", "--port", type=int, default=50052, help="port (default: 50052)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    ap.add_argument("-c", "--cache", default=None, help="folder caching tensors sent by clients, created if missing "
                    "(default: none)")
    args = ap.parse_args(argv)
    try:
        serve(args.host, args.port, args.threads, args.cache)
    except RPCError as exc:
        print(f"pykvcache rpc-server: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
