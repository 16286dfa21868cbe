"""Chaos soak: a coordinator, two publisher ranks and four consumer ranks (real processes on
loopback, shared memory) go through N updates while consumers are SIGKILLed and SIGSTOPped at
random and, once each, a publisher and the coordinator are SIGKILLed and restarted. Readers in
every consumer check each generation step for torn reads.

    chaos.py [--updates N] [--seed S] [--fault-every K] [--pace S] [--time-limit S]

Needs the Python module (PYTHONPATH=build/default/python, /usr/bin/python3) and WSYNC_BIN (the
wsync binary). Prints one JSON row (docs/benchmark.md's contract): updates committed, faults
injected, the longest time from a fault to a healthy cluster on a newer version, torn reads, and
the open fds, RSS and /dev/shm entries at the end against the start. Exits 1 when a promise
broke: a torn read, an update that never committed, a /dev/shm entry left, or fds that grew.

The processes are this file run again with a role:
    chaos.py publisher DIR RANK N PACE      chaos.py consumer DIR RANK INCARNATION
"""

import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

PUBLISHERS, CONSUMERS, TENSORS, ELEMENTS = 2, 4, 4, 16384
DEADLINE_MS = 4000  # per update: a frozen consumer fails after this, the others commit


def names(rank):
    return [f"p{rank}_t{i}" for i in range(TENSORS)]


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


# --- the roles ------------------------------------------------------------------------------

def publisher(work, rank, updates, pace):
    """Publishes its shard of every version, each tensor filled with the version number; a
    version that was aborted (a rank died) is published again, a refused one skipped."""
    import torch
    import wsync

    # The whole model: TrainerRank publishes every PUBLISHERS-th tensor from `rank` on.
    shard = {n: torch.zeros(ELEMENTS) for r in range(PUBLISHERS) for n in names(r)}
    # From the start: a SIGTERM between two publishes must still close the trainer (which
    # unlinks its slots), not end the process where it stands.
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    trainer = None
    v = None
    while not done.is_set():
        try:
            if trainer is None:
                trainer = wsync.TrainerRank(rank=rank, ranks=PUBLISHERS, outcome_timeout=30)
            if v is None:
                v = wsync.coordinator_status()["committed_version"] + 1
            if v > updates:
                break
            for t in shard.values():
                t.fill_(float(v))
            outcome = trainer.publish(model=shard, weight_version=v)
            if outcome.committed:
                v += 1
                time.sleep(pace)  # a training step
            else:
                time.sleep(0.05)  # aborted: the same version again, a new attempt
        except wsync.VersionNotMonotonicError:
            v = None  # committed meanwhile (the outcome was lost with a coordinator)
        except wsync.WeightSyncError as e:
            # The coordinator went away or is restarting: the rank joins again on its next
            # publish (or is made again when it never joined).
            print(f"publisher {rank}: {e}; retrying", file=sys.stderr, flush=True)
            time.sleep(0.3)
    if v is not None:
        write_json(os.path.join(work, f"publisher-{rank}.done"), {"last": v - 1})
    # A trainer outlives its last publish here (as in a job that keeps training); a consumer
    # restarted after the trainers exit would catch up from a peer (docs/cluster.md).
    done.wait()
    if trainer is not None:
        trainer.close()


def consumer(work, rank, incarnation):
    """Installs every version and checks, inside the generation gate, that every tensor holds
    the active version's number: anything else is a torn read."""
    import torch
    import wsync

    params = {n: torch.nn.Parameter(torch.zeros(ELEMENTS), requires_grad=False)
              for r in range(PUBLISHERS) for n in names(r)}
    model = torch.nn.ParameterDict(params)
    stats = {"pid": os.getpid(), "rank": rank, "checks": 0, "torn": 0, "versions": [],
             "first_torn": None}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ranked = wsync.RolloutRank(model=model, rank=rank, join_timeout=60)

    def read():
        seen = set()
        while not stop.is_set():
            with ranked.generating():
                v = ranked.active_weight_version
                if v:
                    bad = [n for n, p in model.items() if not bool(torch.all(p == float(v)))]
                    stats["checks"] += 1
                    if bad:
                        stats["torn"] += 1
                        stats["first_torn"] = stats["first_torn"] or {"version": v, "tensors": bad}
                    seen.add(v)
            stats["versions"] = sorted(seen)[-3:]
            time.sleep(0.001)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    path = os.path.join(work, f"consumer-{rank}-{incarnation}.json")
    while not stop.wait(0.3):
        write_json(path, stats)
    reader.join()
    ranked.close()
    write_json(path, stats)


# --- the driver -----------------------------------------------------------------------------

