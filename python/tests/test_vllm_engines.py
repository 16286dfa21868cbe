"""wsync.vllm's engines driven in vLLM's call order, over the real wsync bridge.

vLLM is not needed: the worker engine is built with stub configs shaped like vLLM's and the
trainer engine's client is an in-process object that forwards each call to the worker engine
the way vLLM's server and worker do (the update_info goes through JSON, as over HTTP). The
registration test uses a small stand-in ``vllm`` package with the two factories.
"""

import json
import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

try:
    import torch

    import wsync
    from wsync import vllm as wv
except Exception as e:  # the extension is not built (or torch is missing)
    pytest.skip(f"wsync is not importable ({e}); build the _wsync extension and put "
                "build/default/python on PYTHONPATH", allow_module_level=True)

from conftest import shm_entries
from wsync import (BlockedError, ChecksumMismatchError, IllegalTransitionError,
                   InstallFailedError, InvalidArgumentError, VersionNotMonotonicError)

TRANSPORT = "shared-memory"


class TinyModel(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 4, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


class LoadableModel(TinyModel):
    """A model with vLLM's ``load_weights(iterable of (name, tensor)) -> set of names``."""

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, w in weights:
                params[name].copy_(w)
                loaded.add(name)
        self.loaded_calls = getattr(self, "loaded_calls", 0) + 1
        return loaded


class ModuleSourceLike:
    """Shaped like vLLM's ModuleSource: metadata() and a fresh pass per iter()."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.passes = 0

    def metadata(self):
        return [(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]

    def __iter__(self):
        self.passes += 1
        for name, p in self.module.named_parameters():
            yield name, p


def stub_vllm_config(rank: int = 0):
    parallel = SimpleNamespace(rank=rank, world_size=1, tensor_parallel_size=1,
                               pipeline_parallel_size=1, data_parallel_size=1)
    return SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(model="tiny"))


def copy_loader(model, calls):
    """A load_weights that copies into the model's parameters by name and records the calls."""
    params = dict(model.named_parameters())

    def load_weights(weights):
        calls.append([name for name, _ in weights])
        with torch.no_grad():
            for name, w in weights:
                params[name].copy_(w)

    return load_weights


class InProcessClient:
    """vLLM's client protocol, forwarding to a worker engine as server + worker would:
    JSON on the way (HTTP), parse_*_info, then the engine call."""

    def __init__(self, worker, load_weights=None, newest=False) -> None:
        self.worker = worker
        self.load_weights = load_weights
        self.newest = newest  # vLLM >= 0.25: the worker calls engine.update_weights(dict)
        self.calls = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")
        info = json.loads(json.dumps(init_info))
        self.worker.init_transfer_engine(self.worker.parse_init_info(info))

    def start_weight_update(self):
        self.calls.append("start")
        self.worker.start_weight_update()

    def update_weights(self, update_info):
        self.calls.append("update")
        info = json.loads(json.dumps(update_info))
        if self.newest:
            self.worker.update_weights(info)
        else:
            self.worker.receive_weights(self.worker.parse_update_info(info), self.load_weights)

    def finish_weight_update(self):
        self.calls.append("finish")
        self.worker.finish_weight_update()


class UpdateOnlyClient:
    """The oldest vLLM: no start/finish phases; each update is whole."""

    def __init__(self, worker, load_weights) -> None:
        self.worker, self.load_weights = worker, load_weights

    def update_weights(self, update_info):
        info = self.worker.parse_update_info(json.loads(json.dumps(update_info)))
        self.worker.receive_weights(info, load_weights=self.load_weights)


def train_step(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device))


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def make_worker(model, rank: int = 0):
    return wv.WsyncWeightTransferEngine(SimpleNamespace(backend="wsync"), stub_vllm_config(rank),
                                        torch.device("cpu"), model)


