"""Installing into a torch module: whole versions only, the first mismatch named with the
previous version kept, and readers paused only for the switch."""

import threading
import time

import pytest
import torch

import wsync
from wsync._install import ViewInstaller


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8),
                               torch.nn.LayerNorm(8))


def test_install_into_module_then_keep_previous_on_each_mismatch():
    trainer = small_model(1)
    rollout_model = small_model(2)
    pub = wsync.SharedMemoryTensorBridge(source_worker="trainer")
    rollout = wsync.RolloutExecutor(wsync.SharedMemoryTensorBridge(), model=rollout_model)
    m1 = pub.publish(trainer, weight_version=1)
    installed = rollout.update_weights(m1)
    assert set(installed) == set(trainer.state_dict())
    for name, t in trainer.state_dict().items():
        assert torch.equal(rollout_model.state_dict()[name], t)
    pub.release(m1.update_id)

    good = {k: v.clone() for k, v in rollout_model.state_dict().items()}
    state = {k: v + 1 for k, v in trainer.state_dict().items()}
    cases = [
        ({**state, "0.weight": torch.ones(3, 3)}, "tensor 0.weight: field shape"),
        ({**state, "0.bias": state["0.bias"].double()}, "tensor 0.bias: field dtype"),
        ({k: v for k, v in state.items() if k != "3.weight"}, "tensor 3.weight: missing"),
        ({**state, "extra": torch.ones(1)}, "tensor extra: not in the model"),
    ]
    for version, (bad, text) in enumerate(cases, start=2):
        m = pub.publish(bad, weight_version=version)
        with pytest.raises(wsync.InstallFailedError, match=text):
            rollout.update_weights(m)
        assert rollout.active_weight_version == 1
        for k, v in rollout_model.state_dict().items():
            assert torch.equal(v, good[k]), (text, k)
        pub.release(m.update_id)
    rollout.release_weights()


