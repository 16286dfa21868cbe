"""CUDA tensors through the Python API: published from the device into host and device
transports, imported as device views, installed into a module on the GPU; and a trainer process
training on the GPU that reaches two rollout processes on the same GPU through a coordinator;
wsync.vllm's engines with both models on the GPU.
wsync-test-requires: cuda (run.py skips the file where torch sees no CUDA device)."""

from types import SimpleNamespace

import pytest
import torch

import wsync
import test_vllm_engines as ve
from test_cluster import decoder_cluster_run
from wsync import vllm as wv


def cuda_state(seed: int, device: str = "cuda:0") -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g).to(device, torch.bfloat16),
        "layer.weight": torch.randn(64, 64, generator=g).to(device),
        "layer.bias": torch.randn(64, generator=g).to(device),
        "steps": torch.tensor([seed], dtype=torch.int64, device=device),
        "empty": torch.zeros(0, 4, device=device),
    }


def bridge_or_skip(name: str):
    """A bridge over `name`, or a skip naming why this build or machine cannot run it."""
    bridge = wsync.make_weight_bridge(name)
    try:
        probe = bridge.publish({"probe": torch.ones(1, device="cuda:0")}, weight_version=1)
    except wsync.BlockedError as e:
        pytest.skip(str(e))
    bridge.release(probe.update_id)
    return bridge


def test_cuda_tensors_publish_into_host_memory_and_back():
    pub = bridge_or_skip("shared-memory")
    con = wsync.SharedMemoryTensorBridge()
    state = cuda_state(1)
    # A non-contiguous CUDA tensor, made by a kernel on the current stream just before.
    state["layer.weight"] = state["layer.weight"].t()
    m = pub.publish(state, weight_version=2)
    got = con.import_update(m)
    assert [t.device.type for t in got.values()] == ["cpu"] * len(state)
    for name, t in state.items():
        assert torch.equal(got[name], t.cpu()), name
    del got
    con.release(m.update_id)
    pub.release(m.update_id)


@pytest.mark.parametrize("transport", ["cuda-ipc", "cuda-vmm"])
def test_device_transports_give_device_views(transport):
    pub = bridge_or_skip(transport)
    con = wsync.make_weight_bridge(transport)
    state = cuda_state(2)
    m = pub.publish(state, weight_version=2)
    got = con.import_update(m)  # verified on the GPU
    for name, t in state.items():
        assert got[name].device == torch.device("cuda:0"), name
        assert torch.equal(got[name], t), name
    # Views, not copies: two tensors of one segment are a fixed distance apart.
    a, b = got["layer.weight"], got["layer.bias"]
    assert b.data_ptr() != a.data_ptr()
    con.acknowledge(m.update_id)
    del got, a, b
    con.release(m.update_id)
    pub.release(m.update_id)


@pytest.mark.parametrize("transport", ["shared-memory", "cuda-ipc"])
def test_a_module_on_the_gpu_installs_each_version(transport):
    pub = bridge_or_skip(transport)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)).cuda()
    rollout = wsync.RolloutExecutor(wsync.make_weight_bridge(transport), model=model)
    for version in (2, 3):
        trainer = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)).cuda()
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(version)
        m = pub.publish(trainer, weight_version=version)
        rollout.update_weights(m)
        pub.release(m.update_id)  # the installer copied it
        for name, t in trainer.state_dict().items():
            live = model.state_dict()[name]
            assert live.device == t.device, name
            assert torch.equal(live, t), (version, name)
        # A forward pass on the installed weights runs on the GPU.
        assert model(torch.ones(1, 16, device="cuda:0")).shape == (1, 32)
    rollout.release_weights()


@pytest.mark.parametrize("transport", ["cuda-ipc", "cuda-vmm"])
def test_a_trainer_on_the_gpu_reaches_two_rollout_processes_on_the_same_gpu(
        coordinator, tmp_path, transport):
    """The colocated case end to end: the trainer's CUDA parameters go into the transport's
    device slots, each rollout process imports them as device views and installs them into its
    module on the GPU. The weights must arrive exactly; the logits within 1e-5 (two processes
    may pick different GPU kernels for the same product)."""
    bridge_or_skip(transport)  # skips with the reason where this transport cannot run
    decoder_cluster_run(coordinator, tmp_path, exact_logits=False, WSYNC_TEST_DEVICE="cuda:0",
                        WSYNC_TEST_TRANSPORT=transport)


@pytest.mark.parametrize("transport", ["cuda-ipc", "cuda-vmm", "shared-memory"])
def test_vllm_engines_carry_a_model_on_the_gpu(transport):
    """wsync.vllm's trainer engine sends a GPU model's parameters (vLLM's ModuleSource) and the
    worker engine, built for cuda:0 as vLLM builds it, loads them into a GPU model through
    load_weights: three versions, exact, nothing left held."""
    bridge_or_skip(transport)
    trainer_model, rollout_model = ve.TinyModel(seed=1).cuda(), ve.TinyModel(seed=2).cuda()
    worker = wv.WsyncWeightTransferEngine(SimpleNamespace(backend="wsync"),
                                          ve.stub_vllm_config(0), torch.device("cuda:0"),
                                          rollout_model)
    calls = []
    client = ve.InProcessClient(worker, ve.copy_loader(rollout_model, calls))
    engine = wv.WsyncTrainerEngine.trainer_init(
        SimpleNamespace(backend="wsync"), {"rank": 0, "transport": transport, "model_id": "tiny"},
        client=client, source=ve.ModuleSourceLike(trainer_model))
    try:
        for version in (1, 2, 3):
            ve.train_step(trainer_model, version)
            manifest = engine.send_weights()
            assert manifest.weight_version == version
            assert worker.weight_version == version
            ve.assert_same(rollout_model, trainer_model)
            assert rollout_model.proj.weight.device == torch.device("cuda:0")
    finally:
        engine.shutdown()
        worker.shutdown()
    assert wsync.releases_pending() == []