def test_three_versions_reach_the_rollout_model():
    segments_before = shm_entries([os.getpid()])
    trainer_model, rollout_model = TinyModel(seed=1), TinyModel(seed=2)
    worker = make_worker(rollout_model)
    calls = []
    client = InProcessClient(worker, copy_loader(rollout_model, calls))
    source = ModuleSourceLike(trainer_model)
    engine = wv.WsyncTrainerEngine.trainer_init(
        SimpleNamespace(backend="wsync"), {"rank": 0, "transport": TRANSPORT, "model_id": "tiny"},
        client=client, source=source)
    assert client.calls == ["init"]
    assert worker.transport == TRANSPORT
    names = [n for n, _ in trainer_model.named_parameters()]
    try:
        for version in (1, 2, 3):
            train_step(trainer_model, version)
            assert not torch.equal(rollout_model.proj.weight, trainer_model.proj.weight)
            manifest = engine.send_weights()
            assert manifest.weight_version == version and manifest.model_id == "tiny"
            assert worker.weight_version == version and engine.weight_version == version
            assert_same(rollout_model, trainer_model)
            assert calls[-1] == names  # one call per chunk, in manifest order
        assert client.calls == ["init"] + ["start", "update", "finish"] * 3
        assert source.passes == 3
        assert len(engine._held) == 1  # only the version active on the worker stays published
    finally:
        engine.shutdown()
        worker.shutdown()
    # Both sides gave everything back: no release waits, no segment is left.
    assert wsync.releases_pending() == []
    assert shm_entries([os.getpid()]) == segments_before


def test_a_transport_alias_reaches_the_worker_by_its_registry_name():
    # Manifests name the registry's transport: a worker that kept the alias refused them all.
    trainer_model, rollout_model = TinyModel(seed=21), TinyModel(seed=22)
    worker = make_worker(rollout_model)
    client = InProcessClient(worker, copy_loader(rollout_model, []))
    engine = wv.WsyncTrainerEngine.trainer_init(
        SimpleNamespace(backend="wsync"), {"rank": 0, "transport": "shm"}, client=client,
        source=ModuleSourceLike(trainer_model))
    try:
        assert worker.transport == "shared-memory"
        worker.init_transfer_engine({"transport": "shm"})  # the alias again: the same transport
        assert engine.send_weights().weight_version == 1
        assert worker.weight_version == 1
        assert_same(rollout_model, trainer_model)
    finally:
        engine.shutdown()
        worker.shutdown()


def test_newest_vllm_path_loads_through_the_models_load_weights():
    trainer_model, rollout_model = TinyModel(seed=3), LoadableModel(seed=4)
    worker = make_worker(rollout_model)
    client = InProcessClient(worker, newest=True)
    engine = wv.WsyncTrainerEngine.trainer_init(
        None, wv.WsyncTrainerInitInfo(rank=0, transport=TRANSPORT, first_version=10),
        client=client, source=trainer_model)  # an nn.Module works as a source too
    try:
        for step in range(3):
            train_step(trainer_model, step)
            assert engine.send_weights().weight_version == 10 + step
            assert_same(rollout_model, trainer_model)
        assert rollout_model.loaded_calls == 3
    finally:
        engine.shutdown()
        worker.shutdown()


def test_oldest_vllm_path_each_update_is_whole():
    trainer_model, rollout_model = TinyModel(seed=5), TinyModel(seed=6)
    worker = make_worker(rollout_model)
    worker.init_transfer_engine(worker.parse_init_info({}))  # the oldest vLLM inits itself
    calls = []
    client = UpdateOnlyClient(worker, copy_loader(rollout_model, calls))
    engine = wv.WsyncTrainerEngine.trainer_init(None, {"rank": 0}, client=client,
                                                source=ModuleSourceLike(trainer_model))
    try:
        for step in (1, 2, 3):
            train_step(trainer_model, step)
            engine.send_weights()
            assert worker.weight_version == step
            assert_same(rollout_model, trainer_model)
        assert len(calls) == 3
    finally:
        engine.shutdown()
        worker.shutdown()


def publish(bridge, model, version):
    return bridge.publish(list(model.named_parameters()), version)


