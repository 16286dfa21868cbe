"""Benchmark of the Python layer, printing one JSON row per figure (like ``wsync bench``).

    /usr/bin/python3 -m wsync.bench [--layout qwen2.5-0.5b] [--repeat 5] [--transport T]

Rows (medians over --repeat, each against a baseline measured in the same run):
- ``python-publish``: ``bridge.publish(module)`` (the Python API: state_dict walk, dtype and
  contiguity checks, then the C++ publisher) against the C++ publisher given the same tensors'
  pointers directly, the two taking turns at going first; ``ratio`` = python / C++ (goal <=
  1.05).
- ``python-import``: ``import_update`` into torch views without verification (goal <= 2 ms for
  290 tensors) against the core's import of the same updates (segments, no views); and with
  checksums verified.
- ``python-install``: ``RolloutExecutor(model=...)`` updates of a module of the layout while a
  reader thread runs generation steps at the gate: install time, and the longest any step waited
  at the gate (goal <= 1 ms).

Every row's ``status`` says whether the figure was measured (pass), could not be (blocked) or
failed; ``goal_met`` says whether the median met its goal, which a shared machine may miss.
"""

import argparse
import json
import statistics
import threading
import time
from typing import Dict, List

import torch

import wsync
from wsync import _torch, _wsync


def layout_module(layout: str) -> torch.nn.Module:
    """A module whose state_dict has the layout's names, dtypes and shapes (values random)."""
    root = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for name, dtype, shape in _wsync.layout(layout):
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        dt = _torch.torch_dtype(dtype)
        t = torch.randn(shape, generator=g).to(dt) if dt.is_floating_point else \
            torch.zeros(shape, dtype=dt)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_publish(model, transport: str, repeat: int) -> Dict:
    bridge = wsync.make_weight_bridge(transport, source_worker="bench")
    pub = bridge._publisher_half()
    tuples, keep = _torch.publish_sources(_torch.named_tensors(model))
    py, cxx = [], []
    version = 0

    def python_api() -> float:
        t0 = time.perf_counter()
        m = bridge.publish(model, weight_version=version)
        dt = time.perf_counter() - t0
        bridge.release(m.update_id)
        return dt

    def core() -> float:
        t0 = time.perf_counter()
        m = pub.publish(tuples, version, [], {})
        dt = time.perf_counter() - t0
        pub.release(m.update_id)
        return dt

    for round_ in range(repeat + 1):  # the first round warms the pool and is not counted
        # Which goes first alternates: a fixed order would give one of them the warmer caches.
        times = {}
        for which, call in ((("py", python_api), ("cxx", core)) if round_ % 2 == 0
                            else (("cxx", core), ("py", python_api))):
            version += 1
            times[which] = call()
        if round_ > 0:
            py.append(times["py"])
            cxx.append(times["cxx"])
    del keep
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"mode": "python-publish", "transport": transport, "tensors": len(tuples),
            "bytes": nbytes, "repeat": repeat, "python_api_s": median(py),
            "cxx_publisher_s": median(cxx), "ratio": median(py) / median(cxx), "goal": 1.05,
            "goal_met": median(py) / median(cxx) <= 1.05, "status": "pass"}


def bench_import(model, transport: str, repeat: int) -> Dict:
    pub = wsync.make_weight_bridge(transport, source_worker="bench")
    con = wsync.make_weight_bridge(transport, source_worker="bench")
    # The baseline: the core's import of the same kind of update (segments, no torch views), by
    # a consumer of its own (a consumer imports an update once), in the same rounds.
    core = wsync.make_weight_bridge(transport, source_worker="bench")._consumer_half()
    plain, cxx, verified, first = [], [], [], None
    version = 0

    def python_api(m) -> float:
        t0 = time.perf_counter()
        views = con.import_update(m, verify=False)
        dt = time.perf_counter() - t0
        assert len(views) == len(m.tensors)
        del views
        con.release(m.update_id)
        return dt

    def core_import(m) -> float:
        t0 = time.perf_counter()
        segments = core.import_update(m)
        dt = time.perf_counter() - t0
        del segments
        core.release(m.update_id)
        return dt

    for round_ in range(repeat + 1):  # the first round's own figure is reported apart
        times = {}
        for which, call in ((("py", python_api), ("cxx", core_import)) if round_ % 2 == 0
                            else (("cxx", core_import), ("py", python_api))):
            version += 1
            m = pub.publish(model, weight_version=version)
            times[which] = call(m)
            pub.release(m.update_id)
        if first is None:
            first = times["py"]
        else:
            plain.append(times["py"])
            cxx.append(times["cxx"])
    for v in range(version + 1, version + 1 + repeat):
        m = pub.publish(model, weight_version=v)
        t0 = time.perf_counter()
        views = con.import_update(m, verify=True)
        verified.append(time.perf_counter() - t0)
        del views
        con.release(m.update_id)
        pub.release(m.update_id)
    n = len(model.state_dict())
    return {"mode": "python-import", "transport": transport, "tensors": n, "repeat": repeat,
            "import_s": median(plain), "first_import_s": first,
            "per_tensor_us": median(plain) / n * 1e6, "verified_import_s": median(verified),
            "baseline": {"name": "cxx-import (segments, no torch views)",
                         "seconds": median(cxx)},
            "ratio": median(plain) / median(cxx) if median(cxx) > 0 else None,
            "goal_import_s": 0.002, "goal_met": median(plain) <= 0.002, "status": "pass"}


