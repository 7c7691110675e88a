"""A warm Python for the test suite: imports torch and Lightning once, then forks a process per request.

``python server.py DIR NAME`` imports what every worker imports (several seconds on the reference machine), listens
on ``DIR/NAME.sock`` and, for each client (``client.py``) whose environment fits its own, forks a child that becomes
the process the client stands for: ``python ARGS`` with the client's argv, environment, working directory, umask,
ignored signals and inherited file descriptors. The child then runs like a fresh interpreter that had imported the
same modules: a new ``__main__``, ``sys.path`` rebuilt from the script and ``PYTHONPATH``, the signal handlers an interpreter starts
with, new random seeds (Python's, NumPy's and torch's), and the interpreter's own exit (atexit handlers, exit code).

"Fits" is strict. While it imports, the server records every environment variable Python code reads; a request
fits only if those variables, and every variable that native code may read at load (``OMP_*``, ``PYTHON*``, locale,
...), have the values the server started with. Anything else, such as another ``RANK`` (Lightning reads it at
import), gets a refusal, and the client runs an ordinary Python instead. The server exits when its owner (the
pytest process, ``LFSDP_FORKSERVER_OWNER``) is gone, and its children die with it.
"""

import atexit
import ctypes
import fcntl
import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import types

# NATIVE_PREFIXES, NOT_COMPARED, SCANNERS: what a request is compared by; the client names a server by the same.
from client import NATIVE_PREFIXES, NOT_COMPARED, SCANNERS, server_name, supported  # this folder is sys.path[0]

del sys.modules["client"]  # no module of this folder in a forked process, as in a fresh one

# What every worker imports anyway (``lightning_fsdp`` imports all of it), so that a forked process has no module a
# fresh one would lack. Not ``lightning_fsdp`` itself: it is the code under test, and it reads variables at import.
# Not ``torch.distributed.run``: ``python -m`` warns when the module it runs is imported already.
PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "lightning", "lightning.fabric", "lightning.pytorch"]
PR_SET_PDEATHSIG = 1
# Extensions built with nanobind, which lists at exit the objects of theirs still alive: triton, which torch's CUDA
# wheels (the newest-torch CI leg) bring and Lightning's imports load.
LEAK_CHECKED = ("triton",)


# The variables that give a process its rank. At import, Lightning and torchmetrics read them only to set the rank
# their rank-zero-only functions compare with 0, so one server serves every rank: a forked child sets those ranks
# again from its own environment (``_set_ranks``). Where any other module reads one of them at import, it is compared
# like every other variable, and each rank needs a server of its own.
RANK_VARIABLES = {"RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"}
RANK_READERS = {"lightning.fabric.utilities.rank_zero", "torchmetrics.utilities.prints"}


