"""The sandbox's launcher: `python -I -S -B sandbox_child.py STATUS_FD`, the request on stdin.

Started fresh for every `sandbox.run_python` call (never imported by the trainer), so it is a
single-threaded process that may fork and unshare safely. Stdlib only. The request is a marshalled
dict (the same interpreter reads it); it reports one dict literal per line on STATUS_FD:
`{"note": ...}`, `{"error": ...}` (setup refused), `{"status": wait_status, "cpu_s": ...}` (the
program's exit) and `{"timed_out": True}`.

Mode "namespaces": new mount, pid, net, ipc, uts and cgroup namespaces (plus a user namespace when
not root). The pid namespace's init (this script, forked) builds a fresh tmpfs root holding
read-only binds of only the interpreter, its stdlib and the system libraries, /dev/{null,zero,
random,urandom}, /proc of the new pid namespace and a size-limited tmpfs work dir, pivots into it
and forks the program: uid 65534, no capabilities, rlimits. Killing init kills every process in
the namespace, and its parent's wait returns only once they are all gone.

Mode "rlimits" (no namespaces on this machine): rlimits, uid 65534 when root (`drop_uid`), its own
process group, and an audit hook (`_PREAMBLE`) that refuses opens outside the work dir, sockets and new
processes. Weaker: a determined program can get around an audit hook.
"""

import _signal as signal  # not `signal`: its enums cost milliseconds at every start
import ctypes
import marshal
import math
import os
import resource
import sys

NOBODY = 65534
WORK = "/sandbox"
PROGRAM = "/main.py"
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x20000, 0x2000000, 0x4000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x8000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}
# statvfs flag -> mount flag for the flags a bind mount keeps (a user namespace may not drop them)
_KEEP = ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, 1024), (2048, 2048))
_BLOCKED = {signal.SIGALRM, signal.SIGTERM}

_libc = ctypes.CDLL(None, use_errno=True)
_status_fd = -1


def report(**fields) -> None:
    os.write(_status_fd, (repr(fields) + "\n").encode())


def _call(name: str, *args, what: str = "") -> None:
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name} {what}".strip() + f": {os.strerror(err)}")


def _b(s):
    return None if s is None else os.fsencode(s)


def mount(src, dst, fstype, flags, data=None) -> None:
    _call("mount", _b(src), _b(dst), _b(fstype), ctypes.c_ulong(flags), _b(data), what=dst)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _bind(src: str, dst: str, flags: int) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "w").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    have = os.statvfs(dst).f_flag
    keep = sum(ms for st, ms in _KEEP if have & st)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_NOSUID | flags | keep)


def build_root(req: dict) -> None:
    """In a new mount namespace: a tmpfs root with only what the program needs, then pivot."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _call("sethostname", b"sandbox", 7)  # (in the new uts namespace)
    root = "/tmp"
    mount(
        "tmpfs",
        root,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={len(req['code'].encode()) // 1024 + 256}k,nr_inodes=1024,mode=755",
    )
    for name in ("bin", "lib", "lib32", "lib64", "sbin"):
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), f"{root}/{name}")
    for src in req["binds"]:
        _bind(src, root + src, MS_RDONLY | MS_NODEV)
    for dev in ("null", "zero", "random", "urandom"):
        _bind("/dev/" + dev, f"{root}/dev/{dev}", MS_NOEXEC)
    os.mkdir(root + "/proc")
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:
        report(note=f"no /proc ({exc.strerror})")
    work, files = root + WORK, req["files"]
    size_kb = (
        req["limits"]["file_size_mb"] * 1024
        + sum(len(t.encode()) for t in files.values()) // 1024
        + 64
    )
    os.mkdir(work)
    mount(
        "tmpfs",
        work,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={size_kb}k,nr_inodes=4096,mode=700,uid={NOBODY},gid={NOBODY}",
    )
    write_files(work, files)
    _write(root + PROGRAM, req["code"])
    os.chmod(root + PROGRAM, 0o644)
    os.chdir(root)
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is not None and _libc.syscall(number, b".", b".") == 0:
        _call("umount2", b".", MNT_DETACH)  # the old root, stacked under the new one, goes away
    else:
        os.chroot(".")
        report(note="chroot instead of pivot_root")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def write_files(work: str, files: dict) -> None:
    for rel, text in files.items():
        path = os.path.join(work, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write(path, text)
    for parent, dirs, names in os.walk(work):
        for name in [*dirs, *names, None]:
            os.chown(parent if name is None else os.path.join(parent, name), NOBODY, NOBODY)


def drop_privileges(own_userns: bool) -> None:
    """As root: become uid/gid 65534 with no groups, then (own_userns) enter a fresh user namespace
    so RLIMIT_NPROC counts this sandbox's processes only, not every uid-65534 process."""
    try:  # noqa: SIM105 - the user namespace's parent-level process limit is ours: raise it
        resource.setrlimit(resource.RLIMIT_NPROC, (resource.RLIM_INFINITY,) * 2)
    except (ValueError, OSError):
        pass  # no CAP_SYS_RESOURCE: keep the current (host) limit
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    # (a uid change makes /proc/self root's until exec; dumpable makes it ours again)
    _call("prctl", PR_SET_DUMPABLE, 1, 0, 0, 0)
    if own_userns:
        try:
            _call("unshare", CLONE_NEWUSER)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{NOBODY} {NOBODY} 1")
            _write("/proc/self/gid_map", f"{NOBODY} {NOBODY} 1")
        except OSError as exc:
            report(note=f"process limit counts all uid-65534 processes (no user namespace: {exc})")