def test_chunks_and_refusals_name_the_field():
    trainer_model, rollout_model = TinyModel(seed=7), TinyModel(seed=8)
    trainer = wsync.make_weight_bridge(TRANSPORT, source_worker="trainer", model_id="tiny")
    worker = make_worker(rollout_model)
    calls = []
    load = copy_loader(rollout_model, calls)
    try:
        with pytest.raises(IllegalTransitionError, match="init_transfer_engine first"):
            worker.start_weight_update()
        with pytest.raises(BlockedError, match="init_info.master_address: blocked"):
            worker.parse_init_info({"master_address": "10.0.0.1", "master_port": 1})
        with pytest.raises(InvalidArgumentError, match="init_info.bogus"):
            worker.parse_init_info({"bogus": 1})
        worker.init_transfer_engine({"transport": TRANSPORT})
        worker.init_transfer_engine({"transport": TRANSPORT})  # the same again: nothing changes
        with pytest.raises(InvalidArgumentError, match="init_info.transport.*differs"):
            worker.init_transfer_engine({"transport": "local-clone"})
        with pytest.raises(IllegalTransitionError, match="no weight update is started"):
            worker.finish_weight_update()

        m1 = publish(trainer, trainer_model, 1)
        names = [t.name for t in m1.tensors]
        # Two chunks: the manifest with the first names, then the rest by name only (listed in
        # reverse: loading still follows the manifest's order).
        worker.start_weight_update()
        with pytest.raises(IllegalTransitionError, match="already started"):
            worker.start_weight_update()
        worker.receive_weights({"manifest": m1.to_json(), "names": names[:2],
                                "dtype_names": ["float32", "torch.float32"],
                                "shapes": [list(t.shape) for t in m1.tensors[:2]]}, load)
        assert worker.weight_version == 0
        worker.receive_weights({"names": names[2:][::-1]}, load)
        assert calls == [names[:2], names[2:]]
        worker.finish_weight_update()
        assert worker.weight_version == 1
        assert_same(rollout_model, trainer_model)
        # The shared-memory publisher has two slots: the trainer gives back what no one needs.
        trainer.release(m1.update_id)

        train_step(trainer_model, 2)
        m2 = publish(trainer, trainer_model, 2)
        refusals = [
            ({}, InvalidArgumentError, "update_info.manifest: missing"),
            ({"manifest": 7}, InvalidArgumentError, "update_info.manifest: must be"),
            ({"manifest": m2.to_json(), "names": ["nope"]}, InvalidArgumentError,
             r"update_info.names\[0\]: 'nope' is not in the manifest"),
            ({"manifest": m2.to_json(), "names": names[:1], "dtype_names": ["bfloat16"]},
             InvalidArgumentError, r"update_info.dtype_names\[0\]: bfloat16 differs"),
            ({"manifest": m2.to_json(), "names": names[:1], "shapes": [[1, 2]]},
             InvalidArgumentError, r"update_info.shapes\[0\]: differs"),
            ({"manifest": m2.to_json(), "names": names[:2], "shapes": [[1]]},
             InvalidArgumentError, "update_info.shapes: has 1 entries, names has 2"),
            ({"manifest": m1.to_json()}, VersionNotMonotonicError,
             "update_info.manifest.weight_version: weight_version must increase"),
            ({"manifest": m2.to_json(), "bogus": 1}, InvalidArgumentError, "update_info.bogus"),
        ]
        for info, error, text in refusals:
            with pytest.raises(error, match=text):
                worker.receive_weights(info, load)  # outside start: a whole update, refused
            assert worker.weight_version == 1
        assert_same(rollout_model, TinyModel(seed=7))  # nothing of version 2 got in

        # A checksum that does not match the bytes: refused before anything is loaded (the
        # update is rejected; the trainer publishes a new version).
        bad = json.loads(m2.to_json())
        bad["tensors"][0]["checksum"] = "0000000000000001"
        loaded_before = len(calls)
        with pytest.raises(ChecksumMismatchError):
            worker.receive_weights({"manifest": bad}, load)
        assert len(calls) == loaded_before and worker.weight_version == 1
        trainer.release(m2.update_id)

        # A started update whose chunk failed fails at finish, and the phase closes.
        m3 = publish(trainer, trainer_model, 3)
        worker.start_weight_update()
        with pytest.raises(InvalidArgumentError):
            worker.receive_weights({"manifest": m3.to_json(), "names": ["nope"]}, load)
        with pytest.raises(IllegalTransitionError, match="already failed"):
            worker.receive_weights({"manifest": m3.to_json()}, load)
        with pytest.raises(InstallFailedError, match="the update failed"):
            worker.finish_weight_update()

        # Tensors never loaded: refused at finish (the update is rejected), the version stays.
        worker.start_weight_update()
        worker.receive_weights({"manifest": m3.to_json(), "names": names[:1]}, load)
        with pytest.raises(InstallFailedError, match="never loaded"):
            worker.finish_weight_update()
        assert worker.weight_version == 1
        trainer.release(m3.update_id)

        # A new version still goes in whole afterwards.
        m4 = publish(trainer, trainer_model, 4)
        worker.start_weight_update()
        worker.receive_weights({"manifest": m4.to_json()}, load)
        worker.finish_weight_update()
        assert worker.weight_version == 4
        assert_same(rollout_model, trainer_model)
    finally:
        worker.shutdown()
        trainer.close()


