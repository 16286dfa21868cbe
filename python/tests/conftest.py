"""Shared test setup. ctest runs each file through run.py, which skips it (with the reason) when
the interpreter lacks torch or the built module."""

import glob
import os
import shutil
import subprocess
import tempfile
import time

import pytest

import torch  # noqa: F401  (tests/run.py skips the file when torch or wsync is missing)
import wsync  # noqa: F401


def wsync_bin() -> str:
    path = os.environ.get("WSYNC_BIN", "")
    if not path or not os.access(path, os.X_OK):
        pytest.skip("WSYNC_BIN (the wsync binary) is not set; ctest sets it")
    return path


def shm_entries(pids=None) -> set:
    """wsync segments in /dev/shm, only those created by `pids` when given (segment names start
    with their creator's pid: other tests may hold segments of their own meanwhile)."""
    found = set(glob.glob("/dev/shm/wsync-*"))
    if pids is None:
        return found
    prefixes = tuple(f"/dev/shm/wsync-{p}-" for p in pids)
    return {f for f in found if f.startswith(prefixes)}


class Coordinator:
    """A `wsync coordinator` on a free loopback port with a fresh token."""

    def __init__(self, deadline_ms: int = 30000, port: int = 0, token: str = "",
                 args: tuple = ()) -> None:
        self.dir = tempfile.mkdtemp(prefix="wsync-py-")
        self.token = token or os.urandom(16).hex()
        port_file = os.path.join(self.dir, "port")
        env = dict(os.environ, WSYNC_TOKEN=self.token)
        self.log = open(os.path.join(self.dir, "coordinator.log"), "w")
        self.proc = subprocess.Popen(
            [wsync_bin(), "coordinator", "--host", "127.0.0.1", "--port", str(port), "--port-file",
             port_file, "--update-deadline-ms", str(deadline_ms), *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        limit = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if self.proc.poll() is not None or time.monotonic() > limit:
                raise RuntimeError("coordinator did not start: "
                                   + open(os.path.join(self.dir, "coordinator.log")).read())
            time.sleep(0.02)
        self.address = f"127.0.0.1:{open(port_file).read().strip()}"

    def env(self) -> dict:
        return dict(os.environ, WSYNC_COORDINATOR=self.address, WSYNC_TOKEN=self.token)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def coordinator():
    c = Coordinator()
    yield c
    c.stop()
