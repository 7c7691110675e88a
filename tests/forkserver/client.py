"""Run ``python ARGS`` in a process forked from a warm fork server (see ``__init__.py``), or exec Python if none fits.

Started as ``python -S client.py ARGS`` (the ``python`` shim that ``__init__.py`` writes), so it imports nothing
beyond a few standard modules and starts in milliseconds. It stands in for the process it asked for: it hands the
server its argv, environment, working directory, umask, ignored signals and every file descriptor it inherited
(stdin/stdout/stderr, and pipes passed with ``pass_fds``), forwards every signal it gets to the forked process, and
exits as that process exited, with the same code or by the same signal. Killed itself (even by SIGKILL), it closes
its connection, and the server kills the forked process.
"""

import glob
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys

# Signals a parent may send to "the rank" that this process must pass on. SIGKILL and SIGSTOP cannot be caught:
# SIGKILL ends this process, and the server then kills the forked one.
FORWARDED = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]
# A full run of the suite starts a few (every rank shares one: see server.RANK_VARIABLES); each holds a few hundred MB.
MAX_SERVERS = 32
MAX_FDS = 250  # what one message can carry (the kernel's SCM_MAX_FD is 253)

# Variables native code may read while modules load, which the recording of Python-level reads cannot see.
NATIVE_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "OPENMP", "LC_", "LANG", "PYTHON", "CUDA_", "NCCL_",
                   "TORCH_CPP", "TORCH_SHOW", "LD_", "MALLOC", "GLIBC_")
# PYTHONPATH is handled by rebuilding sys.path in the child, as a new interpreter builds it.
NOT_COMPARED = {"PYTHONPATH", "PYTHON_EXEC"}  # PYTHON_EXEC: read by torchrun as it starts ranks
# Modules that read the whole environment at import, looking for variables of one prefix. Their reads are compared
# by that prefix; a module not listed here that scans the environment stops the server from serving at all, since
# then there is no telling which variables a forked process would have read.
SCANNERS = {"tqdm.utils": "TQDM_", "fsspec.config": "FSSPEC_"}


def main() -> None:
    inherited = _open_fds()  # before this process opens any of its own
    argv = sys.argv[1:]
    where = os.environ.get("LFSDP_FORKSERVER_DIR", "")
    if not supported(argv):  # interpreter options: a real Python, and no server to start for it
        os.execv(sys.executable, [sys.executable, *argv])
    pid, conn = _fork_remote(where, argv, inherited) if where and os.path.isdir(where) else (None, None)
    if pid is None:
        # No server fits this environment yet: this run is an ordinary process, and a server starts for the next
        # one, if this environment has asked before (a server's imports cost what a real process's do).
        if where and os.path.isdir(where):
            _note_fallback(where, argv)
            if os.environ.get("LFSDP_FORKSERVER_START", "1") != "0":
                start_server(where, dict(os.environ), at_once=False)
        os.execv(sys.executable, [sys.executable, *argv])
    for sig in FORWARDED:
        try:
            signal.signal(sig, lambda s, _frame: _send_signal(pid, s))
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    status = _read_line(conn)
    if status is None:
        sys.stderr.write(f"forkserver client: the fork server went away while pid {pid} ran ({argv})\n")
        os._exit(255)
    if "signal" in status:
        sig = status["signal"]
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        if sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(status["exit"])


def supported(argv: list) -> bool:
    """``python [-u] SCRIPT ...``, ``python [-u] -m MODULE ...`` or ``python [-u] -c CODE ...``: other interpreter
    options change the interpreter's own start-up, which a forked process has behind it."""
    args = [a for a in argv[:2] if a != "-u"] or [""]
    return bool(args[0]) and (args[0] in ("-m", "-c") or not args[0].startswith("-")) and \
        (args[0] not in ("-m", "-c") or len(argv) > argv.index(args[0]) + 1)