def test_trainer_arguments_and_ranks():
    model = TinyModel(seed=9)
    with pytest.raises(InvalidArgumentError, match="init_info.rank: missing"):
        wv.WsyncTrainerEngine.trainer_init(None, {}, client=UpdateOnlyClient(None, None),
                                           source=model)
    with pytest.raises(InvalidArgumentError, match="client: must have update_weights"):
        wv.WsyncTrainerEngine.trainer_init(None, {"rank": 0}, client=object(), source=model)
    with pytest.raises(BlockedError, match="init_info.master_address"):
        wv.WsyncTrainerEngine.trainer_init(None, {"rank": 0, "master_address": "x"},
                                           client=UpdateOnlyClient(None, None), source=model)

    class Untouchable:
        def update_weights(self, info):
            raise AssertionError("a non-sender rank called the client")

    source = ModuleSourceLike(model)
    other = wv.WsyncTrainerEngine.trainer_init(None, {"rank": 1}, client=Untouchable(),
                                               source=source)
    assert not other.is_sender and other.bridge is None
    assert other.send_weights() is None and source.passes == 1  # iterated in step, no publish
    with pytest.raises(VersionNotMonotonicError):
        other.send_weights(weight_version=1)
    other.shutdown()


@contextmanager
def trainer_and_worker(seed: int, client_cls=None):
    """A trainer engine on rank 0 driving a worker engine through an in-process client, over
    two TinyModels seeded ``seed`` and ``seed + 1``; both engines shut down after the block."""
    trainer_model, rollout_model = TinyModel(seed=seed), TinyModel(seed=seed + 1)
    worker = make_worker(rollout_model)
    client = (client_cls or InProcessClient)(worker, copy_loader(rollout_model, []))
    engine = wv.WsyncTrainerEngine.trainer_init(None, {"rank": 0}, client=client,
                                                source=trainer_model)
    try:
        yield SimpleNamespace(trainer=trainer_model, rollout=rollout_model, worker=worker,
                              client=client, engine=engine)
    finally:
        engine.shutdown()
        worker.shutdown()


def test_failed_round_keeps_the_previous_version_held():
    with trainer_and_worker(11) as t:
        first = t.engine.send_weights()
        t.worker.start_weight_update()  # the worker is mid-update: the next start is refused
        with pytest.raises(IllegalTransitionError):
            t.engine.send_weights()
        assert t.engine.weight_version == 1
        assert [m.update_id for m in t.engine._held] == [first.update_id]
        with pytest.raises(IllegalTransitionError):
            t.worker.finish_weight_update()  # nothing came: refused, but the phase closes
        train_step(t.trainer, 1)
        assert t.engine.send_weights(weight_version=5).weight_version == 5
        assert_same(t.rollout, t.trainer)


class UnansweredFinishClient(InProcessClient):
    """The worker finishes, but its answer may never reach the trainer (the client timed out);
    ``status()`` says what the worker serves, as :class:`wsync.VLLMHTTPClient`'s does."""

    def __init__(self, worker, load_weights) -> None:
        super().__init__(worker, load_weights)
        self.lose_next_answer = False

    def finish_weight_update(self):
        super().finish_weight_update()
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise wsync.WeightSyncTimeoutError("POST /finish_weight_update: no answer within 1 s")

    def status(self):
        return {"active_weight_version": self.worker.weight_version, "phase": "ready"}


