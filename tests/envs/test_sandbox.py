"""The Python sandbox: a normal program works; escapes and runaways are refused or killed.

Every refusal test runs twice: through `run_python` (namespaces where the machine allows, as
`isolation_mechanism()` says) and through the rlimits + audit-hook fallback, and checks the
refusal on the host side (the file is not there, the server saw no connection, nothing survives).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from skyrl_trainer.envs import sandbox
from skyrl_trainer.envs.sandbox import SandboxLimits, isolation_mechanism, run_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox targets Linux")

PROJECT = Path(__file__).resolve().parents[2]
SMALL = SandboxLimits(cpu_s=1, wall_s=3, memory_mb=256, output_bytes=4096, max_processes=8)


@pytest.fixture(params=["auto", "rlimits"])
def run(request):
    """run(code, limits=SMALL, files=None) -> SandboxResult in the mode under test."""
    if request.param == "auto":
        return lambda code, limits=SMALL, files=None: run_python(code, limits, files)
    return lambda code, limits=SMALL, files=None: sandbox._run(code, limits, files, "rlimits")[0]


def _userns_work() -> bool:
    unshare = shutil.which("unshare")
    return (
        bool(unshare)
        and subprocess.run([unshare, "-Urn", "true"], capture_output=True).returncode == 0
    )


def test_mechanism_is_namespaces_where_user_namespaces_work():
    mechanism = isolation_mechanism()
    assert mechanism and "\n" not in mechanism
    if not _userns_work():
        pytest.skip(f"no user namespaces here; mechanism: {mechanism}")
    assert mechanism.startswith("Linux namespaces"), mechanism
    assert "net" in mechanism and "pid" in mechanism and "mount" in mechanism


def test_normal_program_works(run):
    code = """
import fractions, json, math, os, re
print(math.isqrt(1080 ** 2), json.dumps({"a": 1}), re.sub("b", "c", "abc"), fractions.Fraction(3, 6))
print(open("data/numbers.txt").read().split())
with open("out.txt", "w") as f:
    f.write("written")
print(open("out.txt").read(), sorted(os.listdir(".")))
print("cwd", os.getcwd())
"""
    r = run(code, files={"data/numbers.txt": "4 8 15"})
    assert r.returncode == 0 and r.error is None and not r.timed_out, r
    lines = r.stdout.splitlines()
    assert lines[0] == '1080 {"a": 1} acc 1/2'
    assert lines[1] == "['4', '8', '15']"
    assert lines[2] == "written ['data', 'out.txt']"
    cwd = lines[3].split(" ", 1)[1]
    assert not os.path.exists(os.path.join(cwd, "out.txt"))  # the work dir is gone afterwards


def test_exception_is_a_normal_exit_with_stderr(run):
    r = run("print('before')\n1 / 0")
    assert r.returncode == 1 and r.error is None and r.stdout == "before\n"
    assert r.stderr.strip().endswith("ZeroDivisionError: division by zero")


def test_cannot_write_outside_its_directory(run, tmp_path):
    token = uuid.uuid4().hex
    targets = [
        f"/tmp/skyrl-escape-{token}",
        str(PROJECT / f"escape-{token}.txt"),
        str(tmp_path / "x"),
    ]
    code = f"""
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("WROTE", path)
    except OSError as exc:
        print("refused", type(exc).__name__)
"""
    r = run(code)
    for target in targets:
        assert not os.path.exists(target), f"the sandbox wrote {target}"
    assert "WROTE" not in r.stdout and r.stdout.count("refused") == len(targets), r


def test_cannot_read_project_files(run):
    secret_marker = "[tool.ruff]"  # in pyproject.toml
    assert secret_marker in (PROJECT / "pyproject.toml").read_text()
    paths = [str(PROJECT / "pyproject.toml"), str(Path(__file__).resolve()), "/etc/passwd"]
    code = f"""
import os
for path in {paths!r}:
    try:
        print("READ", open(path).read())
    except OSError as exc:
        print("refused", type(exc).__name__)
try:
    print("LISTED", os.listdir({str(PROJECT)!r}))
except OSError as exc:
    print("refused", type(exc).__name__)