def _send_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _fork_remote(where: str, argv: list[str], inherited: list[int]):
    """Ask each server in turn; the first whose environment fits forks the process, handing it every file descriptor
    this process inherited (stdin/stdout/stderr, and the pipes a parent passes with ``pass_fds``). Signals stay
    blocked until the caller has installed its forwarding handlers, so none is lost in between."""
    if len(inherited) > MAX_FDS:
        return None, None
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    # Ignored signals stay ignored across exec, so a new Python would start with these ignored too.
    ignored = [int(s) for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask(),
                          "ignored": ignored,
                          "fd_numbers": inherited, "executable": os.path.abspath(sys.argv[0])}).encode()
    for path in sorted(glob.glob(os.path.join(where, "*.sock"))):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            fds = struct.pack(f"{len(inherited)}i", *inherited)
            conn.sendmsg([struct.pack("!I", len(request)), request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            reply = _read_line(conn)
        except OSError:
            conn.close()
            continue
        if reply and "pid" in reply:
            return reply["pid"], conn
        if os.environ.get("LFSDP_FORKSERVER_DEBUG"):
            sys.stderr.write(f"forkserver client: {os.path.basename(path)} refused: {reply}\n")
        _BUFFERS.pop(conn.fileno(), None)
        conn.close()
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    return None, None


def _note_fallback(where: str, argv: list[str]) -> None:
    """One line per real process, for the session's summary (``__init__.summary``)."""
    try:
        fd = os.open(os.path.join(where, "real-processes.txt"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, (json.dumps(argv[:3]) + "\n").encode())
        os.close(fd)
    except OSError:
        pass


def start_server(where: str, env: dict, at_once: bool = True) -> str | None:
    """Start a server for ``env``, unless one is already starting for it or there are enough; return its name.

    ``at_once=False``: only on the second request of this environment, so that an environment asked for once in a
    session (one test's odd variable) costs one real process, not that and a server's imports as well."""
    if len(glob.glob(os.path.join(where, "*.log"))) >= MAX_SERVERS:  # one log per server ever started
        return None
    name = server_name(where, env)
    if os.path.exists(os.path.join(where, f"{name}.refused")):
        return None
    if any(os.path.exists(os.path.join(where, f"{name}.{end}")) for end in ("sock", "alias")):
        return name  # serving already
    if not at_once and _claim(where, f"{name}.asked"):
        return None  # the first request of this environment: a real process, and no server yet
    if not _claim(where, f"{name}.starting"):
        return name  # starting already
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")
    with open(os.path.join(where, f"{name}.log"), "ab") as log:
        # A session of its own, so that a signal to this process's group (torchrun stops a rank that way) never
        # reaches the server; no inherited pipes, so that whoever reads this process's output sees it end.
        subprocess.Popen([sys.executable, server, where, name], env=env, stdin=subprocess.DEVNULL, stdout=log,
                         stderr=log, start_new_session=True, close_fds=True)
    return name


def server_name(where: str, env: dict) -> str:
    """The name of the server for ``env``: a hash of the variables a server compares a request by (those the
    servers' imports read, and those native code or a scanner may read), so that one name is one environment and a
    name that serves already needs no second server (before, each prewarm of a served environment started another,
    4-5 s of imports each, and its socket took the first one's place)."""
    keys = set()
    for path in glob.glob(os.path.join(where, "keys-*.json")):
        try:
            with open(path) as f:
                keys.update(json.load(f))
        except (OSError, ValueError):
            pass
    keys |= {k for k in env if k.startswith(NATIVE_PREFIXES + tuple(SCANNERS.values()))}
    from_env = {k: env.get(k) for k in sorted(keys - NOT_COMPARED)}
    return hashlib.sha1(json.dumps(from_env, sort_keys=True).encode()).hexdigest()[:16]


def _claim(where: str, file: str) -> bool:
    """Create ``file`` in ``where``: True for the one process that created it, False for every later one."""
    try:
        os.close(os.open(os.path.join(where, file), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _open_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))  # the listing's own descriptor is closed by now
        except OSError:
            continue
        fds.append(int(name))
    return sorted(fds)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_BUFFERS: dict = {}


def _read_line(conn: socket.socket):
    """The next JSON line from the server, or None once it closed the connection."""
    data = _BUFFERS.get(conn.fileno(), b"")
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            return None
        data += chunk
    line, _BUFFERS[conn.fileno()] = data.split(b"\n", 1)
    return json.loads(line)


if __name__ == "__main__":
    main()
