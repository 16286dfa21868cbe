"""VLLMHTTPClient against the real C++ consumer (`wsync consumer --standalone`).

A standalone publisher puts three versions into shared memory and writes their manifests; each
test starts its own consumer on a free port and drives it through the client, checking the
answers and the error classes of refused calls. Skipped when the wsync binary is missing (set
WSYNC_BIN, default build/default/apps/wsync).
"""

import hashlib
import json
import os
import pickle
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from wsync._errors import (BlockedError, HTTPError, IllegalTransitionError, InstallFailedError,
                           InvalidArgumentError, TransportIOError, VersionNotMonotonicError,
                           WeightSyncError)
from wsync.http_client import VLLMHTTPClient

REPO = Path(__file__).resolve().parents[2]
WSYNC_BIN = os.environ.get("WSYNC_BIN", str(REPO / "build" / "default" / "apps" / "wsync"))
START_LIMIT_S = 20.0  # how long a process may take to write its port or manifest file

# Variables that would change what the processes do: a token or coordinator from the caller.
_CLEAN_ENV = {k: v for k, v in os.environ.items()
              if k not in ("WSYNC_HTTP_TOKEN", "WSYNC_COORDINATOR", "WSYNC_SERVER_DEV_MODE")}


def _need_binary() -> str:
    if not (os.path.isfile(WSYNC_BIN) and os.access(WSYNC_BIN, os.X_OK)):
        pytest.skip(f"wsync binary not found at {WSYNC_BIN} (build it, or set WSYNC_BIN)")
    return WSYNC_BIN


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_file(path: Path, proc: subprocess.Popen, log: Path) -> str:
    """The file's text once the process wrote it (both write it by rename, so it is whole)."""
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return path.read_text()
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    _stop(proc)
    pytest.fail(f"{path.name} never appeared (exit {proc.returncode}); log:\n"
                f"{log.read_text() if log.exists() else ''}")


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    """Three manifests (JSON texts, versions 1-3) of a standalone shared-memory publisher."""
    wsync = _need_binary()
    work = tmp_path_factory.mktemp("publisher")
    out, log = work / "manifests.jsonl", work / "publisher.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [wsync, "publisher", "--standalone", "--rank", "0", "--layout", "synthetic:2097152:6",
             "--versions", "3", "--manifest-out", str(out)],
            stdout=log_file, stderr=subprocess.STDOUT, env=_CLEAN_ENV)
    try:
        lines = _wait_for_file(out, proc, log).splitlines()
        assert len(lines) == 3, lines
        yield lines
    finally:
        _stop(proc)  # SIGTERM: the publisher releases its segments


@pytest.fixture
def start_server(tmp_path):
    """start_server(*extra_args) -> base URL of a fresh standalone consumer; stopped after."""
    wsync = _need_binary()
    procs = []

    def start(*extra):
        n = len(procs)
        port_file, log = tmp_path / f"port{n}", tmp_path / f"consumer{n}.log"
        with open(log, "w") as log_file:
            proc = subprocess.Popen(
                [wsync, "consumer", "--standalone", "--enable-weight-transfer", "--http-host",
                 "127.0.0.1", "--http-port", "0", "--http-port-file", str(port_file), *extra],
                stdout=log_file, stderr=subprocess.STDOUT, env=_CLEAN_ENV)
        procs.append(proc)
        port = int(_wait_for_file(port_file, proc, log).strip())
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        _stop(proc)


def _names(manifest: str, count: int):
    return [t["name"] for t in json.loads(manifest)["tensors"][:count]]


def test_lifecycle_as_rlhf_trainers_run_it(start_server, manifests):
    client = VLLMHTTPClient(start_server("--world-size", "2", "--data-parallel", "2"))
    assert client.health()
    assert client.world_size() == 4
    assert client.world_size(include_dp=False) == 2
    assert client.is_paused() is False
    assert client.pause() == {"status": "paused"}
    assert client.is_paused() is True

    m1, m2, m3 = manifests
    assert client.init({"transport": "shared-memory"}) == {
        "message": "Weight transfer initialized"}
    assert client.start() == {"message": "Weight update started"}
    names = _names(m1, 2)
    # A chunk with the manifest (JSON text), then one that only describes more of it.
    assert client.update({"names": names, "manifest": m1}) == {"message": "Weights updated"}
    assert client.update({"names": names}) == {"message": "Weights updated"}
    assert client.status()["active_weight_version"] == 0
    assert client.finish() == {"message": "Weight update finished", "weight_version": 1}
    assert client.resume() == {"status": "resumed"}
    assert client.is_paused() is False
    status = client.status()
    assert status["active_weight_version"] == 1
    assert status["phase"] == "ready"

    # Newer clients: bare start, update_info as a list holding a JSON object, a labelled finish.
    client.start(None)
    tensors = json.loads(m2)["tensors"]
    chunk = {"names": [t["name"] for t in tensors],
             "dtype_names": ["torch.float32" if t["dtype"] == "f32" else t["dtype"]
                             for t in tensors],
             "shapes": [t["shape"] for t in tensors],
             "manifest": json.loads(m2)}
    client.update([chunk])
    assert client.finish(weight_version=2)["weight_version"] == 2

    # vLLM's client protocol names drive the same calls.
    client.start_weight_update()
    client.update_weights({"manifest": m3})
    client.finish_weight_update()
    assert client.status()["active_weight_version"] == 3

    # Pause modes.
    assert client.pause("keep") == {"status": "paused"}
    assert client.is_paused() is True
    client.resume()
    assert client.pause(mode="wait") == {"status": "paused"}
    client.resume()


