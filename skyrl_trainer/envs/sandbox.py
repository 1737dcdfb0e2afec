"""Run model-written Python in a sandbox: `run_python(code, limits, files) -> SandboxResult`.

Every call starts a fresh launcher (`sandbox_child.py`, run by the base interpreter with `-I -S`)
that puts the program in its own Linux namespaces: a private root holding only the interpreter,
its stdlib and the system libraries (read-only), /dev/null & co., a throwaway size-limited tmpfs
work dir (`files` are written there first; it vanishes with the namespace), no network
interfaces, its own pid namespace (killing its init kills every descendant), uid 65534 with no
capabilities, and rlimits on CPU time, memory, processes and file size. The trainer enforces the
output limit (the program is killed once a stream passes `output_bytes`) and backs up the
launcher's wall-clock kill.

Where namespaces are not available, the fallback is rlimits, uid 65534 when root, its own process
group and an audit hook refusing opens outside the work dir, sockets and new processes; what this
machine gets is `isolation_mechanism()`, decided by a probe on first use.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import marshal
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "SandboxResult", "isolation_mechanism", "run_python"]

_CHILD = Path(__file__).with_name("sandbox_child.py")
_NOBODY = 65534
_GRACE_S = 5.0  # how long past wall_s the trainer waits before killing the launcher itself


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. CPU time is whole seconds, rounded up; memory is address space; a program
    is killed once stdout or stderr passes `output_bytes`; `file_size_mb` bounds each file and
    (namespaces) the work dir in total; `max_processes` counts threads too."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 256
    output_bytes: int = 16384
    max_processes: int = 16
    file_size_mb: int = 16

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kind = (int, float) if field.type == "float" else int
            if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
                raise ValueError(
                    f"SandboxLimits.{field.name} must be a positive {field.type}, got {value!r}"
                )


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # None when the sandbox killed the program or never started it
    timed_out: bool
    output_truncated: bool
    error: str | None  # why it was killed/refused (or the limit it hit); None on a normal exit


def run_python(
    code: str, limits: SandboxLimits = SandboxLimits(), files: dict[str, str] | None = None
) -> SandboxResult:
    """Run `code` (as a script, `__name__ == "__main__"`) in the sandbox, with `files` (relative
    path -> text) in its working directory. Never raises for anything the program does."""
    return _run(code, limits, files, _probe()[0])[0]


def isolation_mechanism() -> str:
    """One line: the isolation `run_python` gets on this machine."""
    return _probe()[1]


@functools.cache
def _probe() -> tuple[str, str]:
    """("namespaces" | "rlimits", description), from running `print(1)` in namespaces once."""
    why = f"platform {sys.platform}"
    if sys.platform == "linux":
        result, notes = _run("print(1)", SandboxLimits(), None, "namespaces")
        if result.stdout == "1\n" and result.returncode == 0:
            users = (
                "user, "
                if os.geteuid() != 0 or not any("no user namespace" in n for n in notes)
                else ""
            )
            return "namespaces", "; ".join(
                [
                    f"Linux namespaces ({users}mount, pid, net, ipc, uts, cgroup)",
                    "private tmpfs root with only python, its stdlib and system libraries (read-only)",
                    "tmpfs work dir, no network interfaces",
                    "uid 65534 (nobody)" if os.geteuid() == 0 else "uid 65534 (ours, mapped)",
                    "no capabilities, no_new_privs",
                    "rlimits (cpu, memory, processes, file size), wall-clock and output kill",
                    *notes,
                ]
            )
        why = result.error or result.stderr.strip()[-300:] or f"printed {result.stdout!r}"
    if os.geteuid() != 0:
        user = "our own uid"
    elif _nobody_can_run():
        user = "uid 65534"
    else:
        user = "uid 0 (uid 65534 cannot reach the interpreter)"
    return "rlimits", (
        f"NO namespaces ({why}): rlimits, {user}, its own process group, and an audit hook "
        "refusing opens outside the work dir, sockets and subprocesses (best effort)"
    )


@functools.cache
def _interpreter() -> tuple[str, tuple[str, ...]]:
    """The base interpreter (not the venv's) and what must be bound into the sandbox for it."""
    exe = os.path.join(sys.base_prefix, "bin", "python{}.{}".format(*sys.version_info[:2]))
    exe = os.path.realpath(exe if os.path.isfile(exe) else sys.executable)
    paths = {exe, os.path.realpath(os.path.dirname(os.__file__))}
    paths |= {os.path.realpath(p) for p in sys.path if p.endswith("lib-dynload")}
    libs = [os.path.join(*(sysconfig.get_config_var(v) or "" for v in ("LIBDIR", "INSTSONAME")))]
    if os.path.exists("/proc/self/maps"):  # libpython as actually loaded (a relocated build)
        with open("/proc/self/maps") as maps:
            libs += [line.split()[-1] for line in maps if "/libpython" in line]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        paths |= {os.path.realpath(lib) for lib in libs if os.path.isfile(lib)}
    for lib in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if os.path.isdir(lib) and not os.path.islink(lib):
            paths.add(lib)
    if os.path.isfile("/etc/ld.so.cache"):  # finds libraries outside the default directories
        paths.add("/etc/ld.so.cache")
    binds = tuple(p for p in sorted(paths) if not any(p.startswith(q + "/") for q in paths))
    return exe, binds


@functools.cache
def _nobody_can_run() -> bool:
    """Whether uid 65534 can reach the interpreter and its libraries (not under /root, say)."""
    exe, binds = _interpreter()
    for path in (exe, *binds):
        parts = Path(path).parts
        for i in range(2, len(parts)):  # the directories on the way: searchable by others
            if not os.stat(os.path.join(*parts[:i])).st_mode & 0o001:
                return False
        need = 0o005 if path == exe or os.path.isdir(path) else 0o004  # r-x / r--
        if os.stat(path).st_mode & need != need:
            return False
    return True


def _check_files(files: dict[str, str] | None) -> dict[str, str]:
    checked = {}
    for name, text in (files or {}).items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise TypeError(f"files must map str paths to str contents, got {name!r}")
        norm = os.path.normpath(name)
        if os.path.isabs(norm) or norm.split(os.sep)[0] in ("..", ".", "") or "\0" in norm:
            raise ValueError(f"files: {name!r} is not a relative path inside the work dir")
        checked[norm] = text
    return checked


def _run(
    code: str, limits: SandboxLimits, files: dict[str, str] | None, mode: str
) -> tuple[SandboxResult, list[str]]:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    exe, binds = _interpreter()
    req = {"mode": mode, "code": code, "files": _check_files(files), "python": exe}
    req.update(binds=binds, limits=dataclasses.asdict(limits))
    req["drop_uid"] = os.geteuid() == 0 and _nobody_can_run()
    tmp = None
    try:
        if mode == "rlimits":  # a host work dir, deleted afterwards
            tmp = tempfile.mkdtemp(prefix="skyrl-sandbox-")
            req.update(work=os.path.join(tmp, "work"), program=os.path.join(tmp, "main.py"))
            os.mkdir(req["work"])
            for name, text in {**req["files"], "../main.py": code}.items():
                path = os.path.normpath(os.path.join(req["work"], name))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                Path(path).write_text(text)
            if req["drop_uid"]:
                os.chmod(tmp, 0o711)
                os.chmod(req["program"], 0o644)
                for parent, dirs, names in os.walk(req["work"]):
                    for name in [*dirs, *names, "."]:
                        os.chown(os.path.join(parent, name), _NOBODY, _NOBODY)
        return _launch(req, limits)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _launch(req: dict, limits: SandboxLimits) -> tuple[SandboxResult, list[str]]:
    status_r, status_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [req["python"], "-I", "-S", "-B", str(_CHILD), str(status_w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
            env={},
            cwd="/",
        )
    except OSError as exc:
        os.close(status_r)
        return SandboxResult("", "", None, False, False, f"sandbox launch failed: {exc}"), []
    finally:
        os.close(status_w)
    try:
        with proc.stdin:
            proc.stdin.write(marshal.dumps(req))
    except BrokenPipeError:
        pass
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
    truncated = stopped = killed = False
    deadline = time.monotonic() + limits.wall_s + _GRACE_S
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if killed:
                    break
                killed = True  # the launcher did not stop it: kill the launcher (init follows)
                os.killpg(proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + _GRACE_S
            for key, _ in sel.select(max(left, 0.0)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                room = len(chunk) if key.fd == status_r else limits.output_bytes - len(buf)
                buf += chunk[: max(room, 0)]
                if len(chunk) > room:
                    truncated = True
                    if not stopped:
                        stopped = True
                        proc.send_signal(signal.SIGTERM)  # the launcher kills the program
    try:
        proc.wait(timeout=_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    os.close(status_r)
    info, notes = {}, []
    for line in bufs[status_r].decode(errors="replace").splitlines():
        try:
            entry = ast.literal_eval(line)
        except (ValueError, SyntaxError):
            continue
        notes += [entry["note"]] if "note" in entry else []
        info.update({k: v for k, v in entry.items() if k != "note"})
    status = info.get("status")
    result = SandboxResult(
        stdout=bufs[out_fd].decode(errors="replace"),
        stderr=bufs[err_fd].decode(errors="replace"),
        returncode=None,
        timed_out=bool(info.get("timed_out")) or killed,
        output_truncated=truncated,
        error=None,
    )
    if status is not None and not (result.timed_out or stopped):
        result.returncode = os.waitstatus_to_exitcode(status)
    result.error = _explain(result, info, stopped, limits)
    return result, notes


def _explain(result: SandboxResult, info: dict, stopped: bool, limits: SandboxLimits) -> str | None:
    """Why the program was killed or refused, or which limit it ran into; None otherwise."""
    rc = result.returncode
    last = result.stderr.strip().rsplit("\n", 1)[-1]
    if info.get("error"):
        return info["error"]
    if result.timed_out:
        return f"wall-clock limit exceeded ({limits.wall_s:g} s): killed"
    if stopped:
        return f"output limit exceeded ({limits.output_bytes} bytes): killed"
    if rc is None:
        return "the sandbox ended without reporting the program's exit"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        cpu = info.get("cpu_s", 0.0)
        if -rc == signal.SIGXCPU or (
            -rc == signal.SIGKILL and cpu >= 0.9 * math.ceil(limits.cpu_s)
        ):
            return f"cpu time limit exceeded ({cpu:.1f} s of {limits.cpu_s:g} s): killed by {name}"
        return f"killed by {name}"
    if rc and last.startswith("MemoryError"):
        return f"memory limit exceeded ({limits.memory_mb} MB): {last}"
    if rc and "Resource temporarily unavailable" in last:
        return f"process limit reached ({limits.max_processes}): {last}"
    if rc and "File too large" in last:
        return f"file size limit exceeded ({limits.file_size_mb} MB): {last}"
    return None