def fds_of(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def rss_mb_of(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def shm_of(pids):
    prefixes = tuple(f"/dev/shm/wsync-{p}-" for p in pids)
    return sorted(f for f in glob.glob("/dev/shm/wsync-*") if f.startswith(prefixes))


class Cluster:
    def __init__(self, work, wsync_bin, updates, pace):
        self.work, self.bin, self.updates, self.pace = work, wsync_bin, updates, pace
        self.token = os.urandom(16).hex()
        self.port = None
        self.coordinator = None
        self.publishers = {}
        self.consumers = {}
        self.incarnation = {r: 0 for r in range(CONSUMERS)}
        self.pids = set()  # every process ever started: /dev/shm names carry the creator's pid
        self.log = open(os.path.join(work, "processes.log"), "w")

    def env(self):
        return dict(os.environ, WSYNC_TOKEN=self.token,
                    WSYNC_COORDINATOR=f"127.0.0.1:{self.port}")

    def start_coordinator(self):
        port_file = os.path.join(self.work, "port")
        if os.path.exists(port_file):
            os.remove(port_file)
        self.coordinator = subprocess.Popen(
            [self.bin, "coordinator", "--host", "127.0.0.1", "--port", str(self.port or 0),
             "--port-file", port_file, "--update-deadline-ms", str(DEADLINE_MS)],
            env=dict(os.environ, WSYNC_TOKEN=self.token), stdout=self.log,
            stderr=subprocess.STDOUT)
        self.pids.add(self.coordinator.pid)
        limit = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if self.coordinator.poll() is not None or time.monotonic() > limit:
                raise RuntimeError("the coordinator did not start (see processes.log)")
            time.sleep(0.02)
        self.port = int(open(port_file).read().strip())

    def role(self, *args):
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, args)],
                             env=self.env(), stdout=self.log, stderr=subprocess.STDOUT)
        self.pids.add(p.pid)
        return p

    def start_publisher(self, rank):
        self.publishers[rank] = self.role("publisher", self.work, rank, self.updates, self.pace)

    def start_consumer(self, rank):
        self.incarnation[rank] += 1
        self.consumers[rank] = self.role("consumer", self.work, rank, self.incarnation[rank])

    def status(self):
        import wsync
        try:
            return wsync.coordinator_status(f"127.0.0.1:{self.port}", self.token)
        except wsync.WeightSyncError:
            return None

    def healthy_above(self, version):
        """The cluster committed a version above `version` and every consumer serves it."""
        s = self.status()
        if not s or s.get("committed_version", 0) <= version or s.get("status") != "pass":
            return False
        consumers = [r for r in s.get("ranks", []) if r.get("role") == "consumer"]
        return len(consumers) == CONSUMERS

    def stop_all(self):
        for p in list(self.consumers.values()) + list(self.publishers.values()):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
        for p in list(self.consumers.values()) + list(self.publishers.values()):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.terminate()
            self.coordinator.wait(20)
        self.log.close()


def consumer_entry(status, rank):
    """The status table's row of consumer `rank`, or None while it is not joined."""
    return next((r for r in status.get("ranks", [])
                 if r.get("role") == "consumer" and r.get("rank") == rank), None)


def recovered(status, fault):
    kind, _, committed, rank = fault
    if rank is None:
        return status.get("committed_version", 0) > committed
    entry = consumer_entry(status, rank)
    return entry is not None and (entry.get("active_weight_version") or 0) > committed


def drive(args):
    wsync_bin = os.environ.get("WSYNC_BIN", "")
    if not os.access(wsync_bin, os.X_OK):
        print("chaos: WSYNC_BIN must name the wsync binary", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="wsync-chaos-")
    c = Cluster(work, wsync_bin, args.updates, args.pace)
    try:
        return run_cluster(args, c, work, rng)
    except BaseException:
        c.stop_all()  # a failure here must not leave the cluster running for the next test
        raise