def test_a_round_without_an_answer_keeps_what_the_worker_may_serve():
    with trainer_and_worker(13, UnansweredFinishClient) as t:
        first = t.engine.send_weights()
        train_step(t.trainer, 1)
        t.client.lose_next_answer = True
        with pytest.raises(wsync.WeightSyncTimeoutError):
            t.engine.send_weights()
        # The worker took version 2 (a zero-copy consumer would serve it from the trainer's
        # memory), but the trainer cannot know: both versions stay published.
        assert t.worker.weight_version == 2 and t.engine.weight_version == 1
        held = t.engine.bridge._publisher.held()
        assert len(held) == 2 and first.update_id in held
        with pytest.raises(VersionNotMonotonicError, match="sent earlier without an answer"):
            t.engine.send_weights(weight_version=2)
        # The next round takes version 3. Both of the publisher's two slots are held: its start
        # comes first, the worker's status names version 2, and version 1 is let go for it.
        train_step(t.trainer, 2)
        third = t.engine.send_weights()
        assert third.weight_version == 3 and t.worker.weight_version == 3
        assert_same(t.rollout, t.trainer)
        assert [m.update_id for m in t.engine._held] == [third.update_id]
        assert t.engine.bridge._publisher.held() == [third.update_id]
        assert t.client.calls[-3:] == ["start", "update", "finish"]


class RefusingClient(InProcessClient):
    """The worker answers update_weights with a refusal while ``refuse`` is set."""

    refuse = False

    def update_weights(self, update_info):
        if not self.refuse:
            return super().update_weights(update_info)
        self.calls.append("update")
        raise InstallFailedError("update_weights: refused by the worker")


def test_a_refused_round_releases_the_new_version():
    with trainer_and_worker(15, RefusingClient) as t:
        first = t.engine.send_weights()
        t.client.refuse = True
        with pytest.raises(InstallFailedError):
            t.engine.send_weights()
        assert t.engine.bridge._publisher.held() == [first.update_id]
        with pytest.raises(IllegalTransitionError):
            t.worker.finish_weight_update()  # nothing came: refused, but the phase closes
        t.client.refuse = False
        assert t.engine.send_weights().weight_version == 2  # the refused number is free again
        assert_same(t.rollout, t.trainer)


@contextmanager
def two_trainer_ranks(seed: int):
    """A trainer model split over two publisher ranks, and an initialised worker with a model of
    its own: (trainer model, rollout model, its (name, parameter) pairs, the two bridges,
    worker). Everything is shut down and closed afterwards."""
    trainer_model, rollout_model = TinyModel(seed=seed), TinyModel(seed=seed + 1)
    pairs = list(trainer_model.named_parameters())
    halves = [wsync.make_weight_bridge(TRANSPORT, source_worker="trainer", source_rank=r,
                                       model_id="tiny") for r in (0, 1)]
    worker = make_worker(rollout_model)
    try:
        worker.init_transfer_engine({"transport": TRANSPORT})
        yield trainer_model, rollout_model, pairs, halves, worker
    finally:
        worker.shutdown()
        for bridge in halves:
            bridge.close()


def test_a_list_of_shards_outside_a_start_is_one_update():
    with two_trainer_ranks(17) as (trainer_model, rollout_model, pairs, halves, worker):
        shards = [halves[0].publish(pairs[:3], 1), halves[1].publish(pairs[3:], 1)]
        worker.update_weights([{"manifest": m.to_json()} for m in shards])
        assert worker.weight_version == 1
        assert_same(rollout_model, trainer_model)
        assert not worker._started
        # A shard that fails fails the whole list, and the version stays.
        train_step(trainer_model, 1)
        shards = [halves[0].publish(pairs[:3], 2), halves[1].publish(pairs[3:], 2)]
        bad = json.loads(shards[1].to_json())
        bad["tensors"][0]["checksum"] = "0000000000000001"
        with pytest.raises(ChecksumMismatchError):
            worker.update_weights([{"manifest": shards[0].to_json()}, {"manifest": bad}])
        assert worker.weight_version == 1 and not worker._started
        for bridge, m in zip(halves, shards):
            bridge.release(m.update_id)


def test_a_tensor_in_two_shards_is_refused_before_anything_loads():
    # One tensor in two shards: only one would load, and both would be acknowledged.
    with two_trainer_ranks(23) as (_, rollout_model, pairs, halves, worker):
        shards = [halves[0].publish(pairs[:3], 1), halves[1].publish(pairs[2:], 1)]
        with pytest.raises(InvalidArgumentError,
                           match=r"update_info.manifest\[1\].tensors\[0\].name: .* earlier "
                                 r"shard of this update too \(update_id=.* rank=0\)"):
            worker.update_weights({"manifest": [m.to_json() for m in shards]})
        assert worker.weight_version == 0
        assert_same(rollout_model, TinyModel(seed=24))
        for bridge, m in zip(halves, shards):
            bridge.release(m.update_id)


