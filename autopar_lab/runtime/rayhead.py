"""The embedded Ray head as a process group the library owns, outliving whichever thread started it.

Why not ``ray.init()`` in the caller's thread: Ray starts its head processes (GCS, raylet, agents) with
``PR_SET_PDEATHSIG``, which Linux ties to the *thread* that forked them, so a head started from a short-lived thread
(a notebook button's worker) dies with that thread, and the kernel follows ("Failed to connect to GCS"). Ray's
processes also sit in the caller's process group, so a Ctrl-C in the terminal reaches them and kills the cluster
before the job can stop cleanly.

So the head runs as ``ray start --head --block`` under a small watcher process (this module's :func:`main`), started
in a new session: its own process group, out of reach of the terminal's Ctrl-C, owned by no thread. The watcher
reads its stdin, a pipe from the owning process; when the pipe closes it stops ``ray start`` (which stops Ray's
processes), kills whatever is left in its group and removes the head's folder. A pipe closed without the word
``stop`` first means the owner died (a SIGKILL included): then the owner's whole temporary folder goes too (the
auth token in it), since nobody is left to remove it. The owning process then connects to the head as
an ordinary driver (``ray.init(address=...)``), from any thread.

    >>> head = RayHead.start(temp_dir, num_cpus=2, env=os.environ)   # doctest: +SKIP
    >>> head.address                                                   # doctest: +SKIP
    '127.0.0.1:40123'
    >>> head.stop()                                                    # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["RayHead", "HeadFailed", "HEAD_ENV_DEFAULTS", "head_args", "head_env", "announce_agent_listen_port",
           "main"]

READY = "Ray runtime started."  # what `ray start` prints once the head is up (its log is ours to read)

# `ray start` as the watcher runs it: without Ray Client's server. `ray start` has no flag for that: it starts the
# server whenever Ray Client's packages are installed (on port 10001 unless told another, and port 0 is refused),
# though the library's drivers connect to the GCS and nothing here uses ray://. The server is a Python process that
# imports all of Ray: measured on the shared 2-core machine (load 5-6), 5.0 CPU-s of a head's 17.7 while it starts.
# Told that the client's packages are missing, `ray start` leaves it out. A Ray without that check (Ray 2.60 has it)
# gets a free port for the server, as before, never Ray's fixed 10001 (tests/test_ray_lifecycle.py asserts that the
# head leaves Ray's default ports free).
RAY_START = """import socket, sys
import ray.scripts.scripts as s
if hasattr(s, "get_ray_client_dependency_error"):
    s.get_ray_client_dependency_error = lambda: "the embedded head runs no Ray Client server"
else:
    with socket.socket() as k:
        k.bind(("127.0.0.1", 0))
        sys.argv.append(f"--ray-client-server-port={k.getsockname()[1]}")
s.main()
"""


class HeadFailed(RuntimeError):
    """The head did not start (it exited, or did not come up in time); the message carries its last log lines."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Environment defaults for the head's processes (each is kept when the caller's environment sets it). Ray's own
# defaults are sized for an idle machine; on a shared one at load 7-15 the head timed out (issue 32).
HEAD_ENV_DEFAULTS = {
    # the raylet's wait for an agent to register, and the drivers' wait for the GCS port: Ray's 30 s, 4x
    "RAY_agent_register_timeout_ms": "120000",
    "RAY_gcs_server_port_wait_time_s": "120",
    # nobody reads the metrics of a head without a dashboard: no metrics reporting from every worker and the raylet
    "RAY_enable_metrics_collection": "0",
}


def head_args(port: int, ray_temp_dir: str, *, num_cpus: int | None = None,
              object_store_memory: int | None = None) -> list[str]:
    """The ``ray start`` arguments of an embedded head listening on 127.0.0.1:``port`` with its files in
    ``ray_temp_dir``: single-machine, no dashboard, no autoscaler monitor, no log monitor, every agent port chosen
    here."""
    # Every agent port is chosen here, free, for two reasons. Ray's defaults are fixed (52365 for the Jobs API's
    # agent, 10001 for Ray Client) even with the dashboard off: an embedded head holding them leaves a head the user
    # starts on this machine with no job agent ("No available agent to submit job"). And a port left to an agent
    # (Ray's 0) makes the raylet wait a fixed 15 s for the agent's port file, then abort: on a loaded machine the
    # agent's imports take longer (ray-project/ray#65983). Given here, the raylet takes the metrics agent's ports from
    # its command line and the runtime-env agent's too; the HTTP port it still reads from a file, which
    # :func:`announce_agent_listen_port` writes.
    args = ["start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_temp_dir}",
            "--min-worker-port=0", "--max-worker-port=0",
            f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
            f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
            # A fixed single-machine cluster needs no autoscaler; drivers connect with log_to_driver=False, so
            # nobody reads the log monitor's stream: two Python processes fewer to start on a busy machine. No Ray
            # Client server either (RAY_START: drivers connect to the GCS, never through ray://).
            "--no-monitor", "--include-log-monitor=false"]
    if num_cpus is not None:
        args.append(f"--num-cpus={int(num_cpus)}")
    if object_store_memory is not None:
        args.append(f"--object-store-memory={int(object_store_memory)}")
    return args