def preload() -> tuple:
    """Import PRELOAD; return the environment variables the imports read (less the rank variables that this server
    sets again in each child), the prefixes that scanners read, and the modules that read every variable."""
    read, scanned, unknown = set(), set(), set()
    rank_readers = set()
    original = os.environ

    def reader() -> str:
        """The module whose code read the environment: the first frame up that is not this module's (``note``,
        Recording's methods, of which ``get`` reads through ``__getitem__``), ``os``'s or import machinery's."""
        frame = sys._getframe(1)
        while frame is not None and (frame.f_globals.get("__name__") in ("os", "_collections_abc")
                                     or frame.f_globals is globals()
                                     or frame.f_code.co_filename.startswith("<frozen")):
            frame = frame.f_back
        return frame.f_globals.get("__name__", "") if frame is not None else ""

    def note(key) -> None:
        read.add(key)
        if key in RANK_VARIABLES:
            rank_readers.add(reader())

    class Recording(os._Environ):
        def __getitem__(self, key):
            if reader() not in SCANNERS:
                note(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            note(key)
            return super().__contains__(key)

        def get(self, key, default=None):
            note(key)
            return super().get(key, default)

        def __iter__(self):
            who = reader()
            if who in SCANNERS:
                scanned.add(SCANNERS[who])
            else:
                unknown.add(who)
            return super().__iter__()

    os.environ = Recording(original._data, original.encodekey, original.decodekey, original.encodevalue,
                           original.decodevalue)
    try:
        for name in PRELOAD:
            try:
                __import__(name)
            except ImportError:
                pass
    finally:
        os.environ = original
    if rank_readers <= RANK_READERS:
        read -= RANK_VARIABLES
    print(f"rank variables read at import by {sorted(rank_readers)}:"
          f" {'set again in each child' if rank_readers <= RANK_READERS else 'compared'}", flush=True)
    return read, tuple(scanned), unknown


def compared(env: dict, read: set, prefixes: tuple) -> dict:
    keys = (read | {k for k in env if k.startswith(NATIVE_PREFIXES + prefixes)}) - NOT_COMPARED
    return {k: env.get(k) for k in keys}


def serve(where: str, name: str):
    """Serve until the owner is gone; returns only in a forked child, with its request."""
    started = time.time()
    startup_env = dict(os.environ)
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    read, prefixes, unknown = preload()
    # The imports' objects live as long as the process, as they would in a fresh one. Frozen, they stay out of every
    # collection in the children, above all the last one at exit, which otherwise takes about a second, and the
    # collector never writes to (and so copies) their pages.
    gc.collect()
    gc.freeze()
    threads = os.listdir("/proc/self/task")
    why_not = f"{len(threads)} threads after the imports; forking would lose them" if len(threads) != 1 else \
        f"{sorted(unknown)} read every environment variable at import" if unknown else ""
    if why_not:
        print(f"not serving: {why_not}", flush=True)
        # Stays, so that no client starts another server for this environment: it would fail the same way.
        os.rename(os.path.join(where, f"{name}.starting"), os.path.join(where, f"{name}.refused"))
        sys.exit(0)
    with open(os.path.join(where, f"keys-{os.getpid()}.json"), "w") as f:
        json.dump(sorted(read), f)
    expected = compared(startup_env, read, prefixes)
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals() if signal.getsignal(s) is not None}
    owner = int(os.environ.get("LFSDP_FORKSERVER_OWNER", "0"))

    path = os.path.join(where, f"{name}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients see the socket only once it accepts
    os.unlink(os.path.join(where, f"{name}.starting"))
    # The first server of a session is named before any server's imports have said which variables they read; by
    # the name its environment has now, it serves already, so that a later prewarm of it starts no second server.
    alias = server_name(where, startup_env)
    if alias != name:
        open(os.path.join(where, f"{alias}.alias"), "w").close()
    print(f"serving {path} after {time.time() - started:.1f} s of imports", flush=True)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "wake")
    children: dict = {}  # pid -> client connection
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "wake":
                os.read(wake_r, 4096)
            elif key.data == "accept":
                conn, _ = listener.accept()
                request = _receive(conn)
                if request is None:
                    conn.close()
                    continue
                mismatch = [k for k, v in compared(request["env"], read, prefixes).items() if expected.get(k) != v]
                mismatch += [k for k, v in expected.items() if request["env"].get(k) != v]
                if mismatch or not supported(request["argv"]):
                    reason = sorted(set(mismatch))[:20] or f"argv {request['argv'][:3]}"
                    print(f"refused {request['argv'][:3]}: {reason}", flush=True)
                    _send(conn, {"refused": reason})
                    conn.close()
                    for fd in request["fds"]:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    for other in children.values():
                        other.close()
                    conn.close()
                    request["handlers"] = handlers
                    request["python_path"] = python_path
                    return request
                for fd in request["fds"]:
                    os.close(fd)
                _send(conn, {"pid": pid})
                print(f"forked {pid}: {request['argv'][:3]}", flush=True)
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # a client closed its end: it died, so its process goes too
                pid = key.data
                _kill(pid)
                selector.unregister(key.fileobj)
        _reap(children, selector)
        if owner and not _alive(owner):
            break
    for pid in children:
        _kill(pid)
    try:
        os.unlink(path)
    except OSError:
        pass
    sys.exit(0)


def _reap(children: dict, selector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        if os.WIFSIGNALED(status):
            message = {"signal": os.WTERMSIG(status)}
        else:
            message = {"exit": os.waitstatus_to_exitcode(status)}
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        try:
            _send(conn, message)
        except OSError:
            pass
        conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket):
    conn.settimeout(10)
    try:
        head, ancillary, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(253 * 4))
        fds = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4]))
        if len(head) != 4 or not fds:
            for fd in fds:
                os.close(fd)
            return None
        size = struct.unpack("!I", head)[0]
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                return None
            body += chunk
    except (OSError, ValueError):
        return None
    conn.settimeout(None)
    request = json.loads(body)
    request["fds"] = fds
    if len(request["fd_numbers"]) != len(fds):
        for fd in fds:
            os.close(fd)
        return None
    return request