def bench_install(model, transport: str, repeat: int, layout: str) -> Dict:
    target = layout_module(layout)
    pub = wsync.make_weight_bridge(transport, source_worker="bench")
    ex = wsync.RolloutExecutor(wsync.make_weight_bridge(transport), model=target)
    first = next(iter(target.parameters()))
    stop = threading.Event()
    steps = [0]

    def reader():
        while not stop.is_set():
            with ex.generating():
                float(first.view(-1)[0])  # a (tiny) generation step reading the weights
            steps[0] += 1

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    installs, waits, totals = [], [], []
    try:
        for v in range(1, repeat + 2):
            m = pub.publish(model, weight_version=v)
            ex._handle.reset_longest_wait()
            try:
                ex.update_weights(m)
            finally:
                pub.release(m.update_id)
            r = ex.last_report
            if v > 1:
                installs.append(r["timings"]["install"])
                totals.append(r["timings"]["total"])
                waits.append(ex.longest_wait())
    finally:
        stop.set()
        t.join()
        ex.release_weights()
    return {"mode": "python-install", "transport": transport, "repeat": repeat,
            "install_s": median(installs), "update_total_s": median(totals),
            "longest_gate_wait_s": max(waits), "median_longest_gate_wait_s": median(waits),
            "reader_steps": steps[0], "goal_gate_wait_s": 0.001,
            "goal_met": median(waits) <= 0.001, "status": "pass"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m wsync.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="qwen2.5-0.5b",
                   help="model layout: a checkpoint's name or synthetic:<bytes>:<tensors>")
    p.add_argument("--repeat", type=int, default=5, help="measured rounds per figure")
    p.add_argument("--transport", default="shared-memory", help="wsync transport")
    p.add_argument("--only", choices=["publish", "import", "install"], action="append",
                   help="run only these figures (repeatable)")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    torch.set_num_threads(2)
    want = a.only or ["publish", "import", "install"]
    statuses = []
    try:
        model = layout_module(a.layout)
    except (wsync.WeightSyncError, ValueError, RuntimeError) as e:
        print(json.dumps({"mode": "python-" + want[0], "layout": a.layout, "status": "fail",
                          "blocker": None, "error": str(e)}), flush=True)
        return 1
    for name in want:
        # A figure that fails still prints its row (with the reason) and the next one runs.
        try:
            if name == "publish":
                row = bench_publish(model, a.transport, a.repeat)
            elif name == "import":
                row = bench_import(model, a.transport, a.repeat)
            else:
                row = bench_install(model, a.transport, a.repeat, a.layout)
        except Exception as e:  # noqa: BLE001 -- every failure becomes a row
            blocked = isinstance(e, wsync.BlockedError)
            row = {"mode": "python-" + name, "transport": a.transport,
                   "status": "blocked" if blocked else "fail",
                   "blocker": str(e) if blocked else None}
            if not blocked:
                row["error"] = f"{type(e).__name__}: {e}"
        row["layout"] = a.layout
        statuses.append(row["status"])
        print(json.dumps(row), flush=True)
    return 1 if "fail" in statuses else 2 if "blocked" in statuses else 0


if __name__ == "__main__":
    raise SystemExit(main())