class Tied(torch.nn.Module):
    """An embedding and an output head that share one weight, as many language models do."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def test_tied_names_must_carry_the_same_bytes():
    pub = wsync.SharedMemoryTensorBridge()
    rollout_model = Tied(tie=True)
    rollout = wsync.RolloutExecutor(wsync.SharedMemoryTensorBridge(), model=rollout_model)
    before = rollout_model.embed.weight.detach().clone()
    untied = Tied(tie=False)  # a trainer that does not tie them: two different tensors
    m1 = pub.publish(untied, weight_version=1)
    with pytest.raises(wsync.InstallFailedError,
                       match="tensor head.weight: field checksum: the model ties it to "
                             f"embed.weight.*update_id={m1.update_id}"):
        rollout.update_weights(m1)
    assert torch.equal(rollout_model.embed.weight, before)
    pub.release(m1.update_id)
    with torch.no_grad():
        untied.head.weight.copy_(untied.embed.weight)  # the same bytes under both: installed
    m2 = pub.publish(untied, weight_version=2)
    rollout.update_weights(m2)
    assert torch.equal(rollout_model.head.weight, untied.embed.weight)
    assert rollout_model.head.weight is rollout_model.embed.weight
    rollout.release_weights()
    pub.release(m2.update_id)
    pub.close()


def test_readers_only_ever_see_whole_versions():
    trainer = small_model(3)
    rollout_model = small_model(4)
    batch = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    versions = 12
    states, refs = [], []
    with torch.no_grad():
        for v in range(versions):
            for p in trainer.parameters():
                p.add_(0.01 * (v + 1))
            states.append({k: t.clone() for k, t in trainer.state_dict().items()})
            refs.append(trainer(batch))
    pub = wsync.SharedMemoryTensorBridge()
    rollout = wsync.RolloutExecutor(wsync.SharedMemoryTensorBridge(), model=rollout_model)
    m = pub.publish(states[0], weight_version=1)
    rollout.update_weights(m)
    pub.release(m.update_id)

    seen, torn = [], []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            with torch.no_grad(), rollout.generating():
                # Reading the version inside the gate must neither block an install nor
                # disagree with the weights the step reads.
                version = rollout.active_weight_version
                out = rollout_model(batch)
            match = [i for i, r in enumerate(refs) if torch.equal(out, r)]
            ok = len(match) == 1 and match[0] == version - 1
            (seen if ok else torn).append(match)

    t = threading.Thread(target=reader)
    t.start()
    for v in range(1, versions):
        m = pub.publish(states[v], weight_version=v + 1)
        rollout.update_weights(m)
        pub.release(m.update_id)
        done = len(seen) + len(torn)
        while len(seen) + len(torn) < done + 2 and t.is_alive():  # let the reader see it
            time.sleep(0.001)
    stop.set()
    t.join()
    rollout.release_weights()
    assert not torn, f"{len(torn)} forward passes saw a mix of versions"
    assert {s[0] for s in seen} >= set(range(1, versions)), "the reader missed a version"
    assert rollout.longest_wait() < 1.0


def test_layouts_empty_tensors_and_devices_the_installer_must_handle():
    class Odd(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.conv = torch.nn.Conv2d(3, 8, 3)
            self.empty = torch.nn.Parameter(torch.zeros(0, 4))
            self.t = torch.nn.Parameter(torch.randn(6, 5).t())  # a transposed (strided) tensor

    trainer, rollout_model = Odd(1), Odd(2).to(memory_format=torch.channels_last)
    pub = wsync.SharedMemoryTensorBridge()
    rollout = wsync.RolloutExecutor(wsync.SharedMemoryTensorBridge(), model=rollout_model)
    for v in (1, 2):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
        m = pub.publish(trainer, weight_version=v)
        rollout.update_weights(m)
        pub.release(m.update_id)
        for name, t in trainer.state_dict().items():
            assert torch.equal(rollout_model.state_dict()[name], t), (v, name)
    rollout.release_weights()
    with pytest.raises(wsync.InvalidArgumentError, match="field device: meta"):
        wsync.RolloutExecutor(wsync.SharedMemoryTensorBridge(),
                              model=torch.nn.Linear(2, 2, device="meta"))


def test_ctrl_c_while_staging_rejects_the_update_and_reaches_the_caller():
    import _thread

    trainer, rollout_model = small_model(5), small_model(6)
    pub = wsync.SharedMemoryTensorBridge()
    rollout = wsync.RolloutExecutor(wsync.SharedMemoryTensorBridge(), model=rollout_model)
    m = pub.publish(trainer, weight_version=1)
    rollout.update_weights(m)
    pub.release(m.update_id)
    before = {k: v.clone() for k, v in rollout_model.state_dict().items()}

    stage = rollout.installer.stage

    def interrupted_stage(update_id, shards):
        _thread.interrupt_main()  # as if Ctrl-C came now
        return stage(update_id, shards)

    rollout.installer.stage = interrupted_stage
    m = pub.publish({k: v + 1 for k, v in trainer.state_dict().items()}, weight_version=2)
    with pytest.raises(KeyboardInterrupt):
        rollout.update_weights(m)
    rollout.installer.stage = stage
    assert rollout.active_weight_version == 1
    for k, v in rollout_model.state_dict().items():
        assert torch.equal(v, before[k])
    assert not rollout.installer._staged
    pub.release(m.update_id)
    m = pub.publish({k: v + 2 for k, v in trainer.state_dict().items()}, weight_version=3)
    rollout.update_weights(m)
    assert rollout.active_weight_version == 3
    pub.release(m.update_id)
    rollout.release_weights()


def test_ctrl_c_as_a_failed_install_discards_still_discards_and_reaches_the_caller():
    """A Ctrl-C pending as the installer's discard starts stops it before it lets go: the
    discard runs again (the staged copy does not stay), and the interrupt reaches the caller."""
    trainer, rollout_model = small_model(5), small_model(6)
    pub = wsync.SharedMemoryTensorBridge()
    rollout = wsync.RolloutExecutor(wsync.SharedMemoryTensorBridge(), model=rollout_model)
    installer = rollout.installer
    stage, discard = installer.stage, installer.discard
    calls = []

    def failing_stage(update_id, shards):
        stage(update_id, shards)  # staged: a copy of the model is held for this update
        raise wsync.WeightSyncError("install failed: injected")

    def interrupted_discard(update_id):
        calls.append(update_id)
        if len(calls) == 1:
            raise KeyboardInterrupt  # as if Ctrl-C fired at the discard's first line
        discard(update_id)

    installer.stage, installer.discard = failing_stage, interrupted_discard
    m = pub.publish(trainer, weight_version=1)
    with pytest.raises(KeyboardInterrupt):
        rollout.update_weights(m)
    installer.stage, installer.discard = stage, discard
    assert len(calls) == 2, calls
    assert not installer._staged
    assert rollout.active_weight_version is None
    pub.release(m.update_id)
    m = pub.publish(trainer, weight_version=2)
    rollout.update_weights(m)
    assert rollout.active_weight_version == 2
    pub.release(m.update_id)
    rollout.release_weights()


def test_ctrl_c_while_a_view_install_waits_for_readers_switches_whole_then_reaches_the_caller():
    """Zero-copy installs switch in the extension: a Ctrl-C that came while the switch waited
    for a generation step cannot leave the update acknowledged with the old views active."""
    import os
    import signal
    import threading
    import time

    pub = wsync.LocalCloneTensorBridge(source_worker="t")
    rollout = wsync.RolloutExecutor(wsync.LocalCloneTensorBridge(source_worker="r"))
    m1 = pub.publish({"w": torch.full((4,), 1.0)}, 1)
    rollout.update_weights(m1)
    inside = threading.Event()

    def reader():
        with rollout.generating():
            inside.set()
            time.sleep(1.0)  # one long generation step: the switch waits for it

    t = threading.Thread(target=reader)
    t.start()
    inside.wait()
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    m2 = pub.publish({"w": torch.full((4,), 2.0)}, 2)
    interrupted = False
    try:
        rollout.update_weights(m2)
        time.sleep(1.5)  # a Ctrl-C still pending fires here, in Python
    except KeyboardInterrupt:
        interrupted = True
    t.join()
    assert interrupted
    assert rollout.active_weight_version == 2
    assert rollout.installer.active["w"].tolist() == [2.0] * 4
    assert not rollout.installer._staged
    rollout.release_weights()
    for m in (m1, m2):
        pub.release(m.update_id)


def test_an_update_released_while_its_views_live_cannot_be_imported_again():
    pub = wsync.LocalCloneTensorBridge(source_worker="t")
    sub = wsync.LocalCloneTensorBridge(source_worker="r")
    m = pub.publish({"w": torch.full((4,), 7.0)}, 1)
    views = sub.import_update(m)
    sub.release(m.update_id)  # deferred: `views` still reads the import
    with pytest.raises(wsync.IllegalTransitionError, match="drop them first"):
        sub.import_update(m)
    junk = [torch.full((4,), 9.0) for _ in range(64)]  # the heap reused, were it freed
    assert views["w"].tolist() == [7.0] * 4
    del views, junk
    again = sub.import_update(m)  # the release ran with the last view
    assert again["w"].tolist() == [7.0] * 4
    del again
    sub.release(m.update_id)
    pub.release(m.update_id)


def test_release_weights_without_a_model_shows_no_weights_then_installs_again():
    pub = wsync.SharedMemoryTensorBridge(source_worker="t")
    rollout = wsync.RolloutExecutor(wsync.SharedMemoryTensorBridge())  # the views are active
    m1 = pub.publish({"w": torch.arange(8.0)}, weight_version=1)
    rollout.update_weights(m1)
    assert rollout.active_weight_version == 1
    assert rollout.release_weights() == [m1.update_id]
    # Readers see no version with no weights: not version 1 over released memory.
    assert rollout.active_weight_version is None
    assert rollout.installer.active == {}
    m2 = pub.publish({"w": torch.ones(8)}, weight_version=2)
    assert rollout.update_weights(m2)["w"].tolist() == [1.0] * 8
    assert rollout.active_weight_version == 2
    rollout.release_weights()
    for m in (m1, m2):
        pub.release(m.update_id)


def test_release_weights_with_a_model_keeps_its_copy_and_version():
    pub = wsync.LocalCloneTensorBridge(source_worker="t")
    model = small_model(2)
    rollout = wsync.RolloutExecutor(wsync.LocalCloneTensorBridge(), model=model)
    m = pub.publish(small_model(1), weight_version=1)
    rollout.update_weights(m)
    rollout.release_weights()
    assert rollout.active_weight_version == 1  # the module's own copy stays readable
    assert torch.equal(model.state_dict()["0.weight"], small_model(1).state_dict()["0.weight"])
    pub.release(m.update_id)


class ForgettingViews:
    """A custom installer whose weights are the imported views, and which lets go of them
    itself (or says it does not)."""

    references_import = True

    def __init__(self, forgets: bool) -> None:
        self.forgets = forgets
        self.active = {}
        self._views = ViewInstaller()

    def stage(self, update_id, shards):
        self._views.stage(update_id, shards)

    def activate(self, update_id):
        self._views.activate(update_id)
        self.active = self._views.active

    def discard(self, update_id):
        self._views.discard(update_id)

    @property
    def targets(self):  # what update_weights returns
        return self.active

    def deactivate(self) -> bool:
        if self.forgets == "interrupted":
            raise KeyboardInterrupt
        if self.forgets:
            self.active = self._views.active = {}
        return self.forgets


@pytest.mark.parametrize("forgets", [True, False])
def test_a_custom_installer_says_whether_its_weights_went_with_release_weights(forgets):
    pub = wsync.LocalCloneTensorBridge(source_worker="t")
    rollout = wsync.RolloutExecutor(wsync.LocalCloneTensorBridge())
    rollout.installer = installer = ForgettingViews(forgets)
    rollout._handle = wsync._wsync.Executor(rollout.weight_bridge._consumer_half(), installer,
                                           True)
    m = pub.publish({"w": torch.arange(4.0)}, weight_version=1)
    rollout.update_weights(m)
    rollout.release_weights()
    assert rollout.active_weight_version == (None if forgets else 1)
    assert (installer.active == {}) == forgets
    pub.release(m.update_id)


def test_a_ctrl_c_in_a_custom_deactivate_is_raised_by_release_weights():
    pub = wsync.LocalCloneTensorBridge(source_worker="t")
    rollout = wsync.RolloutExecutor(wsync.LocalCloneTensorBridge())
    rollout.installer = installer = ForgettingViews("interrupted")
    rollout._handle = wsync._wsync.Executor(rollout.weight_bridge._consumer_half(), installer,
                                           True)
    m = pub.publish({"w": torch.arange(4.0)}, weight_version=1)
    rollout.update_weights(m)
    with pytest.raises(KeyboardInterrupt):  # it used to be logged and lost
        rollout.release_weights()
    assert rollout.active_weight_version == 1  # its weights stayed
    assert installer.active["w"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the views keep the memory
    del installer.active
    pub.release(m.update_id)


def test_a_bridge_with_both_roles_gives_its_published_slot_back_whatever_the_consumer_says():
    b = wsync.SharedMemoryTensorBridge(options={"slots": "1"}, slot_wait_s=0.5)
    rollout = wsync.RolloutExecutor(b, model=small_model(1))
    m = b.publish(small_model(2), 1)
    rollout.update_weights(m)  # copies, then the executor releases the import itself
    b.release(m.update_id)  # the consumer half refuses; the publisher half still goes back
    assert not b._publisher.held()
    m2 = b.publish(small_model(3), 2)  # the one slot is free
    b.release(m2.update_id)
    rollout.release_weights()


def test_a_module_tensor_replaced_after_the_executor_was_made_fails_the_install():
    trainer, rollout_model = small_model(1), small_model(2)
    pub = wsync.LocalCloneTensorBridge(source_worker="t", source_rank=4)
    rollout = wsync.RolloutExecutor(wsync.LocalCloneTensorBridge(source_worker="r",
                                                                 source_rank=4),
                                    model=rollout_model)
    name = next(iter(rollout_model.state_dict()))
    owner = rollout_model
    *path, leaf = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, leaf, torch.nn.Parameter(getattr(owner, leaf).detach().clone()))
    m = pub.publish(trainer, 1)
    with pytest.raises(wsync.InstallFailedError, match=f"tensor {name}: field tensor: the "
                       "module's tensor was replaced") as e:
        rollout.update_weights(m)
    assert f"update_id={m.update_id} rank=4" in str(e.value)
    assert rollout.active_weight_version is None  # nothing was installed
    pub.release(m.update_id)


def test_where_the_module_cannot_drive_the_gpu_torch_copies_the_bytes():
    """A module built without CUDA says so, and the installer then copies into GPU modules with
    torch (copy_bytes), byte for byte from the segment."""
    from wsync import _torch, _wsync

    why = _wsync.gpu_ready()
    if not torch.cuda.is_available():
        assert why.startswith("blocked: "), why
    src = torch.arange(10, dtype=torch.float32)
    segment = bytearray(256) + bytearray(src.numpy().tobytes())
    dest = torch.empty(2, 5)
    _torch.copy_bytes(dest, segment, 256, 40)
    assert torch.equal(dest.reshape(-1), src)
    flags = torch.empty(3, dtype=torch.bool)
    _torch.copy_bytes(flags, bytearray(b"\x00\x01\x01"), 0, 3)
    assert flags.tolist() == [False, True, True]


def test_a_nested_generating_block_joins_its_step_and_an_install_inside_one_is_refused():
    """The gate cannot tell a thread's second entry from another reader's: a nested block that
    queued behind a waiting install would wait for itself. It joins the step it is in instead,
    and an install called from inside a step (which would wait for that step) raises."""
    pub = wsync.LocalCloneTensorBridge(source_worker="t")
    bridge = wsync.LocalCloneTensorBridge(source_worker="r")
    rollout = wsync.RolloutExecutor(bridge)
    m1 = pub.publish({"w": torch.full((4,), 1.0)}, 1)
    m2 = pub.publish({"w": torch.full((4,), 2.0)}, 2)
    rollout.update_weights(m1)
    outer_in, installing, done = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def install():
        installing.set()
        rollout.update_weights(m2)  # waits for the reader's step
        done.set()

    installer = threading.Thread(target=install)
    with rollout.generating():
        outer_in.set()
        installer.start()
        installing.wait()
        deadline = time.monotonic() + 30
        while rollout._handle.gate_waiting_installs() == 0:  # until it waits for this step
            assert time.monotonic() < deadline, "the install never reached the gate"
            time.sleep(0.001)
        with rollout.generating() as waited:  # would hang here without the nesting rule
            assert waited == 0.0
            seen.append(rollout.installer.active["w"].tolist())
        with pytest.raises(wsync.IllegalTransitionError, match="update_weights: called inside"):
            rollout.update_weights(m2)
        with pytest.raises(wsync.IllegalTransitionError, match="release_weights: called inside"):
            rollout.release_weights()
        # The bridge's release of the update being installed is refused, not waited for (the
        # install waits for this step): the executor reads its bytes.
        with pytest.raises(wsync.IllegalTransitionError, match="while an executor installs it"):
            bridge.release(m2.update_id)
        assert not done.is_set()
    installer.join(timeout=30)
    assert done.is_set()
    assert seen == [[1.0] * 4]
    assert rollout.installer.active["w"].tolist() == [2.0] * 4
    rollout.release_weights()
    for m in (m1, m2):
        pub.release(m.update_id)


def test_blocks_interleaved_on_one_thread_share_a_hold_until_the_last_closes():
    """Generators or asyncio tasks on one thread may close their blocks out of order: the hold
    lasts until the last is closed, so neither runs outside the gate."""
    pub = wsync.LocalCloneTensorBridge(source_worker="t")
    rollout = wsync.RolloutExecutor(wsync.LocalCloneTensorBridge(source_worker="r"))
    m1 = pub.publish({"w": torch.full((4,), 1.0)}, 1)
    rollout.update_weights(m1)
    first, second = rollout.generating(), rollout.generating()
    first.__enter__()
    assert second.__enter__() == 0.0
    first.__exit__(None, None, None)  # the first step ends while the second runs
    with pytest.raises(wsync.IllegalTransitionError):
        rollout.release_weights()  # still held: the second step is in flight
    second.__exit__(None, None, None)
    m2 = pub.publish({"w": torch.full((4,), 2.0)}, 2)
    rollout.update_weights(m2)  # nothing holds the gate now
    assert rollout.installer.active["w"].tolist() == [2.0] * 4
    rollout.release_weights()
    for m in (m1, m2):
        pub.release(m.update_id)