def exec_program(req: dict, argv: list[str], cwd: str, extra_procs: int) -> None:
    """In the forked child: limits, then exec the interpreter. Never returns."""
    try:
        lim = req["limits"]
        cpu = max(1, math.ceil(lim["cpu_s"]))
        mb = 1 << 20
        for res, value in (
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (lim["memory_mb"] * mb,) * 2),
            (resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mb,) * 2),
            (resource.RLIMIT_NPROC, (lim["max_processes"] + extra_procs,) * 2),
            (resource.RLIMIT_NOFILE, (256, 256)),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            resource.setrlimit(res, value)
        _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.chdir(cwd)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        env = {"HOME": cwd, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": cwd}
        os.execve(req["python"], [req["python"], "-I", "-S", "-B", "-u", "-X", "utf8", *argv], env)
    except BaseException as exc:  # noqa: BLE001 - anything here is a setup failure to report
        report(error=f"sandbox setup failed: {exc}")
    os._exit(127)


def supervise(pid: int, wall_s: float, kill) -> tuple[int, float]:
    """Wait for `pid`, calling `kill()` after `wall_s` or on SIGTERM (the trainer's request)."""
    state = {"timed_out": False}

    def on_alarm(*_):
        state["timed_out"] = True
        kill()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, lambda *_: kill())
    signal.setitimer(signal.ITIMER_REAL, wall_s)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _BLOCKED)
    _, status, usage = os.wait4(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if state["timed_out"]:
        report(timed_out=True)
    return status, usage.ru_utime + usage.ru_stime


def _kill(pid: int, group: bool = False) -> None:
    try:  # noqa: SIM105 - (contextlib costs a few ms at every start)
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_namespaces(req: dict) -> None:
    root = os.geteuid() == 0
    flags = (
        CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    )
    if root:
        try:
            _call("unshare", flags)
        except OSError:  # root without CAP_SYS_ADMIN: go on as uid 65534, if it can run python
            if not req["drop_uid"]:
                raise
            drop_privileges(own_userns=False)
            root = False
    if not root:  # an unprivileged user namespace, in which we are uid 65534 (mapped to our own)
        uid, gid = os.geteuid(), os.getegid()
        _call("unshare", flags | CLONE_NEWUSER)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{NOBODY} {uid} 1")
        _write("/proc/self/gid_map", f"{NOBODY} {gid} 1")
    signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    init = os.fork()
    if init == 0:  # pid 1 of the new pid namespace
        try:
            _call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            build_root(req)
        except BaseException as exc:  # noqa: BLE001
            report(error=f"sandbox setup failed: {exc}")
            os._exit(70)
        program = os.fork()
        if program == 0:
            if root:
                drop_privileges(own_userns=True)
            # without root the user namespace also holds this launcher and init: 2 more processes
            exec_program(req, [PROGRAM], WORK, extra_procs=0 if root else 2)
        while True:  # reap everything; when the program exits, so does init, killing the rest
            pid, status, usage = os.wait4(-1, 0)
            if pid == program:
                report(status=status, cpu_s=usage.ru_utime + usage.ru_stime)
                os._exit(0)
    supervise(init, req["limits"]["wall_s"], lambda: _kill(init))


_PREAMBLE = r"""
import os, sys
def _sandbox(program, work, *readable):
    source = open(program, encoding="utf-8").read()
    real, fsdecode = os.path.realpath, os.fsdecode
    rw = (real(work),)
    ro = rw + tuple(real(p) for p in readable) + ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    denied = ("socket.", "subprocess.", "os.fork", "os.posix_spawn", "os.spawn", "os.exec",
              "os.system", "os.kill", "os.killpg", "ctypes.", "pty.", "signal.pthread_kill")
    modules = ("_posixsubprocess", "_ctypes", "_socket")  # would bypass the events above
    reading = ("os.listdir", "os.scandir", "os.chdir")
    changing = ("os.mkdir", "os.remove", "os.rename", "os.rmdir", "os.symlink", "os.link",
                "os.chmod", "os.chown", "os.truncate", "os.utime", "os.mkfifo", "os.mknod",
                "os.setxattr", "os.removexattr", "shutil.")
    def inside(path, roots):
        p = real(fsdecode(path))
        return any(p == r or p.startswith(r + "/") for r in roots)
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            if not inside(path, rw if (flags or 0) & writing or (mode and mode.strip("rbt")) else ro):
                raise PermissionError(f"sandbox: {path!r} is outside the sandbox")
        elif event.startswith(denied) or (event == "import" and args[0] in modules):
            raise PermissionError(f"sandbox: {event} {args[0] if event == 'import' else ''} is not allowed")
        elif event.startswith(reading + changing):
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg, ro if event in reading else rw):
                    raise PermissionError(f"sandbox: {event} {arg!r} is outside the sandbox")
    sys.addaudithook(hook)
    sys.argv = [program]
    exec(compile(source, program, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
_sandbox(*sys.argv[1:])
"""


def run_rlimits(req: dict) -> None:
    work, program = req["work"], req["program"]
    signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if req["drop_uid"]:
            drop_privileges(own_userns=False)
        exec_program(req, ["-c", _PREAMBLE, program, work, *req["binds"]], work, extra_procs=0)
    status, cpu_s = supervise(pid, req["limits"]["wall_s"], lambda: _kill(pid, group=True))
    _kill(pid, group=True)  # anything the program left behind in its process group
    report(status=status, cpu_s=cpu_s)


def main() -> None:
    global _status_fd
    _status_fd = int(sys.argv[1])
    os.set_inheritable(_status_fd, False)
    os.umask(0o022)
    req = marshal.loads(sys.stdin.buffer.read())
    try:
        (run_namespaces if req["mode"] == "namespaces" else run_rlimits)(req)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        report(error=f"sandbox setup failed: {exc}")
    os._exit(0)  # (skip the interpreter's teardown)


if __name__ == "__main__":
    main()
