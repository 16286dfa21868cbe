"""The bridge API: RL-Kernel's documented examples with only the import changed, zero-copy
views and their lifetime, dtypes, errors with the C++ texts, manifests as JSON and pickles."""

import gc
import json
import os
import pickle
import re
import threading
import time

import pytest
import torch

import wsync
from conftest import shm_entries


def test_rl_kernel_manual_example_runs_verbatim():
    # The RL-Kernel documentation's example, with only the import changed.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    publisher = wsync.SharedMemoryTensorBridge(source_worker="trainer", source_rank=0)
    consumer = wsync.SharedMemoryTensorBridge(source_worker="rollout", source_rank=0)
    manifest = publisher.publish(model, weight_version=1,
                                 metadata={"step": 1, "layout": {"kind": "full-state"}})
    try:
        tensors = consumer.import_update(manifest)
        consumer.acknowledge(manifest.update_id)
    finally:
        consumer.release(manifest.update_id)
        publisher.release(manifest.update_id)

    assert set(tensors) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(tensors[name], t)
    assert manifest.metadata["step"] == "1"
    assert json.loads(manifest.metadata["layout"]) == {"kind": "full-state"}
    assert manifest.source_worker == "trainer"


def test_rl_kernel_executor_examples_run_verbatim():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    publisher = wsync.SharedMemoryTensorBridge(source_worker="trainer", source_rank=0)
    manifest = publisher.publish(model, weight_version=1)
    rollout = wsync.RolloutExecutor(weight_bridge=wsync.make_weight_bridge(
        "shared-memory", source_worker="rollout", source_rank=0))
    imported = rollout.update_weights(manifest)
    assert rollout.active_weight_version == 1 and set(imported) == set(model.state_dict())
    rollout.release_weights()
    publisher.release(manifest.update_id)

    # The second documented form: a Linear at version 7.
    model = torch.nn.Linear(4, 4)
    publisher = wsync.SharedMemoryTensorBridge(source_worker="trainer", source_rank=0)
    manifest = publisher.publish(model, weight_version=7)
    rollout_bridge = wsync.SharedMemoryTensorBridge(source_worker="rollout", source_rank=0)
    rollout = wsync.RolloutExecutor(weight_bridge=rollout_bridge)
    try:
        imported = rollout.update_weights(manifest)
        assert rollout.active_weight_version == 7
        assert set(imported) == set(model.state_dict())
    finally:
        rollout.release_weights()
        publisher.release(manifest.update_id)


