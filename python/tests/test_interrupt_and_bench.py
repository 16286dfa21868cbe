"""Ctrl-C reaches a Python caller blocked in a cluster call at once, and the Python benchmark
prints its JSON rows."""

import json
import signal
import subprocess
import sys
import time

from conftest import wsync_bin
from wsync import bench

CHILD = r"""
import sys, torch, wsync
wsync.wait_for_consumers(1, timeout=30)
rank = wsync.TrainerRank()
print("ready", flush=True)
sys.stdin.readline()  # the parent froze the consumer
try:
    rank.publish({"w": torch.ones(1024)}, weight_version=1)  # the consumer is frozen: blocks
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(0)
print("returned", flush=True)
sys.exit(3)
"""


def test_ctrl_c_interrupts_a_publish_waiting_for_its_outcome(coordinator):
    consumer = subprocess.Popen([wsync_bin(), "consumer", "--coordinator", coordinator.address,
                                 "--model", "model"], env=coordinator.env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=coordinator.env())
        line = p.stdout.readline().strip()
        assert line == "ready"
        # Frozen before the publish starts, so the outcome surely waits for it (frozen after,
        # a loaded machine could let the publish commit first).
        consumer.send_signal(signal.SIGSTOP)
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(0.3)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        answer = p.stdout.readline().strip()
        took = time.monotonic() - t0
        assert answer == "interrupted", answer
        # Promptly, not after the outcome timeout (60 s); generous for a loaded 2-core VM.
        assert took < 2.0, f"KeyboardInterrupt came {took:.3f} s after SIGINT"
        p.communicate(timeout=30)
        assert p.returncode == 0
    finally:
        consumer.send_signal(signal.SIGCONT)
        consumer.terminate()
        consumer.wait(15)


EXITING_CHILD = r"""
import sys, time, torch, wsync
class Slow:  # keeps the interpreter shutting down while the outcome comes (the deadline, 1 s)
    def __del__(self, sleep=time.sleep):
        sleep(3)
keep = Slow()
wsync.wait_for_consumers(1, timeout=30)
rank = wsync.TrainerRank()
print("ready", flush=True)
sys.stdin.readline()  # the parent froze the consumer
rank.publish({"w": torch.ones(1024)}, weight_version=1)  # interrupted: the program exits
"""


def test_ctrl_c_then_an_outcome_during_shutdown_exits_cleanly():
    # The publish Ctrl-C left running returns while the interpreter shuts down. Taking the GIL
    # back then ended its thread inside a destructor, and the process aborted (134, core dump).
    from conftest import Coordinator
    coordinator = Coordinator(deadline_ms=1000)
    consumer = subprocess.Popen([wsync_bin(), "consumer", "--coordinator", coordinator.address,
                                 "--model", "model"], env=coordinator.env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p = subprocess.Popen([sys.executable, "-c", EXITING_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=coordinator.env())
        assert p.stdout.readline().strip() == "ready"
        consumer.send_signal(signal.SIGSTOP)
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        # An uncaught KeyboardInterrupt ends Python by SIGINT; an abort is SIGABRT.
        assert p.returncode in (130, -signal.SIGINT), f"exit {p.returncode}: {err[-2000:]}"
        assert "terminate called" not in err, err[-2000:]
    finally:
        consumer.send_signal(signal.SIGCONT)
        consumer.terminate()
        consumer.wait(15)
        coordinator.stop()


DAEMON_CHILD = r"""
import threading, time, torch, wsync
class Slow:  # keeps the interpreter shutting down while the thread's calls return
    def __del__(self, sleep=time.sleep):
        sleep(2)
keep = Slow()
bridge = wsync.LocalCloneTensorBridge()
rollout = wsync.RolloutExecutor(wsync.LocalCloneTensorBridge())
w = torch.ones(64 * 1024 * 1024)  # 256 MB: each call works a while without the GIL
def loop():
    v = 0
    while True:
        v += 1
        m = bridge.publish({"w": w}, weight_version=v)
        rollout.update_weights(m)
        bridge.release(m.update_id)
threading.Thread(target=loop, daemon=True).start()
time.sleep(0.5)
print("exiting", flush=True)
"""


def test_a_daemon_thread_inside_wsync_calls_lets_the_program_exit():
    # A trainer or rollout loop in a daemon thread, the main thread ending: each call that gave
    # up the GIL took it back during the shutdown, which ended its thread inside a destructor
    # (exit 134, "terminate called", a core dump).
    p = subprocess.run([sys.executable, "-c", DAEMON_CHILD], capture_output=True, text=True,
                       timeout=60)
    assert p.stdout.strip() == "exiting"
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-2000:]}"
    assert "terminate called" not in p.stderr, p.stderr[-2000:]


def test_bench_prints_one_json_row_per_figure(capsys):
    assert bench.main(["--layout", "synthetic:4194304:8", "--repeat", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["mode"] for r in rows] == ["python-publish", "python-import", "python-install"]
    for r in rows:
        assert r["status"] == "pass" and r["layout"] == "synthetic:4194304:8"
        assert isinstance(r["goal_met"], bool)  # a figure, not asserted: machines are shared
    assert rows[0]["ratio"] > 0 and rows[1]["tensors"] == 8
    assert rows[2]["longest_gate_wait_s"] >= 0


def test_bench_prints_a_row_for_a_figure_that_fails(capsys):
    # Every figure still prints its row, with the reason, and the exit code says so.
    assert bench.main(["--layout", "synthetic:65536:4", "--repeat", "1",
                       "--transport", "no-such-transport"]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["mode"] for r in rows] == ["python-publish", "python-import", "python-install"]
    for r in rows:
        assert r["status"] == "fail" and "unknown transport" in r["error"]
    assert bench.main(["--layout", "no-such-layout", "--repeat", "1"]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["status"] == "fail" and "no-such-layout" in rows[0]["error"]