def run_cluster(args, c, work, rng):
    shm_before = len(glob.glob("/dev/shm/wsync-*"))
    c.start_coordinator()
    for r in range(CONSUMERS):
        c.start_consumer(r)
    import wsync
    wsync.wait_for_consumers(CONSUMERS, f"127.0.0.1:{c.port}", c.token, timeout=120)
    for r in range(PUBLISHERS):
        c.start_publisher(r)
    t0 = time.monotonic()
    faults, recoveries = [], []
    slowest = {}  # the longest recovery of each fault kind
    alone, overlapped = [], set()  # recoveries of faults that overlapped no other; ids that did
    # For a consumer fault: (seconds since it, joined or absent, the rank's active version, the
    # committed version then) each time the rank's side changed; kept for each kind's slowest.
    timelines, slowest_timeline = {}, {}
    pending = []  # faults not yet recovered from: (kind, time, committed at the fault, rank)
    timers = []  # restarts and SIGCONTs due later: (time, action)
    baseline = None  # fds and RSS of the ranks never killed (consumer 0, publisher 0)
    # The publisher is killed once, at a third; the coordinator at two thirds, or, killed
    # several times, at even steps (each restart takes its versions from the consumers).
    kills = args.coordinator_kills
    big = {"publisher": args.updates // 3,
           "coordinator": [2 * args.updates // 3] if kills == 1 else
           [args.updates * (k + 1) // (kills + 1) for k in range(kills)]}
    next_fault = args.fault_every
    limit = time.monotonic() + args.time_limit
    committed = 0
    failure = ""
    busy = set()  # consumer ranks down or frozen right now
    while True:
        now = time.monotonic()
        for due, action in [t for t in timers if t[0] <= now]:
            action()
        timers = [t for t in timers if t[0] > now]
        s = c.status()
        if s:
            committed = s.get("committed_version", committed)
        if baseline is None and committed >= min(10, args.updates):
            baseline = {"consumer0_fds": fds_of(c.consumers[0].pid),
                        "consumer0_rss_mb": rss_mb_of(c.consumers[0].pid),
                        "publisher0_fds": fds_of(c.publishers[0].pid),
                        "publisher0_rss_mb": rss_mb_of(c.publishers[0].pid)}
        # A fault is over when its consumer serves a newer version than when it struck (a
        # publisher or coordinator fault: when the cluster commits a newer one).
        still = []
        for p in pending:
            seen = timelines.setdefault(id(p), [])
            if s and p[3] is not None:  # what the coordinator shows of the rank: when it changes
                entry = consumer_entry(s, p[3])
                view = ("joined" if entry else "absent",
                        (entry or {}).get("active_weight_version"), s.get("committed_version"))
                if not seen or seen[-1][1:3] != view[:2]:
                    seen.append((round(time.monotonic() - p[1], 2), *view))
            if s and recovered(s, p):
                recoveries.append(time.monotonic() - p[1])
                if id(p) not in overlapped:
                    alone.append(recoveries[-1])
                overlapped.discard(id(p))
                if recoveries[-1] > slowest.get(p[0], 0.0):
                    slowest[p[0]] = recoveries[-1]
                    if p[3] is not None:
                        slowest_timeline[p[0]] = {"committed_at_fault": p[2],
                                                  "seen": timelines.pop(id(p), [])}
                timelines.pop(id(p), None)
            else:
                still.append(p)
        pending = still
        if committed >= args.updates and not pending and not timers and \
                c.healthy_above(args.updates - 1):
            break
        if time.monotonic() > limit:
            failure = (f"stopped after {args.time_limit} s: committed {committed} of "
                       f"{args.updates}, not recovered from {[p[0] for p in pending]}")
            break
        if committed >= next_fault and committed < args.updates - 2:
            next_fault = committed + args.fault_every
            kind = "sigkill-consumer" if rng.random() < 0.5 else "sigstop-consumer"
            if big["publisher"] and committed >= big["publisher"]:
                kind, big["publisher"] = "sigkill-publisher", 0
            elif big["coordinator"] and committed >= big["coordinator"][0] and not timers:
                kind = "sigkill-coordinator"
                big["coordinator"].pop(0)
            free = [r for r in range(CONSUMERS) if r not in busy]
            if kind == "sigkill-consumer":
                free = [r for r in free if r != 0]  # consumer 0 stays: its fds, RSS are watched
            if kind.endswith("consumer") and not free:
                kind = "none"  # every consumer is down or frozen already: skip this one
            at = time.monotonic()
            if kind == "sigkill-consumer":
                r = rng.choice(free)
                c.consumers[r].kill()
                c.consumers[r].wait()
                busy.add(r)
                timers.append((at + rng.uniform(0.1, 1.0),
                               lambda r=r: (c.start_consumer(r), busy.discard(r))))
            elif kind == "sigstop-consumer":
                r = rng.choice(free)
                os.kill(c.consumers[r].pid, signal.SIGSTOP)
                busy.add(r)
                timers.append((at + rng.uniform(0.5, 2.0),
                               lambda r=r: (os.kill(c.consumers[r].pid, signal.SIGCONT),
                                            busy.discard(r))))
            elif kind == "none":
                pass
            elif kind == "sigkill-publisher":
                c.publishers[1].kill()
                c.publishers[1].wait()
                timers.append((at + 0.5, lambda: c.start_publisher(1)))
            else:
                c.coordinator.kill()
                c.coordinator.wait()
                time.sleep(0.5)
                c.start_coordinator()
            if kind != "none":
                faults.append(kind)
                fault = (kind, at, committed, r if kind.endswith("consumer") else None)
                # Faults that overlap (one striking a rank still recovering from an earlier
                # one, as a restarted rank still starting, or any fault while a publisher or
                # coordinator fault holds commits back, or the other way round) measure the
                # two together: their recoveries are kept apart from those of faults alone.
                for p in pending:
                    if fault[3] is None or p[3] is None or p[3] == fault[3]:
                        overlapped.add(id(p))
                        overlapped.add(id(fault))
                pending.append(fault)
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    end = {"consumer0_fds": fds_of(c.consumers[0].pid),
           "consumer0_rss_mb": rss_mb_of(c.consumers[0].pid),
           "publisher0_fds": fds_of(c.publishers[0].pid),
           "publisher0_rss_mb": rss_mb_of(c.publishers[0].pid)}
    c.stop_all()
    torn, checks, first_torn = 0, 0, None
    for path in glob.glob(os.path.join(work, "consumer-*.json")):
        with open(path) as f:
            st = json.load(f)
        torn += st["torn"]
        checks += st["checks"]
        first_torn = first_torn or st["first_torn"]
    left = shm_of(c.pids)
    # Slots a publisher left to a consumer still reading them after the coordinator let it go
    # (frozen past the heartbeat timeout) instead of rewriting them under it.
    with open(os.path.join(work, "processes.log"), errors="replace") as f:
        lines = f.readlines()
    left_to_readers = sum("is still read by" in line for line in lines)
    # Versions a restarted coordinator took from the consumers that serve them, and refusals.
    adoptions = sum("from consumer rank" in line and "coordinator: took" in line for line in lines)
    adoptions_refused = sum("adoption refused" in line for line in lines)
    baseline = baseline or {}
    row = {
        "mode": "chaos-soak", "updates": args.updates, "committed": committed,
        "seconds": round(seconds, 1), "faults": len(faults),
        "fault_kinds": {k: faults.count(k) for k in sorted(set(faults))},
        "max_recover_s": round(max(recoveries), 2) if recoveries else None,
        "median_recover_s": round(sorted(recoveries)[len(recoveries) // 2], 2) if recoveries
        else None,
        "max_recover_s_by_kind": {k: round(v, 2) for k, v in sorted(slowest.items())},
        "max_recover_s_alone": round(max(alone), 2) if alone else None,
        "faults_alone": len(alone),
        "slowest_consumer_recoveries": slowest_timeline,
        "reader_checks": checks, "torn_reads": torn, "slots_left_to_readers": left_to_readers,
        "adoptions": adoptions, "adoptions_refused": adoptions_refused,
        "fds": {"start": {k: v for k, v in baseline.items() if k.endswith("fds")},
                "end": {k: v for k, v in end.items() if k.endswith("fds")}},
        "rss_mb": {"start": {k: v for k, v in baseline.items() if k.endswith("rss_mb")},
                   "end": {k: v for k, v in end.items() if k.endswith("rss_mb")}},
        "dev_shm_left": len(left), "dev_shm_before": shm_before,
        "dev_shm_after": len(glob.glob("/dev/shm/wsync-*")), "work": work,
    }
    problems = [failure] if failure else []
    if torn:
        problems.append(f"{torn} torn reads, first {first_torn}")
    if committed < args.updates:
        problems.append(f"committed {committed} of {args.updates}")
    if left:
        problems.append(f"left in /dev/shm: {left[:5]}")
    for k in ("consumer0_fds", "publisher0_fds"):
        if baseline.get(k) is not None and end.get(k) is not None and end[k] > baseline[k] + 8:
            problems.append(f"{k} grew from {baseline[k]} to {end[k]}")
    row["status"] = "fail" if problems else "pass"
    if problems:
        row["problems"] = problems  # the logs stay in `work`
    else:
        shutil.rmtree(work, ignore_errors=True)
        del row["work"]
    print(json.dumps(row), flush=True)
    return 1 if problems else 0


def main(argv):
    if argv[:1] == ["publisher"]:
        publisher(argv[1], int(argv[2]), int(argv[3]), float(argv[4]))
        return 0
    if argv[:1] == ["consumer"]:
        consumer(argv[1], int(argv[2]), int(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=1000, help="versions to commit (default 1000)")
    ap.add_argument("--seed", type=int, default=1, help="random seed of the fault schedule")
    ap.add_argument("--fault-every", type=int, default=10,
                    help="committed versions between faults (default 10)")
    ap.add_argument("--pace", type=float, default=0.1,
                    help="seconds a publisher waits after each committed version (default 0.1)")
    ap.add_argument("--coordinator-kills", type=int, default=1,
                    help="times the coordinator is SIGKILLed and restarted (default 1)")
    ap.add_argument("--time-limit", type=float, default=3600,
                    help="seconds before the run counts as stuck (default 3600)")
    return drive(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