def test_out_of_order_is_409_naming_the_phase(start_server, manifests):
    client = VLLMHTTPClient(start_server())
    with pytest.raises(IllegalTransitionError) as e:
        client.start()
    assert isinstance(e.value, HTTPError) and e.value.status == 409
    assert e.value.code == "illegal_transition"
    assert e.value.path == "/start_weight_update"
    assert "POST /start_weight_update: HTTP 409" in str(e.value)
    assert "'uninitialized'" in str(e.value)
    assert "/init_weight_transfer_engine first" in str(e.value)
    assert json.loads(e.value.body)["error"] in str(e.value)

    client.init({})
    with pytest.raises(IllegalTransitionError, match="finish_weight_update.*'ready'"):
        client.finish()
    with pytest.raises(IllegalTransitionError, match="'ready'.*start_weight_update first"):
        client.update({"manifest": manifests[0]})
    client.start()
    with pytest.raises(IllegalTransitionError, match="'started'") as e:
        client.start()
    assert e.value.status == 409
    client.init({})  # an init drops the update started (a restarted trainer begins anew)
    with pytest.raises(IllegalTransitionError, match="finish_weight_update.*'ready'"):
        client.finish()
    client.start()
    with pytest.raises(IllegalTransitionError, match="no /update_weights"):
        client.finish()
    client.start()  # the empty update was dropped: a new one starts


def test_bad_requests_are_400_naming_the_field(start_server, manifests):
    client = VLLMHTTPClient(start_server())
    with pytest.raises(BlockedError, match="init_info.master_address: blocked") as e:
        client.init({"master_address": "10.0.0.1", "master_port": 29500})
    assert e.value.status == 400
    with pytest.raises(InvalidArgumentError, match="init_info.transport"):
        client.init({"transport": "carrier-pigeon"})
    client.init({"transport": "shared-memory"})
    with pytest.raises(InvalidArgumentError, match='mode: "sideways" is not one of'):
        client.pause("sideways")
    assert client.is_paused() is False

    client.start()
    with pytest.raises(InvalidArgumentError, match=r"update_info.names\[0\]: \"nope\"") as e:
        client.update({"names": ["nope"], "manifest": manifests[1]})
    assert e.value.status == 400 and isinstance(e.value, HTTPError)
    with pytest.raises(InvalidArgumentError, match="update_info.shapes"):
        client.update({"names": _names(manifests[1], 2), "shapes": [[1]],
                       "manifest": manifests[1]})
    client.update({"manifest": manifests[1]})
    client.finish()
    assert client.status()["active_weight_version"] == 2

    client.start()
    with pytest.raises(VersionNotMonotonicError, match="must increase monotonically") as e:
        client.update({"manifest": manifests[0]})
    assert e.value.status == 400
    client.update({"manifest": manifests[2]})
    with pytest.raises(InvalidArgumentError, match='weight_version: "99" differs'):
        client.finish(weight_version=99)
    assert client.finish(weight_version=3)["weight_version"] == 3


def test_failed_install_is_500_and_keeps_the_version(start_server, manifests):
    client = VLLMHTTPClient(start_server())
    client.init({})
    client.start()
    client.update({"manifest": manifests[0]})
    client.finish()
    bad = json.loads(manifests[1])
    bad["tensors"][0]["checksum"] = "0000000000000001"
    client.start()
    client.update({"manifest": bad})
    with pytest.raises(InstallFailedError, match="checksum mismatch") as e:
        client.finish()
    assert e.value.status == 500 and e.value.code == "install_failed"
    assert "POST /finish_weight_update: HTTP 500" in str(e.value)
    assert client.status()["active_weight_version"] == 1