"""
    r = run(code)
    assert secret_marker not in r.stdout and "READ" not in r.stdout
    assert "LISTED" not in r.stdout and r.stdout.count("refused") == len(paths) + 1, r


def test_no_network(run):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.3)
    port = server.getsockname()[1]
    code = f"""
try:
    import socket  # (the fallback refuses the import already)

    s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
    s.sendall(b"hello")
    print("CONNECTED")
except OSError as exc:
    print("refused", type(exc).__name__, exc)
"""
    try:
        r = run(code)
        with pytest.raises(TimeoutError):
            server.accept()  # nobody came
    finally:
        server.close()
    assert "CONNECTED" not in r.stdout and r.stdout.startswith("refused"), r


def _survivors(since: float) -> list[psutil.Process]:
    """Processes started since `since` that run a sandboxed program."""
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["create_time"] >= since - 1 and ("main.py" in cmd or "sandbox_child" in cmd):
            found.append(proc)
    return found


def test_fork_bomb_is_stopped_and_leaves_nothing_behind(run):
    since = time.time()
    code = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    start = time.monotonic()
    r = run(code, SandboxLimits(cpu_s=1, wall_s=2, max_processes=8))
    assert time.monotonic() - start < 2 + 3
    # namespaces: forks fail at the process limit, the loop goes on until the wall-clock kill;
    # the fallback refuses every fork, so the loop spins until the cpu limit kills it
    assert r.returncode is None or r.returncode < 0, r
    assert r.error and ("wall-clock" in r.error or r.error.startswith("cpu time limit")), r
    assert _survivors(since) == []


def test_process_limit_and_sleeping_children_are_killed(run):
    since = time.time()
    code = """
import os, time
for n in range(100):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    print("forked", n + 1)
"""
    r = run(code, SandboxLimits(cpu_s=1, wall_s=5, max_processes=8))
    forked = r.stdout.count("forked")
    assert forked < 8 and r.returncode == 1 and not r.timed_out, r
    assert ("Resource temporarily unavailable" in r.stderr and "process limit" in r.error) or (
        "PermissionError" in r.stderr and forked == 0  # the fallback refuses fork outright
    ), r
    assert _survivors(since) == []


def test_runaway_memory_is_refused(run):
    r = run("x = bytearray(2 * 1024**3)\nprint('ALLOCATED')")
    assert "ALLOCATED" not in r.stdout and r.returncode != 0
    assert r.error and "memory" in r.error, r


def test_cpu_runaway_is_killed(run):
    start = time.monotonic()
    r = run("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=10))
    assert time.monotonic() - start < 1 + 2.5
    assert not r.timed_out and r.error and r.error.startswith("cpu time limit"), r


def test_wall_clock_limit_kills_a_sleeper(run):
    start = time.monotonic()
    r = run("import time\nprint('start')\ntime.sleep(30)", SandboxLimits(wall_s=1))
    assert time.monotonic() - start < 1 + 2
    assert (
        r.timed_out and r.returncode is None and r.stdout == "start\n" and "wall-clock" in r.error
    )


def test_output_flood_is_truncated(run):
    start = time.monotonic()
    r = run("print('x' * 10**8)", SandboxLimits(output_bytes=1000))
    assert time.monotonic() - start < 3
    assert r.output_truncated and len(r.stdout.encode()) == 1000 and set(r.stdout) == {"x"}
    assert r.error and "output limit" in r.error, r


def test_concurrent_runs_have_their_own_process_limit():
    code = "import os\nfor _ in range(5):\n    if os.fork() == 0:\n        os._exit(0)\n    os.wait()\nprint('ok')"
    results = [None] * 4

    def go(i):
        results[i] = run_python(code, SandboxLimits(max_processes=4))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.stdout == "ok\n" and r.error is None for r in results), results


def test_overhead_of_a_call_is_small():
    run_python("print(1)")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        assert run_python("print(1)").stdout == "1\n"
        times.append(time.perf_counter() - start)
    assert sorted(times)[1] < 1.0, times


def test_bad_arguments():
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=1.5)
    for name in ("/etc/x", "../x", "a/../../x"):
        with pytest.raises(ValueError, match="relative path"):
            run_python("pass", files={name: "x"})
    with pytest.raises(TypeError):
        run_python(b"print(1)")