def test_kernel_format_refuses_another_dtype():
    trainer_model, rollout_model = TinyModel(seed=19).double(), TinyModel(seed=20)
    trainer = wsync.make_weight_bridge(TRANSPORT, source_worker="trainer", model_id="tiny")
    worker = make_worker(rollout_model)
    try:
        worker.init_transfer_engine({"transport": TRANSPORT})
        m = publish(trainer, trainer_model, 1)
        with pytest.raises(InvalidArgumentError,
                           match=f"update_id={m.update_id}.*dtype torch.float64 differs from "
                                 "the model's torch.float32"):
            worker.update_weights({"manifest": m.to_json()})
        assert worker.weight_version == 0
        assert_same(rollout_model, TinyModel(seed=20))
        trainer.release(m.update_id)
    finally:
        worker.shutdown()
        trainer.close()


STUB_FILES = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/weight_transfer/__init__.py": "",
    # Just enough of vLLM's shapes: abstract bases and two name -> class registries.
    "vllm/distributed/weight_transfer/base.py": """
        from abc import ABC, abstractmethod


        class WeightTransferEngine(ABC):
            @abstractmethod
            def init_transfer_engine(self, init_info): ...

            @abstractmethod
            def start_weight_update(self): ...

            @abstractmethod
            def finish_weight_update(self): ...

            @abstractmethod
            def receive_weights(self, update_info): ...

            @abstractmethod
            def shutdown(self): ...

            @staticmethod
            @abstractmethod
            def trainer_send_weights(iterator, trainer_args): ...


        class TrainerWeightTransferEngine(ABC):
            @classmethod
            @abstractmethod
            def trainer_init(cls, config, init_info, *, client, source): ...

            @abstractmethod
            def send_weights(self): ...
        """,
    "vllm/distributed/weight_transfer/factory.py": """
        class _Registry:
            _registry = None

            @classmethod
            def register_engine(cls, name, engine_cls, class_name=None):
                if name in cls._registry:
                    raise ValueError(f"{name} is already registered")
                cls._registry[name] = lambda: engine_cls


        class WeightTransferEngineFactory(_Registry):
            _registry = {}

            @classmethod
            def create_engine(cls, config, vllm_config, device, model):
                return cls._registry[config.backend]()(config, vllm_config, device, model)


        class WeightTransferTrainerFactory(_Registry):
            _registry = {}

            @classmethod
            def trainer_init(cls, backend, config, init_info, *, client, source):
                engine_cls = cls._registry[backend]()
                return engine_cls.trainer_init(config=config, init_info=init_info,
                                               client=client, source=source)
        """,
}


@pytest.fixture
def stub_vllm(tmp_path, monkeypatch):
    for rel, text in STUB_FILES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def test_register_with_vllms_factories(stub_vllm):
    from vllm.distributed.weight_transfer import base, factory

    classes = wv.register()
    assert wv.register().keys() == classes.keys()  # a second call changes nothing
    assert set(factory.WeightTransferEngineFactory._registry) == {"wsync"}
    assert set(factory.WeightTransferTrainerFactory._registry) == {"wsync"}

    trainer_model, rollout_model = TinyModel(seed=13), TinyModel(seed=14)
    worker = factory.WeightTransferEngineFactory.create_engine(
        SimpleNamespace(backend="wsync"), stub_vllm_config(), torch.device("cpu"), rollout_model)
    assert isinstance(worker, base.WeightTransferEngine)
    assert isinstance(worker, wv.WsyncWeightTransferEngine)
    engine = factory.WeightTransferTrainerFactory.trainer_init(
        "wsync", SimpleNamespace(backend="wsync"), {"rank": 0},
        client=InProcessClient(worker, newest=True), source=ModuleSourceLike(trainer_model))
    assert isinstance(engine, base.TrainerWeightTransferEngine)
    try:
        engine.send_weights()
        assert_same(rollout_model, trainer_model)
    finally:
        engine.shutdown()
        worker.shutdown()


def test_importing_registers_when_vllm_is_there(stub_vllm):
    code = ("import wsync.vllm\n"
            "from vllm.distributed.weight_transfer import factory\n"
            "assert 'wsync' in factory.WeightTransferEngineFactory._registry\n"
            "assert 'wsync' in factory.WeightTransferTrainerFactory._registry\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub_vllm)] + sys.path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