def become(request: dict) -> None:
    """Turn this forked child into the process the client asked for, short of running its code."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()
    # Each descriptor the stand-in inherited gets its number here, by way of numbers above every one in play.
    above = max(request["fds"] + request["fd_numbers"] + [2]) + 1
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in request["fds"]]
    for fd in request["fds"]:
        os.close(fd)
    for fd, number in zip(parked, request["fd_numbers"]):
        os.dup2(fd, number)
        os.close(fd)
    # The stand-in's ``python``: a process this one starts with sys.executable is forked as well, where it fits.
    sys.executable = request["executable"]
    sys.orig_argv = [request["executable"], *request["argv"]]
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    # The handlers a new interpreter would have: the stand-in's ignored signals stay ignored (inherited through exec;
    # Python then leaves SIGINT alone too), and a signal the server alone ignored gets Python's own default.
    ignored = set(request["ignored"])
    for sig, handler in request["handlers"].items():
        if sig in ignored:
            handler = signal.SIG_IGN
        elif handler == signal.SIG_IGN and sig not in (signal.SIGPIPE, signal.SIGXFSZ):
            handler = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    _reopen_stdio(unbuffered="-u" in request["argv"][:1] or bool(os.environ.get("PYTHONUNBUFFERED")),
                  present=set(request["fd_numbers"]))
    import faulthandler
    if faulthandler.is_enabled() or os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.stderr)
    if request["env"].get("LFSDP_FORKSERVER_FULL_EXIT") == "1":
        gc.unfreeze()  # the exit of a new interpreter: its last collection goes over every object
    elif any(name in sys.modules for name in LEAK_CHECKED):
        # Their native part reports every object still alive at exit on stderr ("nanobind: leaked 4 instances!"),
        # which frozen objects would be: at exit, put them back in reach of the interpreter's last collection (which
        # comes after every exit handler). Exit then costs what a new interpreter's does.
        atexit.register(gc.unfreeze)
    _set_ranks()
    # A new interpreter draws new seeds; a forked one would repeat the server's.
    import torch
    torch.default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _set_ranks() -> None:
    """Set again what RANK_READERS set at import from the rank variables, from this process's environment, with each
    module's own expression: the rank their rank-zero-only functions compare with 0.
    ``tests/test_forkserver.py`` checks the result against fresh interpreters on every CI leg."""
    fabric = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if fabric is not None:
        fabric.rank_zero_only.rank = fabric._get_rank() or 0
    metrics = sys.modules.get("torchmetrics.utilities.prints")
    if metrics is not None:
        metrics.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))


def _reopen_stdio(unbuffered: bool, present: set) -> None:
    import io
    old = sys.stdout
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        if fd not in present:  # closed in the stand-in: None, as a new interpreter has it
            try:
                os.close(fd)
            except OSError:
                pass
            stream = None
        elif fd == 0:
            raw = open(0, "rb", closefd=False)
            stream = io.TextIOWrapper(raw, encoding=old.encoding, errors="strict")
        else:
            raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
            stream = io.TextIOWrapper(raw, encoding=old.encoding, errors="backslashreplace" if fd == 2 else "strict",
                                      line_buffering=os.isatty(fd) and not unbuffered,
                                      write_through=unbuffered or fd == 2)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run(argv: list[str], python_path: list[str]) -> None:
    """Run ``python ARGV``'s main code, as the interpreter would after its own start-up."""
    args = list(argv)
    while args and args[0] == "-u":
        args.pop(0)
    base = [p for p in sys.path[1:] if p not in python_path]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if args and args[0] == "-m":
        import runpy
        sys.path[:] = [os.getcwd(), *extra, *base]
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's path in argv[0], as ``-m`` does
        _fresh_imports()
        runpy._run_module_as_main(args[1], alter_argv=True)
        return
    if args and args[0] == "-c":
        sys.path[:] = ["", *extra, *base]
        sys.argv = ["-c", *args[2:]]
        _fresh_imports()
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
        return
    script = args[0]
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *extra, *base]
    sys.argv = args
    _fresh_imports()
    from importlib.machinery import SourceFileLoader
    main.__file__ = script
    main.__cached__ = None
    main.__loader__ = SourceFileLoader("__main__", script)
    main.__spec__ = None
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    exec(code, main.__dict__)


def _fresh_imports() -> None:
    import importlib
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


if __name__ == "__main__":
    _request = serve(sys.argv[1], sys.argv[2])
    become(_request)
    _argv, _path = _request["argv"], _request["python_path"]
    del _request
    run(_argv, _path)
