"""The cluster from Python, end to end: a trainer process trains a small decoder and publishes
every optimizer step through a real coordinator; two rollout processes install each version
into their own module and compute logits, which must equal the trainer's exactly."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import shm_entries, wsync_bin  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))


def start(role_args, env, log):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "cluster_roles.py"), *role_args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(procs, limit=240):
    deadline = time.monotonic() + limit
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def decoder_cluster_run(coordinator, tmp_path, exact_logits=True, **env_extra):
    """The trainer and two rollout processes of cluster_roles.py through `coordinator`, with
    `env_extra` added to their environment; asserts that every rollout rank installed every
    version's exact weights and computed the trainer's logits from them."""
    steps = 4
    env = dict(coordinator.env(), PYTHONPATH=os.environ.get("PYTHONPATH", ""), **env_extra)
    log = open(tmp_path / "roles.log", "w")
    rollouts = [start(["rollout", str(tmp_path), str(steps), str(r)], env, log) for r in range(2)]
    trainer = start(["trainer", str(tmp_path), str(steps), "2"], env, log)
    pids = [p.pid for p in (trainer, *rollouts)]
    codes = finish([trainer, *rollouts])
    log.close()
    assert codes == [0, 0, 0], open(tmp_path / "roles.log").read()[-4000:]

    refs = torch.load(tmp_path / "trainer.pt")
    weights = torch.load(tmp_path / "trainer-weights.pt")
    assert sorted(refs) == list(range(1, steps + 1))
    for r in range(2):
        got = torch.load(tmp_path / f"rollout{r}.pt")
        for v in range(1, steps + 1):
            assert got["weights"][v].keys() == weights[v].keys()
            for name, t in weights[v].items():
                assert torch.equal(got["weights"][v][name], t), f"rank {r} version {v} {name}"
            if exact_logits:
                assert torch.equal(got["logits"][v], refs[v]), f"rank {r} version {v}"
            else:
                torch.testing.assert_close(got["logits"][v], refs[v], rtol=0, atol=1e-5)
        assert got["status"]["installed"] == steps and got["status"]["rejected"] == 0
    # Versions differ (the trainer really trained).
    assert not torch.equal(refs[1], refs[steps])
    assert shm_entries(pids) == set()


def test_trained_decoder_reaches_two_rollout_processes_exactly(coordinator, tmp_path):
    decoder_cluster_run(coordinator, tmp_path)


def test_trainer_killed_mid_publish_leaves_rollout_on_previous_version(coordinator, tmp_path):
    nbytes = str(256 << 20)
    env = dict(coordinator.env(), PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    log = open(tmp_path / "roles.log", "w")
    rollout = start(["blob-rollout", str(tmp_path), nbytes], env, log)
    trainer = start(["crash-trainer", str(tmp_path), nbytes], env, log)
    deadline = time.monotonic() + 120
    while not (tmp_path / "publishing-v2").exists():
        assert trainer.poll() is None and time.monotonic() < deadline, \
            open(tmp_path / "roles.log").read()[-4000:]
        time.sleep(0.002)
    time.sleep(0.01)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    # Wait until the coordinator has noticed the lost trainer (its rank left the table).
    import wsync

    where = dict(coordinator=coordinator.address, token=coordinator.token)
    deadline = time.monotonic() + 30
    while any(r.get("role") == "publisher" for r in wsync.coordinator_status(**where)["ranks"]):
        assert time.monotonic() < deadline, "the coordinator never noticed the killed trainer"
        time.sleep(0.02)
    (tmp_path / "done").touch()
    # The dead trainer could not unlink its slots; the restarted one sweeps them and goes on
    # (any publisher starting on this host sweeps them: another test's may get there first).
    resumed = start(["resumed-trainer", str(tmp_path), nbytes], env, log)
    assert finish([resumed, rollout]) == [0, 0], open(tmp_path / "roles.log").read()[-4000:]
    log.close()
    got = torch.load(tmp_path / "blob.pt")
    assert got["after_kill"] == 1 and got["ones"], got
    assert got["threes"] and got["status"]["active_weight_version"] == 3, got
    coordinator.stop()
    left = shm_entries([trainer.pid, resumed.pid, rollout.pid])
    assert left == set(), f"left in /dev/shm: {sorted(left)}"


def test_a_refused_publish_raises_the_class_of_its_error_code(coordinator):
    import wsync

    where = dict(coordinator=coordinator.address, token=coordinator.token)
    with wsync.RolloutRank(model=torch.nn.Linear(2, 2), rank=0, **where) as rollout, \
            wsync.TrainerRank(model=torch.nn.Linear(2, 2), rank=0, ranks=1, **where) as trainer:
        wsync.wait_for_consumers(1, timeout=30, **where)
        assert trainer.publish(weight_version=1).committed
        with pytest.raises(wsync.VersionNotMonotonicError,
                           match="weight_version must increase monotonically"):
            trainer.publish(weight_version=1)
        # A closed rank says so, whatever is called on it.
        trainer.close()
        with pytest.raises(wsync.IllegalTransitionError, match="TrainerRank rank 0: closed"):
            trainer.publish(weight_version=2)
        with pytest.raises(wsync.IllegalTransitionError, match="TrainerRank rank 0: closed"):
            trainer.publish_async(weight_version=2)
        with pytest.raises(wsync.InvalidArgumentError, match="coordinator: 30 is not 'host:port'"):
            wsync.wait_for_consumers(1, 30)
        rollout.close()
        with pytest.raises(wsync.IllegalTransitionError, match="RolloutRank rank 0: closed"):
            rollout.status()
        with pytest.raises(wsync.IllegalTransitionError, match="RolloutRank rank 0: closed"):
            with rollout.generating():
                pass
        with pytest.raises(wsync.IllegalTransitionError, match="RolloutRank rank 0: closed"):
            rollout.wait_for_version(2, timeout=30)  # at once, not after the timeout
        assert rollout.active_weight_version == 0


def test_an_aborted_version_is_published_again_and_commits(coordinator):
    import wsync

    where = dict(coordinator=coordinator.address, token=coordinator.token)
    rollout_model = torch.nn.Linear(2, 2)
    with wsync.RolloutRank(model=rollout_model, rank=0, **where) as rollout, \
            wsync.TrainerRank(model=torch.nn.Linear(2, 2), rank=0, ranks=1, **where) as trainer:
        wsync.wait_for_consumers(1, timeout=30, **where)
        assert trainer.publish(weight_version=1).committed
        # Version 2 with the wrong shapes: the only rollout rank rejects it, so it is aborted.
        bad = trainer.publish(model=torch.nn.Linear(3, 3), weight_version=2)
        assert not bad.committed and bad.ranks[0]["state"] in ("rejected", "released"), bad.table
        # The trainer retries step 2 with a new update id; the coordinator takes it once the
        # rank let go of the first attempt, and it commits.
        good_model = torch.nn.Linear(2, 2)
        good = trainer.publish(model=good_model, weight_version=2)
        assert good.committed, good.table
        assert good.table["attempt"] == 2, good.table
        assert rollout.wait_for_version(2, timeout=30)
        assert torch.equal(rollout_model.weight, good_model.weight)
        # Version 1 is old now, whatever the trainer thinks.
        with pytest.raises(wsync.VersionNotMonotonicError,
                           match="weight_version must increase monotonically"):
            trainer.publish(weight_version=1)


def test_a_publish_after_publish_async_waits_its_turn(coordinator):
    import wsync

    where = dict(coordinator=coordinator.address, token=coordinator.token)
    with wsync.RolloutRank(model=torch.nn.Linear(64, 64), rank=0, **where) as rollout, \
            wsync.TrainerRank(model=torch.nn.Linear(64, 64), rank=0, ranks=1, **where) as trainer:
        wsync.wait_for_consumers(1, timeout=30, **where)
        first = trainer.publish_async(weight_version=1)
        second = trainer.publish(weight_version=2)  # in call order: after the async one
        assert first.result(timeout=60).committed
        assert second.committed, second.table
        assert rollout.wait_for_version(2, timeout=30)


def _until(check, what, limit=30.0):
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_trainer_keeps_an_update_in_flight_when_the_coordinator_dies_until_told():
    """The coordinator dies while version 2 is in flight (the rollout rank imported it and waits
    at the generation gate). The trainer keeps version 2's memory, where it used to give it back
    at once though the rank was still copying from it; the rank installs it, and its release
    reaches no trainer (the trainer has not rejoined the restarted coordinator). The trainer's
    next join names version 2, and the restarted coordinator has it given back."""
    import wsync
    from conftest import Coordinator

    grace = ("--rejoin-grace-ms", "200")
    first = Coordinator(args=grace)
    second = None
    try:
        where = dict(coordinator=first.address, token=first.token)
        with wsync.TrainerRank(model=torch.nn.Linear(2, 2), rank=0, ranks=1, **where) as trainer, \
                wsync.RolloutRank(model=torch.nn.Linear(2, 2), rank=0, **where) as rollout:
            wsync.wait_for_consumers(1, timeout=30, **where)
            assert trainer.publish(weight_version=1).committed
            with rollout.generating():  # version 2 waits at the gate
                # It would wait for this very block: refused at once, naming the way out.
                with pytest.raises(wsync.IllegalTransitionError, match="after the block"):
                    rollout.wait_for_version(2, timeout=30)
                pending = trainer.publish_async(weight_version=2)
                _until(lambda: any(u.get("weight_version") == 2
                                   for u in wsync.coordinator_status(**where)["updates"]),
                       "version 2 was never distributed")
                first.proc.kill()
                first.proc.wait()
                with pytest.raises(wsync.WeightSyncError, match="coordinator went away"):
                    pending.result(timeout=60)
                assert 2 in trainer.held_versions(), "given back while the rank reads it"
                second = Coordinator(port=int(first.address.rsplit(":", 1)[1]),
                                     token=first.token, args=grace)
                wsync.wait_for_consumers(1, timeout=30, **where)
            assert rollout.wait_for_version(2, timeout=30) == 2
            assert trainer.publish(weight_version=3).committed  # joins again first
            assert rollout.wait_for_version(3, timeout=30) == 3
            _until(lambda: 2 not in trainer.held_versions(),
                   f"version 2 is still held: {trainer.held_versions()}")
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_ctrl_c_while_a_rank_joins_leaves_no_rank_behind(coordinator):
    """Ctrl-C during RolloutRank(...) reaches the caller at once; the join, finishing in the
    background, has no owner then, so the rank it made is closed rather than left serving."""
    import _thread
    import threading

    import wsync

    where = dict(coordinator=coordinator.address, token=coordinator.token)
    timer = threading.Timer(0.005, _thread.interrupt_main)
    timer.start()
    # Kept, as a REPL or a logger keeps it: its frames hold what the helper thread returns.
    with pytest.raises(KeyboardInterrupt) as kept:
        wsync.RolloutRank(model=torch.nn.Linear(2, 2), rank=7, **where)
    timer.join()
    # The join goes on in its helper thread: once that has ended, the rank it made must go.
    _until(lambda: not any(t.name == "wsync-call" and t.is_alive()
                           for t in threading.enumerate()), "the interrupted join never ended")
    _until(lambda: not any(r.get("rank") == 7
                           for r in wsync.coordinator_status(**where)["ranks"]),
           "the abandoned rank 7 stayed joined")
    del kept