def _segment_of(address):
    """The /proc/self/maps line whose range holds `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.strip()
    return ""


def test_import_is_zero_copy_inside_the_shared_memory_mapping():
    state = {"a": torch.randn(64, 64), "b": torch.arange(1000, dtype=torch.int64)}
    pub = wsync.SharedMemoryTensorBridge()
    con = wsync.SharedMemoryTensorBridge()
    m = pub.publish(state, weight_version=1)
    views = con.import_update(m)
    for info in m.tensors:
        v = views[info.name]
        line = _segment_of(v.data_ptr())
        assert "/dev/shm/wsync-" in line, line
        assert v.storage().data_ptr() + info.offset == v.data_ptr()
        assert torch.equal(v, state[info.name])
    # A second import of the same bytes is not a copy either: same address.
    con.release(m.update_id)
    del views
    gc.collect()
    pub.release(m.update_id)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_every_dtype_round_trips(dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5, 7, generator=g) * 50
    t = (base > 0) if dtype is torch.bool else base.to(dtype)
    pub = wsync.make_weight_bridge("shared-memory")
    con = wsync.make_weight_bridge("shared-memory")
    m = pub.publish([("t", t), ("scalar", torch.tensor(3, dtype=t.dtype))], weight_version=1)
    out = con.import_update(m)
    assert out["t"].dtype == dtype and torch.equal(out["t"], t)
    assert out["scalar"].shape == () and torch.equal(out["scalar"], torch.tensor(3, dtype=dtype))
    del out
    con.release(m.update_id)
    pub.release(m.update_id)


def test_non_contiguous_inputs_are_published_by_value():
    w = torch.randn(8, 6)
    pairs = [("transposed", w.t()), ("strided", w[:, ::2]), ("expanded", torch.ones(1).expand(5))]
    pub, con = wsync.LocalCloneTensorBridge(), wsync.LocalCloneTensorBridge()
    m = pub.publish(pairs, weight_version=3)
    out = con.import_update(m)
    for name, t in pairs:
        assert out[name].is_contiguous() and torch.equal(out[name], t), name
    del out
    con.release(m.update_id)
    pub.release(m.update_id)


def test_views_keep_their_update_until_the_last_one_goes():
    before = shm_entries([os.getpid()])
    pub = wsync.SharedMemoryTensorBridge()
    con = wsync.SharedMemoryTensorBridge()
    m1 = pub.publish({"w": torch.full((256,), 1.0)}, weight_version=1)
    views = con.import_update(m1)
    kept = views["w"]
    con.release(m1.update_id)
    pub.release(m1.update_id)
    assert m1.update_id in wsync.releases_pending()
    # The publisher's next version cannot take the memory the view still reads.
    m2 = pub.publish({"w": torch.full((256,), 2.0)}, weight_version=2)
    assert torch.equal(kept, torch.full((256,), 1.0))
    del views, kept
    gc.collect()
    assert m1.update_id not in wsync.releases_pending()
    pub.release(m2.update_id)
    del pub, con  # the publisher's pool of segments goes with it
    gc.collect()
    assert shm_entries([os.getpid()]) - before == set()


def test_errors_carry_the_core_texts():
    pub, con = wsync.SharedMemoryTensorBridge(), wsync.SharedMemoryTensorBridge()
    m = pub.publish({"w": torch.ones(4)}, weight_version=5)
    with pytest.raises(wsync.VersionNotMonotonicError,
                       match="weight_version must increase monotonically"):
        pub.publish({"w": torch.ones(4)}, weight_version=5)
    with pytest.raises(wsync.IllegalTransitionError,
                       match="cannot acknowledge update before import_update succeeds"):
        con.acknowledge(m.update_id)
    # A manifest whose checksum disagrees with the bytes.
    doc = json.loads(m.to_json())
    doc["tensors"][0]["checksum"] = "0123456789abcdef"
    doc["update_id"] = m.update_id
    bad = wsync.Manifest.from_json(json.dumps(doc))
    with pytest.raises(wsync.ChecksumMismatchError, match="tensor checksum mismatch"):
        con.import_update(bad)
    assert isinstance(wsync.ChecksumMismatchError("x"), wsync.WeightSyncError)
    with pytest.raises(wsync.UnknownTransportError, match="no-such"):
        wsync.make_weight_bridge("no-such")
    with pytest.raises(wsync.InvalidArgumentError, match="tensor c: field dtype"):
        pub.publish({"c": torch.ones(2, dtype=torch.complex64)}, weight_version=6)
    with pytest.raises(wsync.InvalidArgumentError,
                       match="tensor s: field layout: torch.sparse_coo"):
        pub.publish({"s": torch.eye(2).to_sparse()}, weight_version=6)
    with pytest.raises(wsync.InvalidManifestError):
        wsync.Manifest.from_json('{"update_id": 3}')
    pub.release(m.update_id)


def test_reject_then_release():
    pub, con = wsync.SharedMemoryTensorBridge(), wsync.SharedMemoryTensorBridge()
    m = pub.publish({"w": torch.ones(4)}, weight_version=1)
    views = con.import_update(m)
    con.reject(m.update_id, "does not fit the runtime")
    assert con.state(m.update_id) == "rejected"
    with pytest.raises(wsync.IllegalTransitionError, match="after reject"):
        con.acknowledge(m.update_id)
    del views
    con.release(m.update_id)
    pub.release(m.update_id)


def test_manifest_json_and_pickle_round_trip():
    pub = wsync.SharedMemoryTensorBridge(model_id="m")
    m = pub.publish({"w": torch.ones(4, 2), "b": torch.zeros(3)}, weight_version=2,
                    metadata={"step": "2"})
    back = wsync.Manifest.from_json(m.to_json())
    assert back == m
    assert pickle.loads(pickle.dumps(m)) == m
    assert [t.name for t in back.tensors] == ["w", "b"] and back.tensors[0].shape == [4, 2]
    assert back.model_id == "m" and back.weight_version == 2 and back.metadata == {"step": "2"}
    pub.release(m.update_id)


class InterruptedOnReturn:
    """A publisher half whose publish completes, then meets Ctrl-C: a SIGINT during the C++
    call is raised as it returns, before the caller has the manifest."""

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def publish(self, *args):
        self.real.publish(*args)
        raise KeyboardInterrupt


def test_a_publish_interrupted_as_it_returns_is_given_back():
    pub = wsync.SharedMemoryTensorBridge()
    try:
        kept = pub.publish({"w": torch.ones(4)}, weight_version=1)
        pub._publisher = InterruptedOnReturn(pub._publisher_half())
        with pytest.raises(KeyboardInterrupt):
            pub.publish({"w": torch.full((4,), 2.0)}, weight_version=2)
        assert pub._publisher.held() == [kept.update_id]  # what came before stays
        pub._publisher = pub._publisher.real
        # The slot is free again: two more publishes fit the two-slot ring with version 1.
        m2 = pub.publish({"w": torch.full((4,), 2.0)}, weight_version=2)
        pub.release(m2.update_id)
    finally:
        pub.close()


def test_two_threads_publishing_first_share_one_publisher(monkeypatch):
    # Made twice, one half replaced the other, and the replaced publisher released what its
    # caller had just published (under a manifest the caller already had).
    from wsync import _bridge
    real = _bridge._wsync.Publisher

    def slow_publisher(*args):
        time.sleep(0.2)  # both threads find no half yet
        return real(*args)

    monkeypatch.setattr(_bridge._wsync, "Publisher", slow_publisher)
    pub = wsync.LocalCloneTensorBridge()
    out, errors = [], []

    def publish(version):
        try:
            out.append(pub.publish({"w": torch.full((4,), float(version))}, version))
        except wsync.WeightSyncError as e:  # version 1 after version 2: refused, fine
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(out) + len(errors) == 2 and out
        assert sorted(pub._publisher.held()) == sorted(m.update_id for m in out)
        sub = wsync.LocalCloneTensorBridge()
        for m in out:
            assert sub.import_update(m)["w"].tolist() == [float(m.weight_version)] * 4
            sub.release(m.update_id)
    finally:
        pub.close()


def test_a_rejected_version_is_published_again():
    pub, con = wsync.SharedMemoryTensorBridge(), wsync.SharedMemoryTensorBridge()
    m2 = pub.publish({"w": torch.full((4,), 2.0)}, weight_version=2)
    con.import_update(m2)
    con.acknowledge(m2.update_id)
    m3 = pub.publish({"w": torch.full((4,), 3.0)}, weight_version=3)
    con.import_update(m3)
    con.reject(m3.update_id, "install failed")
    con.release(m3.update_id)
    with pytest.raises(wsync.VersionNotMonotonicError, match="is still held"):
        pub.publish({"w": torch.full((4,), 3.5)}, weight_version=3)
    pub.release(m3.update_id)
    retry = pub.publish({"w": torch.full((4,), 3.5)}, weight_version=3)
    assert retry.update_id != m3.update_id
    views = con.import_update(retry)
    assert torch.equal(views["w"], torch.full((4,), 3.5))
    con.acknowledge(retry.update_id)
    con.release(m2.update_id)
    with pytest.raises(wsync.VersionNotMonotonicError, match="is not above the active 3"):
        con.import_update(m2)  # an old version, sent again
    con.release(retry.update_id)
    for m in (m2, retry):
        pub.release(m.update_id)


def test_chunked_checksums_are_published_and_verified():
    pub = wsync.SharedMemoryTensorBridge(checksum_chunk_bytes=4096)
    con = wsync.SharedMemoryTensorBridge(verify_threads=2)
    big = torch.arange(50_000, dtype=torch.float32)  # 49 chunks of 4 KiB
    m = pub.publish({"big": big, "small": torch.ones(3)}, weight_version=1)
    doc = json.loads(m.to_json())
    assert doc["checksum"] == {"algorithm": "xxh3-64-chunked", "chunk_bytes": 4096}
    views = con.import_update(m)  # verifies every chunk
    assert torch.equal(views["big"], big)
    del views
    con.release(m.update_id)
    # The same bytes under a whole-tensor digest: the consumer hashes by the manifest's method.
    doc["tensors"][0]["checksum"] = wsync.Manifest.from_json(
        wsync.LocalCloneTensorBridge().publish({"big": big}, weight_version=1).to_json()
    ).tensors[0].checksum.to_bytes(8, "big").hex()
    with pytest.raises(wsync.ChecksumMismatchError, match='"big"'):
        con.import_update(wsync.Manifest.from_json(json.dumps(doc)))
    pub.release(m.update_id)
    with pytest.raises(wsync.InvalidManifestError, match="checksum.chunk_bytes: 5000"):
        wsync.SharedMemoryTensorBridge(checksum_chunk_bytes=5000).publish(
            {"w": torch.ones(4)}, weight_version=1)


def test_gpu_transports_say_why_they_cannot_run():
    gpu_here = wsync._wsync.gpu_ready() == ""
    for name in ("cuda-ipc", "cuda-vmm", "nccl"):
        assert name in wsync.transports()
        if gpu_here and name != "nccl":
            continue  # cuda-ipc/vmm run here (test_cuda.py)
        bridge = wsync.make_weight_bridge(name)
        if gpu_here:
            # nccl runs where libnccl loads: the publish goes out to a group that nobody joins
            # here, and dropping the bridge ends that broadcast (its publisher closes the
            # transport as it goes; seen on an H200: "cancelled: the transport is closing").
            try:
                m = bridge.publish({"w": torch.ones(2)}, weight_version=1)
                assert m.transport == "nccl" and m.weight_version == 1
            except wsync.BlockedError as e:
                assert re.match(r"^blocked: .*nccl", str(e)), str(e)
            del bridge
            continue
        with pytest.raises(wsync.BlockedError, match=f"^blocked: .*{name}"):
            bridge.publish({"w": torch.ones(2)}, weight_version=1)
    with pytest.raises(wsync.InvalidArgumentError,
                       match="tensor w: field device: meta: wsync publishes CPU and CUDA tensors"):
        wsync.SharedMemoryTensorBridge().publish({"w": torch.empty(2, device="meta")},
                                                 weight_version=1)


def test_cuda_tensor_tuples_reach_the_core():
    """A CUDA tensor travels as (name, dtype, shape, address, nbytes, device, stream); where
    the core cannot copy from a device, it says why."""
    half = wsync.SharedMemoryTensorBridge()._publisher_half()
    host = torch.ones(4)
    if not torch.cuda.is_available():
        with pytest.raises(wsync.BlockedError,
                           match="publish failed: blocked: (no CUDA device|built without CUDA)"):
            half.publish([("w", "f32", [4], host.data_ptr(), 16, 0, 0)], 1, [], {})
    with pytest.raises(wsync.InvalidArgumentError, match="tensor w: field cuda_device: -2"):
        half.publish([("w", "f32", [4], host.data_ptr(), 16, -2, 0)], 1, [], {})
    with pytest.raises(wsync.InvalidArgumentError, match="must have 5 or 7 fields"):
        half.publish([("w", "f32", [4], host.data_ptr(), 16, 0)], 1, [], {})