def head_env(base) -> dict[str, str]:
    """The environment of the head's processes: ``base`` with single-machine mode, no RAY_ADDRESS (this head is
    new), and :data:`HEAD_ENV_DEFAULTS` where ``base`` does not set them (RAY_AUTH_MODE and the token as given)."""
    env = {**HEAD_ENV_DEFAULTS, **dict(base)}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # single-machine mode: services on the loopback address
    env.pop("RAY_ADDRESS", None)
    return env


def announce_agent_listen_port(ray_temp_dir: str, port: int) -> bool:
    """Write the dashboard agent's HTTP port file for the head whose files are in ``ray_temp_dir``, once its GCS has
    named the node (True then, and when the file is already there; False while the GCS has not).

    Why: Ray 2.60's raylet reads this port from a file the agent writes once all its modules are loaded, and waits a
    fixed 15 s for it (the port given to ``ray start`` never reaches the raylet), then aborts: the head failed at load
    7-15 on this 2-core machine (ray-project/ray#65983). The port is chosen here (:func:`head_args`), so the file can
    say it at once; the agent writes the same number when it is up (or -1 if its HTTP server fails, as Ray does)."""
    session = os.path.join(ray_temp_dir, "session_latest")
    try:
        names = os.listdir(session)
    except OSError:
        return False
    node = next((n[len("gcs_server_port_"):] for n in names if n.startswith("gcs_server_port_")), None)
    if node is None:
        return False
    path = os.path.join(session, f"dashboard_agent_listen_port_{node}")
    if not os.path.exists(path):
        tmp = f"{path}.autopar"
        with open(tmp, "w") as f:
            f.write(str(int(port)))
        os.replace(tmp, path)  # whole or absent: the raylet polls for it
    return True


class RayHead:
    """A running head: ``address`` (``127.0.0.1:PORT``), ``head_dir`` (its files), ``pid`` (the watcher, also its
    process group), ``args`` (its ``ray start`` arguments), :meth:`alive`, :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen, address: str, head_dir: str, log_path: str):
        self.proc = proc
        self.address = address
        self.head_dir = head_dir
        self.ray_group: int | None = None  # the process group (session) of `ray start` and Ray's processes
        self.log_path = log_path
        self.pid = proc.pid
        self.args: list[str] = []  # the `ray start` arguments (head_args), for inspection

    @classmethod
    def start(cls, temp_dir: str, *, num_cpus: int | None = None, object_store_memory: int | None = None,
              env=None, timeout_s: float = 300.0) -> "RayHead":
        """Start a loopback-only head whose files live in a new folder under ``temp_dir`` (the owner's private
        temporary folder); HeadFailed if it is not up within ``timeout_s`` (then nothing of it is left running)."""
        import tempfile

        head_dir = tempfile.mkdtemp(prefix="head-", dir=temp_dir)
        port = _free_port()
        args = head_args(port, os.path.join(head_dir, "ray"), num_cpus=num_cpus,
                         object_store_memory=object_store_memory)
        env = head_env(os.environ if env is None else env)
        log_path = os.path.join(head_dir, "head.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "autopar_lab.runtime.rayhead", head_dir, temp_dir, *args],
                                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, close_fds=True)
        head = cls(proc, f"127.0.0.1:{port}", head_dir, log_path)
        head.args = args
        deadline = time.monotonic() + timeout_s
        listen_port = int(next(a for a in args if a.startswith("--dashboard-agent-listen-port=")).split("=")[1])
        announced = False
        try:
            while True:
                if not announced:
                    announced = announce_agent_listen_port(os.path.join(head_dir, "ray"), listen_port)
                if proc.poll() is not None:
                    raise HeadFailed(f"the Ray head exited with status {proc.returncode}: {head.log_tail()}")
                if READY in head.log_tail(4000):
                    with open(os.path.join(head_dir, "ray.pgid")) as f:
                        head.ray_group = int(f.read())
                    return head
                if time.monotonic() > deadline:
                    raise HeadFailed(f"the Ray head did not start within {timeout_s:.0f} s: {head.log_tail()}")
                time.sleep(0.2)
        except BaseException:  # a failure, or the caller interrupted (Ctrl-C, SIGTERM): leave nothing running
            head.stop()
            raise

    def log_tail(self, chars: int = 300) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(os.path.getsize(self.log_path) - chars, 0))
                return " ".join(f.read().decode(errors="replace").split())
        except OSError:
            return ""

    def alive(self) -> bool:
        """Whether the watcher and Ray's processes are running."""
        if self.proc.poll() is not None:
            return False
        if self.ray_group is None:
            return True
        try:
            os.killpg(self.ray_group, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the head and everything in its process group (never anything else); idempotent."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(b"stop\n")  # the watcher's cue: a stop, not the owner's death
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        for group in (self.pid, self.ray_group):  # the watcher's session and Ray's: only what they started
            if group is None:
                continue
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.head_dir, ignore_errors=True)  # in case the watcher was cut short


