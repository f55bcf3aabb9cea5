"""What the node-boundary tests share: throwaway Unix accounts, a directory job accounts can reach, fake GPUs.

Import the fixtures into a test module (``from tests.kit.node_boundary import job_accounts, shared_dir  # noqa``).
The accounts are made with ``useradd --no-create-home`` when missing and kept (they cost nothing and the next run
reuses them): login accounts, uid from ``UID_MIN`` to ``UID_MAX``, since the agent runs no job as a system account the
account map does not name. The tests need root, and say so plainly when they do not have it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kit import environment

#: The test accounts: user name on the bus -> Unix account (the same name).
ALICE, EVE = "apportion-u-alice", "apportion-u-eve"

#: NVIDIA's character-device major: fake GPU ``i`` is ``c 195:i``, as ``/dev/nvidia<i>`` is on a real node.
#: Without an NVIDIA driver an open the cgroup lets through fails ENXIO (no driver), one it refuses EPERM.
NVIDIA_MAJOR = 195

#: A job that reports what it can do from inside its sandbox: ``report.json`` in its working directory with its
#: uid, gid, groups and environment, the errno (or ``ok``) of opening each path of ``PROBE_OPEN``
#: (``:``-separated) and of listing each directory of ``PROBE_LIST``, and of ``kill(PROBE_PID, 0)`` (the same
#: permission check as any signal, without the harm of one that is let through). What it and the other probing jobs
#: start with (``PROBE_HELPERS``): ``outcome(fn)``, ``ok`` or the name of the errno ``fn`` raised, and ``split(name)``,
#: the ``:``-separated parts of the variable ``name``.
PROBE_HELPERS = r"""
import errno, json, os, sys

