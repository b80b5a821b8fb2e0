"""Layers on another machine: llama.cpp's RPC backend with a retention policy gives the local greedy tokens (issue 15)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
from conftest import PROSE

from pykvcache import Llama, cli
from pykvcache._native import _lib_file

pytestmark = pytest.mark.skipif(not _lib_file("ggml-rpc").is_file(), reason="built without the RPC backend")

POLICY = "snapkv:budget=48,chunk=32"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server(port: int, threads: int) -> subprocess.Popen:
    """A `pykvcache rpc-server` on 127.0.0.1:port, once it accepts connections."""
    proc = subprocess.Popen([sys.executable, "-m", "pykvcache.rpc", "--port", str(port), "-t", str(threads)], cwd="/",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail("the RPC server did not start")


@pytest.fixture(scope="module")
def rpc_server():
    port = free_port()
    proc = start_rpc_server(port, 2)
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


CLIENT = """
import json, sys
from pykvcache import Llama
prompt, policy, server, model, fa = sys.argv[1:6]
def greedy(llm):
    return llm.create_completion(prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"]
def summary(llm):
    if "summarise" not in policy:
        return None
    s = llm.kv_summary()
    return {"n_bins": s.n_bins, "n_fallback": s.n_fallback, "fit_err": s.fit_err, "state": s.state.tolist()}
here = Llama(model, n_ctx=512, verbose=False, kv_policy=policy, flash_attn=fa == "1")
local = greedy(here)
remote = Llama(model, n_ctx=512, verbose=False, kv_policy=policy, rpc_servers=server, n_gpu_layers=-1,
               flash_attn=fa == "1")
def moves(llm):  # the host tier's moves between the device's caches and host memory
    if "host" not in policy and "freeze" not in policy:
        return None
    h = llm.kv_host()
    return [h.n_freeze, h.n_thaw, h.n_evict]
from pykvcache.server import kv_stats_of
shown = [[row["on_device"] for row in kv_stats_of(llm)["layers"]] for llm in (here, remote)]  # the server's stats
print(json.dumps({"local": local, "remote": greedy(remote), "on_device": [s.on_device for s in remote.kv_stats().layers],
                  "shown_local": shown[0], "shown_remote": shown[1],
                  "n_evicted": remote.kv_memory().n_evicted, "sum_local": summary(here), "sum_remote": summary(remote),
                  "moves_local": moves(here), "moves_remote": moves(remote)}))
"""


@pytest.mark.parametrize("policy, flash_attn", [(POLICY, "0"), (POLICY + "+summarise:bin=32,rank=4", "0"),
                                                (POLICY + "+summarise:bin=32,rank=4", "1"),
                                                ("freeze", "0"), (POLICY + "+host+latent", "1")])
def test_offloaded_layers_give_the_local_tokens(model_path, rpc_server, policy, flash_attn):
    # in a process of its own: ggml keeps a registered RPC device for the life of the process, and aborts on it
    # once the server is gone. Summarise reads its leavers out of the device and writes centroids into it (with
    # llama-cpp-python's default flash_attn=False, a transposed V), every layer's leavers in one gather
    res = subprocess.run([sys.executable, "-c", CLIENT, PROSE * 2, policy, rpc_server, model_path, flash_attn], cwd="/",
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(out["on_device"])  # every layer's KV cache lives on the RPC device
    assert out["shown_remote"] == out["on_device"] and not any(out["shown_local"])  # and /v1/kv/stats says so
    if out["moves_local"] is not None:  # the host tier: tokens moved out of the device and back, as locally
        assert out["moves_remote"] == out["moves_local"] and sum(out["moves_local"]) > 0
    else:
        assert out["n_evicted"] > 0
    if out["sum_local"] is None:
        assert out["remote"] == out["local"]
        return
    # summarise: the server's matmuls round differently from this process's (repacked) ones, and the fits amplify
    # that into other greedy tokens after a few; what moved between host and device is checked instead: the same
    # bins, the same kept / summarised / dropped token per layer and position (all of them without flash attention,
    # 99.8% with it: a few near ties go the other way), fit errors to rounding
    here, there = out["sum_local"], out["sum_remote"]
    assert there["n_bins"] == here["n_bins"] > 0 and there["n_fallback"] == here["n_fallback"] == 0
    same = [a == b for ra, rb in zip(here["state"], there["state"]) for a, b in zip(ra, rb)]
    assert sum(same) >= 0.99*len(same) and len(same) == 30*len(here["state"][0])
    assert abs(there["fit_err"] - here["fit_err"]) < 1e-2*here["fit_err"]
    assert out["remote"].split()[:4] == out["local"].split()[:4]


def test_unreachable_server_is_named(model_path):
    from pykvcache.rpc import RPCError

    port = free_port()
    with pytest.raises(RPCError, match=f"127.0.0.1:{port} cannot be reached"):
        Llama(model_path, n_ctx=256, verbose=False, rpc_servers=f"127.0.0.1:{port}", n_gpu_layers=-1)


GONE = """
import sys
from pykvcache import Llama
from pykvcache.rpc import RPCError
model, server = sys.argv[1:3]
llm = Llama(model, n_ctx=256, verbose=False, kv_policy="snapkv:budget=48", rpc_servers=server, n_gpu_layers=-1)
text = llm.create_completion("Hello", max_tokens=2, temperature=0.0)["choices"][0]["text"]
other = Llama(model, n_ctx=256, verbose=False, rpc_servers=server, n_gpu_layers=-1)  # the server still up, in use
del llm, other
print(text != "", flush=True)
sys.stdin.readline()  # the server is stopped now
for kw in ({"rpc_servers": server, "n_gpu_layers": -1}, {"n_gpu_layers": 0}):
    try:
        Llama(model, n_ctx=256, verbose=False, **kw)
        print("loaded", flush=True)
    except RPCError as exc:
        print(str(exc), flush=True)
"""


def test_a_server_gone_since_it_was_added_is_an_error_at_the_next_load(model_path):
    """ggml-rpc asks every device of the process for its memory at each model load, one that offloads nothing too:
    a server gone since aborted the process there (SIGABRT, no message)."""
    port = free_port()
    server = start_rpc_server(port, 1)
    try:
        client = subprocess.Popen([sys.executable, "-c", GONE, model_path, f"127.0.0.1:{port}"], cwd="/",
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "True"
        server.kill()
        server.wait()
        out, err = client.communicate("\n", timeout=120)
    finally:
        server.kill()
    assert client.returncode == 0, err[-2000:]
    lines = out.splitlines()
    assert len(lines) == 2 and all(f"RPC server 127.0.0.1:{port}, added earlier in this process, cannot be reached now"
                                   in line and "load models in a new process" in line for line in lines), out


def test_generate_offloads_to_rpc_servers_as_llama_cli(model_path, rpc_server):
    cmd = [sys.executable, "-m", "pykvcache.cli", "generate", "-m", model_path, "-p", "The capital of France is", "-n", "4",
           "-c", "256", "-t", "1", "-fa", "off", "--policy", "snapkv:budget=48", "-ngl", "99"]
    res = subprocess.run(cmd + ["--rpc", rpc_server], cwd="/", capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip(), res.stderr[-2000:]
    local = subprocess.run(cmd[:-2] + ["-ngl", "0"], cwd="/", capture_output=True, text=True, timeout=300)
    assert res.stdout == local.stdout
    port = free_port()
    res = subprocess.run(cmd + ["--rpc", f"127.0.0.1:{port}"], cwd="/", capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"pykvcache: error: RPC server 127.0.0.1:{port} cannot be reached (Connection refused); is `pykvcache "
        f"rpc-server` running there?"], res.stderr


def test_a_server_that_is_not_ggml_rpc_is_refused_not_waited_for(model_path):
    # ggml-rpc waits for ever on a service that never answers its handshake, and aborts on one that answers wrong
    import socket
    import threading

    from pykvcache.rpc import RPCError

    silent, talker = socket.socket(), socket.socket()
    for s in (silent, talker):
        s.bind(("127.0.0.1", 0))
        s.listen(4)

    def answer_junk():
        conn, _ = talker.accept()
        conn.recv(64)
        conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
        conn.close()

    threading.Thread(target=answer_junk, daemon=True).start()
    try:
        with pytest.raises(RPCError, match="did not answer ggml-rpc's handshake in 5 s"):
            Llama(model_path, n_ctx=256, verbose=False, rpc_servers=f"127.0.0.1:{silent.getsockname()[1]}",
                  n_gpu_layers=-1)
        with pytest.raises(RPCError, match="did not answer ggml-rpc's handshake"):
            Llama(model_path, n_ctx=256, verbose=False, rpc_servers=f"127.0.0.1:{talker.getsockname()[1]}",
                  n_gpu_layers=-1)
        with pytest.raises(RPCError, match="port must be in 1..65535"):
            Llama(model_path, n_ctx=256, verbose=False, rpc_servers="127.0.0.1:99999", n_gpu_layers=-1)
    finally:
        silent.close()
        talker.close()


@pytest.mark.parametrize("args, says", [
    (["-p", "-1"], "port must be in 1..65535"),
    (["-t", "0"], "threads must be >= 1"),
    (["--host", "nosuchhost.invalid"], "cannot resolve host"),
])
def test_rpc_server_bad_options_stop_with_one_line(args, says):
    res = subprocess.run([sys.executable, "-m", "pykvcache.rpc", *args], cwd="/", capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr


def test_rpc_server_on_a_port_in_use_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "pykvcache.rpc", "-p", str(port)], cwd="/", capture_output=True,
                             text=True, timeout=60)
    assert res.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in res.stderr and "in use" in res.stderr


SCHED = """
import sys
from pykvcache import Llama
prompt, policy, server, model, fa = sys.argv[1:6]
llm = Llama(model, n_ctx=512, verbose=True, kv_policy=policy, rpc_servers=server, n_gpu_layers=-1, flash_attn=fa == "1")
llm.create_completion(prompt, max_tokens=4, temperature=0.0)
"""


@pytest.mark.parametrize("flash_attn", ["0", "1"])
def test_offloaded_step_uploads_each_kind_of_input_once(model_path, rpc_server, flash_attn):
    # the scheduler uploads every input of an offloaded split on its own, after a synchronisation: the layers' cell
    # indices, masks and observation inputs must reach the device as one input per kind, not several per layer (30)
    env = dict(os.environ, GGML_SCHED_DEBUG="1")
    res = subprocess.run([sys.executable, "-c", SCHED, PROSE * 2, POLICY, rpc_server, model_path, flash_attn], cwd="/",
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    splits = [line for line in res.stderr.splitlines() if line.startswith("## SPLIT") and "RPC" in line]
    assert splits, res.stderr[-3000:]
    for line in splits:
        attn = re.findall(r"\[(attn_inp_\S+)", line)
        assert sorted(attn) == ["attn_inp_k_idxs-all", "attn_inp_kq_mask-all", "attn_inp_v_idxs-all"], line[:600]
        assert int(re.search(r"# (\d+) inputs", line).group(1)) <= 16, line[:600]
    assert any("kvp_obs_keep-all" in line for line in splits)  # an observing step was among them


def test_kvbench_measures_policies_on_an_rpc_device(rpc_server):
    # llama-bench's --rpc: the layers and their KV caches on the server's device, summarise's leavers read from it
    res = subprocess.run([sys.executable, "-m", "pykvcache.cli", "bench", "--rpc", rpc_server, "-ngl", "99", "-p", "256",
                          "-n", "8", "-r", "1", "-t", "2", "--no-limit", "--no-progress", "-o", "json",
                          "--policy", POLICY + "+summarise:bin=32,rank=4"], cwd="/", capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["rpc"] == rpc_server and out["n_gpu_layers"] == 99
    full, summ = out["results"]
    assert full["policy"] == "full" and summ["sum_bins"] > 0 and summ["kv_bytes"] < full["kv_bytes"]


@pytest.mark.parametrize("server, says", [("127.0.0.1:1", "cannot be reached"), ("nohost", "is not host:port")])
def test_kvbench_names_a_bad_rpc_server(server, says):
    res = subprocess.run([sys.executable, "-m", "pykvcache.cli", "bench", "--rpc", server, "-ngl", "99"], cwd="/",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and says in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_backend_check_against_an_rpc_device(rpc_server):
    # kvp-backend-check's other side on the server's device: the host-device moves of eviction, summarise and the
    # host tier checked without a local GPU (same tokens, KL and positions held within the bars)
    res = subprocess.run([sys.executable, "-m", "pykvcache.cli", "backend-check", "--rpc", rpc_server, "-p", "512", "-n",
                          "8", "-t", "2", "--policy", "h2o:budget=0.25", "--policy",
                          "snapkv:budget=0.1+summarise:bin=64,rank=4", "--policy", "freeze"], cwd="/",
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["gpu"] == rpc_server and out["pass"] and len(out["policies"]) == 3
    assert all(r["pass"] and "error" not in r for r in out["policies"])


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_memcheck_finds_no_error_on_the_host_and_over_rpc(rpc_server, tiny_llama):
    """kvp-backend-check under valgrind's memcheck, on a tiny model: eviction, summarise, the host tier with the
    freeze and sparse prefill, on the CPU and with the layers on the RPC server. Until the gaps between the layers'
    parts of the packed mask and index inputs were zeroed, every retention policy sent uninitialised host bytes to
    the server (memcheck: "socketcall.sendto(msg) points to uninitialised byte(s)")."""
    exe = cli.tool_path("kvp-backend-check")
    res = subprocess.run(["valgrind", "--error-exitcode=9", "--num-callers=20", str(exe), "-m", tiny_llama, "--rpc",
                          rpc_server, "-p", "200", "-n", "4", "-t", "1", "--policy", "h2o:budget=48,chunk=32+host+freeze",
                          "--policy", "snapkv:budget=48,chunk=32+summarise:bin=16,rank=2", "--policy",
                          "none+sparse:threshold=64,base=32,block=32,segment=32"],
                         cwd="/", capture_output=True, text=True, timeout=900)
    assert "ERROR SUMMARY: 0 errors" in res.stderr and res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout)
    assert len(out["policies"]) == 3 and out["pass"]
    summ = out["policies"][1]
    assert summ["summary_cpu"]["n_bins"] > 0  # the fits ran


TWO_NAMES = """
import ctypes, sys
from pykvcache import Llama, rpc
model, port = sys.argv[1:3]
texts = []
for name in ("localhost", "127.0.0.1"):
    llm = Llama(model, n_ctx=256, verbose=False, rpc_servers=f"{name}:{port}", n_gpu_layers=-1, n_threads=1)
    texts.append(llm.create_completion("Hello", max_tokens=4, temperature=0.0)["choices"][0]["text"])
    del llm
_, ggml, _ = rpc._libs()
ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
print(texts[0] == texts[1], ggml.ggml_backend_dev_count(), rpc._added, flush=True)
"""


def test_two_names_of_one_server_are_one_device(model_path):
    """Found by an audit: `localhost:P` then `127.0.0.1:P` registered two ggml-rpc devices for one server, each with
    its own connection, and the server serves one client at a time: the second model load waited for ever."""
    port = free_port()
    server = start_rpc_server(port, 1)
    try:
        res = subprocess.run([sys.executable, "-c", TWO_NAMES, model_path, str(port)], cwd="/", capture_output=True,
                             text=True, timeout=120)
    finally:
        server.kill()
        server.wait()
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().split(None, 2) == ["True", "2", f"['127.0.0.1:{port}']"]  # the CPU and the one server