# ------------------------------------------------------------------------------------------------ the watcher

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return os.getppid() == pid  # re-parented: the owner is gone even if its pid was reused
    except ProcessLookupError:
        return False


def kill_group(group: int, wait_s: float = 10.0) -> None:
    """SIGKILL every process of process group ``group`` but this one, then wait (up to ``wait_s``) for them to be
    gone. The groups are the head's own sessions, so this reaches only what the head started."""
    me = os.getpid()

    def members():
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != me:
                try:
                    with open(f"/proc/{name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == group and fields[0] != "Z":  # field 5 of stat: the process group
                    out.append(int(name))
        return out

    deadline = time.monotonic() + wait_s
    while True:
        pids = members()
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def main(argv=None) -> int:
    """``python -m autopar_lab.runtime.rayhead HEAD_DIR OWNER_DIR RAY_START_ARGS...``: run ``ray start`` until stdin
    closes (see the module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    head_dir, owner_dir, ray_args = argv[0], argv[1], argv[2:]
    owner = os.getppid()
    heard: list[bytes] = []
    # A session of its own: Ray's shutdown signals its whole process group, which must not include this watcher.
    child = subprocess.Popen([sys.executable, "-c", RAY_START, *ray_args],
                             stdin=subprocess.DEVNULL, start_new_session=True)
    with open(os.path.join(head_dir, "ray.pgid"), "w") as f:
        f.write(str(child.pid))
    stopping = threading.Event()
    exited_alone = threading.Event()

    def stop(*_):
        if stopping.is_set():
            return
        stopping.set()
        child.terminate()  # `ray start --block` drains and stops Ray's processes (and their PDEATHSIG follows it)
        try:
            child.wait(20)
        except subprocess.TimeoutExpired:
            child.kill()
        kill_group(child.pid)  # whatever of Ray's session is left
        # An owner that asked for the stop cleans its own folder, unless it died meanwhile (a kernel killed right
        # after its clean-up began): then nobody else will, and the token must not outlive it.
        folder = head_dir if b"stop" in b"".join(heard) and _alive(owner) else owner_dir
        if exited_alone.is_set() and _alive(owner):
            # `ray start` failed by itself: Ray's files go, the log stays for the owner's error message (the owner
            # removes the head's folder when it has read it).
            folder = os.path.join(head_dir, "ray")
        for _ in range(10):  # a dying process may still write a log line into it: try again
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.exists(folder):
                break
            time.sleep(0.5)
        if folder == head_dir and not _alive(owner):
            shutil.rmtree(owner_dir, ignore_errors=True)
        os._exit(0)

    def watch():
        try:
            while True:
                chunk = sys.stdin.buffer.read1(1 << 16)
                if not chunk:
                    break
                heard.append(chunk)
        except OSError:
            pass
        stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the owner stops the head
    threading.Thread(target=watch, daemon=True).start()
    code = child.wait()
    if not stopping.is_set():
        print(f"autopar-lab: `ray start` exited with status {code}", flush=True)
        exited_alone.set()
        stop()
    while True:  # the watching thread is stopping the head: it ends this process (os._exit) when the folder is gone
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