def test_token_is_required_when_configured(start_server):
    base = start_server("--http-token", "s3cret")
    for client in (VLLMHTTPClient(base), VLLMHTTPClient(base, token="wrong")):
        with pytest.raises(HTTPError, match="bearer token") as e:
            client.is_paused()
        assert e.value.status == 401
        assert isinstance(e.value, InvalidArgumentError)
        assert not client.health()
    client = VLLMHTTPClient(base, token="s3cret")
    assert client.health()
    assert client.is_paused() is False
    assert client.pause() == {"status": "paused"}
    assert "s3cret" not in repr(client)
    # The scheme in any case (RFC 7235); the token exactly, not a prefix or a longer one.
    for header, status in (("bearer s3cret", 200), ("BEARER s3cret", 200), ("Bearer s3cre", 401),
                           ("Bearer s3cret2", 401), ("Basic s3cret", 401), ("s3cret", 401)):
        request = urllib.request.Request(base.rstrip("/") + "/is_paused",
                                         headers={"Authorization": header})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                got = answer.status
        except urllib.error.HTTPError as refused:
            got = refused.code
        assert got == status, header


def test_unreachable_server_is_an_io_error():
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = VLLMHTTPClient(f"http://127.0.0.1:{port}/", timeout=2)
    with pytest.raises(TransportIOError, match=f"GET /is_paused: cannot reach "
                                               f"http://127.0.0.1:{port}") as e:
        client.is_paused()
    assert e.value.code == "io_error" and not isinstance(e.value, HTTPError)
    assert client.health() is False


def test_arguments_are_checked_before_sending():
    with pytest.raises(InvalidArgumentError, match="base_url"):
        VLLMHTTPClient("127.0.0.1:8000")
    client = VLLMHTTPClient("http://127.0.0.1:9")
    with pytest.raises(InvalidArgumentError, match="init_info: must be a dict"):
        client.init([])
    with pytest.raises(InvalidArgumentError, match="update_info"):
        client.update(1)
    with pytest.raises(InvalidArgumentError, match="update_info"):
        client.update([])


def test_http_errors_are_also_their_code_class_and_pickle():
    from wsync._errors import error_for, http_error

    e = http_error(409, "illegal_transition", "POST /x: HTTP 409: out of order", "{}", "/x")
    assert isinstance(e, HTTPError) and isinstance(e, IllegalTransitionError)
    assert isinstance(e, WeightSyncError)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e)
    assert (back.status, back.code, back.message, back.body, back.path) == (
        409, "illegal_transition", "POST /x: HTTP 409: out of order", "{}", "/x")
    plain = error_for("checksum_mismatch", "tensor x")
    assert type(pickle.loads(pickle.dumps(plain))) is type(plain)
    odd = error_for("something_new", "why")
    assert type(odd) is WeightSyncError and odd.code == "something_new"


def test_vllm_trainer_engine_over_http_to_the_consumer(start_server):
    """wsync.vllm's trainer engine, with this client, drives the C++ consumer: the consumer's
    SHA-256 weight checker then matches the trainer's tensors byte for byte."""
    import torch

    from wsync.vllm import WsyncTrainerEngine

    def sha256(t):
        return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()

    client = VLLMHTTPClient(start_server())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 8))
    engine = WsyncTrainerEngine.trainer_init(None, {"rank": 0, "model_id": "mlp"},
                                             client=client, source=model)
    try:
        assert client.status()["phase"] == "ready"
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5).add_(0.25)
            assert engine.send_weights().weight_version == version
            assert client.status()["active_weight_version"] == version
            expected = {n: sha256(p) for n, p in model.named_parameters()}
            assert client.weight_checker("checksum")["checksums"] == expected
            compared = client.weight_checker("compare", baseline=expected)
            assert compared["match"] is True and compared["compared"] == len(expected)
        assert client.weight_info() == {"weight_version": "3"}
        assert client.update_weight_version("step-3")["weight_version"] == "step-3"
    finally:
        engine.shutdown()


def test_a_server_that_does_not_speak_http_is_an_io_error():
    """A port answering something else (SSH, a TLS port over http://): TransportIOError naming
    it, and health() says False instead of raising."""
    import threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def serve():
        for _ in range(2):
            conn, _ = srv.accept()
            conn.recv(4096)
            conn.sendall(b"SSH-2.0-not-http\r\n")
            conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    client = VLLMHTTPClient(f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(TransportIOError, match="GET /status: .*not a valid HTTP answer"):
        client.status()
    assert client.health() is False
    server.join(5)
    srv.close()