def outcome(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

split = lambda name: [p for p in os.environ.get(name, "").split(":") if p]
"""

PROBE = (
    PROBE_HELPERS
    + r"""
def open_close(path):
    os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
report = {
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "env": dict(os.environ),
    "open": {p: outcome(lambda p=p: open_close(p)) for p in split("PROBE_OPEN")},
    "list": {p: outcome(lambda p=p: os.listdir(p)) for p in split("PROBE_LIST")},
    "kill": outcome(lambda: os.kill(int(os.environ["PROBE_PID"]), 0)) if "PROBE_PID" in os.environ else None,
}
with open("report.json.tmp", "w") as f:
    json.dump(report, f)
os.replace("report.json.tmp", "report.json")
"""
)


def _account(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
        )
        try:
            return pwd.getpwnam(name)  # made, or made by another test worker at the same time
        except KeyError:
            raise RuntimeError(f"useradd {name} failed: {made.stderr.strip()}") from None


@pytest.fixture(scope="session")
def job_accounts() -> dict[str, pwd.struct_passwd]:
    """The accounts ``apportion-u-alice`` and ``apportion-u-eve`` (made when missing): name -> passwd entry."""
    if os.geteuid() != 0:
        pytest.fail(
            "the node-boundary tests run jobs as other Unix accounts and create cgroups: run them as root "
            "(CI does); they are not skipped, since an unchecked boundary is not a passing one"
        )
    if shutil.which("useradd") is None:
        pytest.fail("useradd is missing: the node-boundary tests need it to make their throwaway accounts")
    return {n: _account(n) for n in (ALICE, EVE)}


#: Where :func:`shared_dir` makes its directories: not under ``/tmp`` or ``/var/tmp``, which a job sees as
#: fresh tmpfs mounts of its own (its scripts would not be there), on a file system that honours setuid bits.
SHARED_BASE = "/var/lib"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every account may traverse (mode 0711), under :data:`SHARED_BASE`: a pytest ``tmp_path``
    lies inside root's private base, which no job account can enter."""
    d = Path(tempfile.mkdtemp(prefix="apportion-boundary-", dir=SHARED_BASE))
    d.chmod(0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def machine_stack_hidden(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Hide the machine's own stack from the agents a test starts: ``APPORTION_STACK_DIR`` names an empty directory
    and ``XDG_STATE_HOME`` another, so neither a ``stack.env`` of a running ``make up`` (whose ports the agent would
    close and whose file it would make private) nor the marker ``make down`` leaves (which refuses an address the
    agent was not given: the Redis port of the closed ports) is read."""
    environment.hide_machine_stack(monkeypatch, tmp_path_factory.mktemp("no-stack"))


def make_fake_gpus(directory: Path, count: int) -> list[str]:
    """``count`` character devices ``directory/nvidia<i>`` = ``c 195:i``, mode 0666: file permissions let every
    account open them, so only the cgroup can say no."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    out = []
    for i in range(count):
        path = directory / f"nvidia{i}"
        os.mknod(path, 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, i))
        path.chmod(0o666)
        out.append(str(path))
    return out


def write_script(directory: Path, name: str, text: str) -> Path:
    """``text`` as ``directory/name``, readable by every account."""
    path = directory / name
    path.write_text(text)
    path.chmod(0o644)
    return path


def running(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie (an orphan's zombie waits for its reaper: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


#: A job that collects everything it can read on the node and tries to publish with it (stdlib only, as a job
#: brings its own client; kafka-python when importable, for the record itself once signed in). Its environment:
#: ``PROBE_ROOTS`` (``:``-separated files and directories to walk), ``PROBE_BOOTSTRAP`` (``host:port``),
#: ``PROBE_TOPIC``, ``PROBE_KEY`` (the key of the record it would write), ``PROBE_PRINCIPALS`` (``:``-separated
#: names to sign in as). It writes ``kafka.json`` to its working directory: what it read (path -> ``read`` or
#: the errno), where its passwords came from (``sources``: every variable of its environment but the ``PROBE_``
#: wiring, every readable file) and how many distinct ones it tried, and
#: one verdict per attempt:
#:
#: - ``plaintext``: a Kafka ``ApiVersions`` request in clear; ``no_kafka_answer`` when the port answered nothing
#:   or a TLS alert;
#: - ``tls``: TLS (any certificate accepted), then a ``Metadata`` request without signing in;
#:   ``closed_unauthenticated`` when the broker closed the connection unanswered;
#: - ``scram``: TLS, then SASL/SCRAM-SHA-512 as each principal with each password; the broker's error name
#:   (``SASL_AUTHENTICATION_FAILED``) when refused, ``authenticated`` or ``produced`` when let in.
KAFKA_PROBE = r"""
import base64, errno, hashlib, hmac, json, os, socket, ssl, stat, struct
from concurrent.futures import ThreadPoolExecutor

split = lambda name: [p for p in os.environ.get(name, "").split(":") if p]
HOST, PORT = os.environ["PROBE_BOOTSTRAP"].rsplit(":", 1)
PORT = int(PORT)
ERRORS = {58: "SASL_AUTHENTICATION_FAILED", 33: "UNSUPPORTED_SASL_MECHANISM", 34: "ILLEGAL_SASL_STATE"}


def code(exc):
    return errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else type(exc).__name__


def collect(roots):
    found, contents = {}, {}

    def read(path):
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                return
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                data = f.read(1 << 16)
            found[path] = "read"
            text = data.decode("utf-8", "replace").strip()
            if text:
                contents[path] = text
        except OSError as exc:
            found[path] = code(exc)

    for root in roots:
        if not os.path.isdir(root):
            read(root)
            continue
        def failed(exc, root=root):
            found[exc.filename or root] = code(exc)
        for d, subdirs, files in os.walk(root, onerror=failed):
            for name in files:
                read(os.path.join(d, name))
    return found, contents


def frame(api_key, version, corr, body):
    msg = struct.pack(">hhih", api_key, version, corr, 3) + b"job" + body
    return struct.pack(">i", len(msg)) + msg


def string(s):
    b = s.encode()
    return struct.pack(">h", len(b)) + b


def receive(sock):
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack(">i", head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return body


def tls():
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx.wrap_socket(socket.create_connection((HOST, PORT), timeout=10), server_hostname=HOST)


def plaintext():
    with socket.create_connection((HOST, PORT), timeout=10) as sock:
        sock.sendall(frame(18, 0, 1, b""))
        got = b""
        try:
            while chunk := sock.recv(4096):
                got += chunk
        except OSError:
            pass
    return "no_kafka_answer" if got == b"" or got[0] == 21 else "answered"


def unauthenticated():
    try:
        with tls() as sock:
            sock.sendall(frame(3, 0, 1, struct.pack(">i", 1) + string(os.environ["PROBE_TOPIC"])))
            return "answered" if receive(sock) is not None else "closed_unauthenticated"
    except (OSError, ssl.SSLError):
        return "closed_unauthenticated"


def authenticate(sock, user, password):
    sock.sendall(frame(17, 1, 1, string("SCRAM-SHA-512")))
    r = receive(sock)
    if r is None:
        return "closed"
    (err,) = struct.unpack(">h", r[4:6])
    if err:
        return ERRORS.get(err, f"error {err}")

    def step(corr, payload):
        sock.sendall(frame(36, 1, corr, struct.pack(">i", len(payload)) + payload))
        r = receive(sock)
        if r is None:
            return "closed", b""
        (err, n) = struct.unpack(">hh", r[4:8])
        rest = r[8 + max(n, 0):]
        (m,) = struct.unpack(">i", rest[:4])
        return (ERRORS.get(err, f"error {err}") if err else None), rest[4 : 4 + max(m, 0)]

    nonce = base64.b64encode(os.urandom(18)).decode()
    bare = "n=" + user.replace("=", "=3D").replace(",", "=2C") + ",r=" + nonce
    err, first = step(2, ("n,," + bare).encode())
    if err:
        return err
    fields = dict(kv.split("=", 1) for kv in first.decode().split(","))
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(fields["s"]), int(fields["i"]))
    client_key = hmac.new(salted, b"Client Key", hashlib.sha512).digest()
    without = "c=biws,r=" + fields["r"]
    signature = hmac.new(
        hashlib.sha512(client_key).digest(), f"{bare},{first.decode()},{without}".encode(), hashlib.sha512
    ).digest()
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature))).decode()
    err, _ = step(3, f"{without},p={proof}".encode())
    return err or "authenticated"


def produce(user, password):
    try:
        from kafka import KafkaProducer
    except ImportError:
        return "authenticated"
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    p = KafkaProducer(
        bootstrap_servers=os.environ["PROBE_BOOTSTRAP"], security_protocol="SASL_SSL", ssl_context=ctx,
        sasl_mechanism="SCRAM-SHA-512", sasl_plain_username=user, sasl_plain_password=password,
        api_version=(3, 0), max_block_ms=10000,
    )
    try:
        p.send(os.environ["PROBE_TOPIC"], key=os.environ["PROBE_KEY"].encode(), value=b"{}").get(timeout=10)
        return "produced"
    except Exception as exc:
        return "authenticated, then " + type(exc).__name__
    finally:
        p.close(timeout=2)


def scram(user, password):
    try:
        with tls() as sock:
            verdict = authenticate(sock, user, password)
    except (OSError, ssl.SSLError) as exc:
        verdict = "closed: " + type(exc).__name__
    return produce(user, password) if verdict == "authenticated" else verdict


found, contents = collect(split("PROBE_ROOTS"))
env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
passwords = sorted(set(env.values()) | set(contents.values()))
principals = split("PROBE_PRINCIPALS")
attempts = [{"kind": "plaintext", "verdict": plaintext()}, {"kind": "tls", "verdict": unauthenticated()}]
pairs = [(u, p) for u in principals for p in passwords]
with ThreadPoolExecutor(16) as pool:
    for (u, p), verdict in zip(pairs, pool.map(lambda a: scram(*a), pairs)):
        attempts.append({"kind": "scram", "principal": u, "verdict": verdict})
with open("kafka.json.tmp", "w") as f:
    sources = sorted(env) + sorted(contents)
    json.dump({"found": found, "sources": sources, "passwords": len(passwords), "attempts": attempts}, f)
os.replace("kafka.json.tmp", "kafka.json")
"""
