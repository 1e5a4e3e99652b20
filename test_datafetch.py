"""Tests for datafetch/: `train.py download` and `train.py imagenet100` under hostile input, by
property (Hypothesis) and by the listed cases (@example and plain regressions).

The promises checked, whatever the input:
  * the command succeeds, or it is refused in exactly one line (a runfiles.UsageError; through the
    command line: one `error: ...` line on stderr and exit status 2, 75 or 130), never a traceback;
  * nothing is written or removed outside the data folder (but the folders made to reach it on a
    success), and a refusal leaves the data folder as it was, but for a resumable .part;
  * an archive unpacks whole (byte for byte) or not at all, and a clean one always unpacks;
  * each call ends in bounded time.

No network: the files come from servers on 127.0.0.1 in threads, and every other host name is
refused by a stand-in for socket.getaddrinfo (the HTTP server: LoopServer).

At the end: `train.py download` and `imagenet100` on small copies of the real releases, case by case.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import http.client
import http.server
import io
import math
import os
import shutil
import socket
import socketserver
import stat
import tarfile
import tempfile
import threading
import time
import warnings
import zipfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, reject, settings, strategies as st

import datafetch.download as dl
import datafetch.imagenet100
import runfiles
import tasks
import train
from conftest import _deadline, _tree as _bytes_tree, _write_layout, make_tinystories, make_wikitext, write

FUZZ = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
SECONDS = 20            # the most one call may take (bounded time)


# ------------------------------------------------------------------------------------- helpers

def _one_line(call):
    """call()'s value, or the refusal it raised (a UsageError of one printable line); any other
    exception (a traceback for the user) propagates and fails the test."""
    t0 = time.monotonic()
    try:
        return call()
    except runfiles.UsageError as e:
        text = str(e)
        assert text and "\n" not in text and "\r" not in text and text.isprintable(), repr(text)
        assert "Traceback" not in text
        return e
    finally:
        assert time.monotonic() - t0 < SECONDS


def _cli(argv):
    """(exit status, stdout, the stderr line or None): train.main's promise of one line."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train.main(argv)
    assert time.monotonic() - t0 < SECONDS
    lines = err.getvalue().splitlines()
    if rc == 0:
        assert lines == [], lines
        return rc, out.getvalue(), None
    assert rc in (2, 75, 130) and len(lines) == 1 and lines[0].startswith("error: "), (rc, lines)
    assert lines[0].isprintable() and "Traceback" not in lines[0]
    return rc, out.getvalue(), lines[0]


def _tree(root) -> dict:
    """Every path under `root` (links not followed) -> what it is: a folder, a link's target or a
    file's sha256."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir",)
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
    return out


def _changed(before: dict, after: dict) -> set:
    return {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}


def _within(rel: str, folder: str) -> bool:
    """Whether `rel` (relative to the sandbox) lies in `folder` (relative to it too; "." is the sandbox itself)."""
    return folder == os.curdir or rel == folder or rel.startswith(folder + os.sep)


def _check_changes(sandbox, before, data, ok):
    """What changed in `sandbox`: on a success (`ok`) only the data folder, what lies in it and the
    folders made to reach it; on a refusal nothing, but resumable .part files in the data folder,
    the files of the table fetched whole before the one that failed (`_whole`), and the folders
    made to hold them."""
    changed = _changed(before, _tree(sandbox))
    if not changed:
        return
    real = os.path.realpath(data) if isinstance(data, str) and "\0" not in data else None
    assert real and _within(real, os.path.realpath(sandbox)), (data, changed)
    inside = os.path.relpath(real, os.path.realpath(sandbox))
    on_the_way = _on_the_way(sandbox, data)
    for rel in changed:
        above = rel in on_the_way and _tree_kind(sandbox, rel) == "dir"
        if ok:
            assert above or _within(rel, inside), (rel, inside)
        else:
            part = os.path.dirname(rel) == inside and rel.endswith(".part")
            done = any(_within(rel, os.path.join(inside, t)) for t in ("fuzz-1", "notes.txt"))
            assert above or part or done, (rel, inside, changed)
    _whole(data)


def _whole(data):
    """Each file of TABLE in DATA is whole, byte for byte (a refusal keeps those done before)."""
    want = {("fuzz-1", "a.txt"): ALPHA, ("fuzz-1", "b", "c.txt"): b"gamma\n", ("notes.txt",): NOTES}
    if os.path.isdir(os.path.join(data, "fuzz-1")):
        assert sorted(os.listdir(os.path.join(data, "fuzz-1"))) == ["a.txt", "b"]
    for parts, content in want.items():
        if os.path.lexists(os.path.join(data, parts[0])):
            with open(os.path.join(data, *parts), "rb") as f:
                assert f.read() == content


def _on_the_way(sandbox, data) -> set:
    """The folders a path names on its way, as the kernel resolves them (new/../x: new and x),
    relative to the sandbox: `mkdir -p`'s, and so download's, to make."""
    parts, out = data.split(os.sep), set()
    for i in range(1, len(parts) + 1):
        prefix = os.sep.join(parts[:i]) or os.sep
        out.add(os.path.relpath(os.path.realpath(prefix), os.path.realpath(sandbox)))
    return out


def _tree_kind(root, rel):
    path = os.path.join(root, rel)
    return "dir" if os.path.isdir(path) and not os.path.islink(path) else "other"


@contextlib.contextmanager
def _no_network():
    """Only 127.0.0.1 and localhost resolve: no example reaches a real host (or waits for DNS)."""
    real = socket.getaddrinfo

    def local_only(host, *a, **k):
        if host not in ("127.0.0.1", "localhost", b"127.0.0.1", "::1"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (test: no network)")
        return real(host, *a, **k)
    with mock.patch.object(socket, "getaddrinfo", local_only):
        yield


class RawServer:
    """Answers every request with the bytes of `reply` as they are (not HTTP, if so), then closes."""

    def __init__(self):
        owner, self.reply = self, b""

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.settimeout(2)
                got = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in got:
                        chunk = self.request.recv(4096)
                        if not chunk:
                            break
                        got += chunk
                    self.request.sendall(owner.reply)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _zip_blob(top: str, files: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(top + "/", "")
        for name, data in files.items():
            z.writestr(f"{top}/{name}", data)
    return buf.getvalue()


def _entry(name: str, data: bytes, target: str, unpacked: int = 0) -> dl.File:
    """A File of the test's own table (the pinned sums describe the real releases)."""
    return dl.File(f"https://example.invalid/{name}", len(data), hashlib.sha256(data).hexdigest(),
                   target, md5=hashlib.md5(data).hexdigest(), max_unpacked=unpacked)


ALPHA = b"".join(hashlib.sha256(b"%d" % i).digest() for i in range(800))   # 25 KiB, incompressible
ZIP = _zip_blob("fuzz-1", {"a.txt": ALPHA, "b/c.txt": b"gamma\n"})
NOTES = b"plain notes\n" * 500
TABLE = {"fuzzset": (_entry("fuzz-1.zip", ZIP, "fuzz-1", 1 << 20),
                     _entry("notes.txt", NOTES, "notes.txt"))}
ONE = {"fuzzset": TABLE["fuzzset"][:1]}


class LoopServer:
    """An HTTP server on 127.0.0.1 for the download tests, serving `files` under a mode: /good/NAME (with Range),
    /cut/NAME (half the bytes, then the connection closes), /stall/NAME (a few bytes, then silence), /e404/, /e500/.
    `ranges` keeps the Range header of each request (None where there was none)."""

    def __init__(self, files):
        self.files, self.ranges = files, []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                _, mode, name = self.path.split("/", 2)
                owner.ranges.append(self.headers.get("Range"))
                if mode in ("e404", "e500") or name not in owner.files:
                    self.send_error(500 if mode == "e500" else 404)
                    return
                data, start = owner.files[name], 0
                if self.headers.get("Range") and mode == "good":
                    start = int(self.headers["Range"].split("=")[1].rstrip("-"))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if mode == "cut":
                    self.wfile.write(data[:len(data) // 2])
                elif mode == "stall":
                    self.wfile.write(data[:10])
                    self.wfile.flush()
                    time.sleep(3)
                else:
                    self.wfile.write(data[start:])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None          # a client that hung up: no traceback
        self.base = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def files():
    server = LoopServer({"fuzz-1.zip": ZIP, "notes.txt": NOTES})
    yield server
    server.close()


@pytest.fixture(scope="module")
def raw():
    server = RawServer()
    yield server
    server.close()


@contextlib.contextmanager
def _sandbox():
    """A fresh folder with a base folder four deep in it (so `..` never climbs out), a file, a
    folder, a link to it and a link to nowhere."""
    root = tempfile.mkdtemp(prefix="fuzz-datafetch-")
    base = os.path.join(root, "r1", "r2", "r3", "r4")
    os.makedirs(os.path.join(base, "adir"))
    with open(os.path.join(base, "afile"), "w") as f:
        f.write("the user's own file\n")
    os.symlink("adir", os.path.join(base, "alink"))
    os.symlink("nowhere", os.path.join(base, "dangling"))
    os.symlink("loop", os.path.join(base, "loop"))
    try:
        yield root, base
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ download's arguments (item 5)

PIECES = st.sampled_from(["new", "deeper", "afile", "adir", "alink", "dangling", "loop", ".", "..",
                          "", "x" * 300, "with space", "é", "a\0b", "a\nb", "\ud800", "\udcff"])
DATA = st.one_of(st.lists(PIECES, max_size=4).map(lambda ps: ("rel", "/".join(ps))),
                 st.sampled_from([("abs", "/proc/nope/data"), ("abs", "/dev/null"),
                                  ("abs", "/dev/null/data"), ("abs", ""), ("abs", "/proc/1/environ/x")]))
TIMEOUT = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([30.0, 0.5, 5.0, 0.0, -1.0, 1e308, 1e-300, 5e-324, 3600.0, 86400.0]))
MIRROR_TEXT = st.one_of(st.text(max_size=30),
                        st.sampled_from(["", "mirror", "http://[::1", "http://a\nb/", "ftp://x/",
                                         "http://", "https://mirror.example/cifar",
                                         "http://u:p@127.0.0.1/", "http://127.0.0.1:99999/",
                                         "http://127.0.0.1:x/", "http://h/?q", "http://h/#f",
                                         "http://ü.example/", "http://a..b/", "//127.0.0.1/",
                                         "http://127.0.0.1:1/", "HTTP://127.0.0.1:1/"]))
MIRROR = st.one_of(st.none(), st.just("GOOD"), MIRROR_TEXT,
                   st.text(max_size=12).map(lambda t: "GOOD" + t))


def _data_path(base, data):
    kind, text = data
    return os.path.join(base, text) if kind == "rel" and text else (text if kind == "abs" else base + "/")


def _mirror(files, mirror):
    return mirror if mirror is None or not mirror.startswith("GOOD") else files.base + "/good" + mirror[4:]


def _sane(timeout) -> bool:
    return math.isfinite(timeout) and 1e-3 <= timeout <= 3600


@FUZZ
@given(mirror=MIRROR, timeout=TIMEOUT, data=DATA)
@example(mirror="GOOD", timeout=30.0, data=("rel", "new/deeper"))          # the good case: it runs
@example(mirror="GOOD", timeout=0.001, data=("rel", "new"))     # a stall after the first file, or not
@example(mirror="GOOD", timeout=float("nan"), data=("rel", "new"))
@example(mirror="GOOD", timeout=-1.0, data=("rel", "new"))
@example(mirror="GOOD", timeout=float("inf"), data=("rel", "new"))
@example(mirror="GOOD", timeout=1e308, data=("rel", "new"))
@example(mirror="GOOD", timeout=0.0, data=("rel", "new"))
@example(mirror="mirror", timeout=30.0, data=("rel", "new"))
@example(mirror="http://[::1", timeout=30.0, data=("rel", "new"))
@example(mirror="http://a\nb/", timeout=30.0, data=("rel", "new"))
@example(mirror="", timeout=30.0, data=("rel", "new"))
@example(mirror="GOOD", timeout=30.0, data=("rel", "afile"))
@example(mirror="GOOD", timeout=30.0, data=("rel", "afile/sub"))
@example(mirror="GOOD", timeout=30.0, data=("abs", "/proc/nope/data"))
@example(mirror="GOOD", timeout=30.0, data=("rel", "new/" + "x" * 300))
@example(mirror="GOOD", timeout=1.0, data=("rel", "../../../.."))       # found by it: the sandbox itself, "."
def test_download_arguments_run_or_are_refused_in_one_line(files, mirror, timeout, data):
    """download(names, DATA, MIRROR, timeout=T), called as a library: a run or one line, nothing
    written outside DATA, nothing at all on a refusal of its arguments."""
    with _sandbox() as (root, base), _no_network():
        path, mirror = _data_path(base, data), _mirror(files, mirror)
        before = _tree(root)
        got = _one_line(lambda: dl.download(["fuzzset"], path, mirror, TABLE, timeout=timeout))
        _check_changes(root, before, path, got == 0)
        if not _sane(timeout) or mirror == "":
            assert isinstance(got, runfiles.UsageError) and _changed(before, _tree(root)) == set()
        if got == 0:
            assert {"fuzz-1", "notes.txt"} <= set(os.listdir(path))
            assert not [n for n in os.listdir(path) if n.endswith(".part") or n.endswith(".tmp")]


@settings(FUZZ, max_examples=20)
@given(mirror=MIRROR_TEXT, timeout=st.one_of(st.floats(), st.text(max_size=6)), data=DATA)
@example(mirror="mirror", timeout="30", data=("rel", "new"))
@example(mirror="http://127.0.0.1:1/", timeout="nan", data=("rel", "new"))
@example(mirror="http://127.0.0.1:1/", timeout="1e308", data=("rel", "new"))
@example(mirror="http://127.0.0.1:1/", timeout="30", data=("rel", "afile/sub"))
def test_download_command_line_is_one_line_and_exit_2(mirror, timeout, data):
    """python train.py download wikitext2 --data D --from M --timeout T: exit 0 never (no network),
    else one `error:` line and exit 2; nothing left behind."""
    with _sandbox() as (root, base), _no_network():
        path = _data_path(base, data)
        before = _tree(root)
        rc, _, line = _cli(["download", "wikitext2", "--data", path, "--from", mirror,
                            "--timeout", timeout if isinstance(timeout, str) else repr(timeout)])
        assert rc == 2
        _check_changes(root, before, path, False)


def _imagenet1k(root) -> str:
    for split in ("train", "val"):
        for w in tasks.IMAGENET100_WNIDS:
            os.makedirs(os.path.join(root, split, w))
            with open(os.path.join(root, split, w, f"{w}.JPEG"), "w") as f:
                f.write(f"{split} {w}")
    return root


@pytest.fixture(scope="module")
def in1k(tmp_path_factory):
    """An ImageNet-1k stand-in: the 100 classes, one image each per split (read, linked, never
    written)."""
    return _imagenet1k(str(tmp_path_factory.mktemp("in1k") / "in1k"))


@settings(FUZZ, max_examples=15)
@given(data=DATA, source=st.sampled_from(["good", "", "missing", "afile", "a\nb", "a\0b"]))
@example(data=("rel", "afile"), source="good")
@example(data=("rel", "afile/sub"), source="good")
@example(data=("abs", "/proc/nope/data"), source="good")
@example(data=("rel", "new/deeper"), source="good")
def test_imagenet100_data_folder_builds_or_is_refused_in_one_line(in1k, data, source):
    """imagenet100.build(SRC, DATA): built, or one line and nothing written anywhere."""
    with _sandbox() as (root, base):
        src = {"good": in1k, "missing": os.path.join(root, "nope"),
               "afile": os.path.join(base, "afile")}.get(source, source)
        path = _data_path(base, data)
        before = _tree(root)
        got = _one_line(lambda: datafetch.imagenet100.build(src, path))
        _check_changes(root, before, path, isinstance(got, str))
        if not isinstance(got, str):
            assert _changed(before, _tree(root)) == set()


# ---------------------------------------------------------------- hostile replies (item 5)

STATUS = st.one_of(st.sampled_from([b"HTTP/1.1 200 OK", b"HTTP/1.1 206 Partial Content",
                                    b"HTTP/1.0 200 OK", b"SSH-2.0-OpenSSH_9.6", b"",
                                    b"HTTP/1.1 2OO OK", b"HTTP/9.9 200 OK",
                                    b"HTTP/1.1 404 \x1b[31mgone\x1b[0m", b"HTTP/1.1 302 Found",
                                    b"HTTP/1.1 500 " + b"x" * 300]),
                   st.binary(max_size=40))
HEADER = st.tuples(st.sampled_from([b"Content-Length", b"Transfer-Encoding", b"Content-Range",
                                    b"Location", b"X-Pad", b"Content-Type"]),
                   st.one_of(st.binary(max_size=20),
                             st.integers(-5, 1 << 40).map(lambda n: str(n).encode()),
                             st.sampled_from([b"chunked", str(len(ZIP)).encode(), b"12abc",
                                              b"file:///etc/passwd", b"http://elsewhere.example/x",
                                              b"http://127.0.0.1:1/x"])))
BODY = st.one_of(st.binary(max_size=200), st.just(ZIP), st.just(ZIP[:len(ZIP) // 2]),
                 st.just(b"zz\r\nnot a chunk\r\n"))


def _reply(status, headers, pad, long_line, body):
    lines = [status] + [k + b": " + v for k, v in headers]
    lines += [b"X-Pad-%d: v" % i for i in range(pad)]
    lines += [b"X-Long: " + b"y" * 70_000] if long_line else []
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


GOOD_REPLY = (b"HTTP/1.1 200 OK", [(b"Content-Length", str(len(ZIP)).encode())], 0, False, ZIP)


@FUZZ
@given(status=STATUS, headers=st.lists(HEADER, max_size=4), pad=st.sampled_from([0, 3, 99, 101, 150]),
       long_line=st.booleans(), body=BODY)
@example(*GOOD_REPLY)                                                           # it runs
@example(b"HTTP/1.1 200 OK", [(b"Content-Length", b"12abc")], 0, False, ZIP)     # non-numeric length
@example(b"SSH-2.0-OpenSSH_9.6", [], 0, False, b"")                             # not HTTP
@example(b"HTTP/1.1 200 OK", [], 150, False, ZIP)                               # 100+ headers
@example(b"HTTP/1.1 200 OK", [], 0, True, ZIP)                                  # a line too long
@example(b"HTTP/1.1 200 OK", [(b"Transfer-Encoding", b"chunked")], 0, False, b"zz\r\nnot a chunk\r\n")
@example(b"HTTP/1.1 404 \x1b[31mgone\x1b[0m", [], 0, False, b"")               # escapes in a reason
@example(b"HTTP/1.1 302 Found", [(b"Location", b"file:///etc/passwd")], 0, False, b"")
def test_hostile_replies_are_one_line(raw, status, headers, pad, long_line, body):
    """Whatever a server (or something that is not one) answers: the set, whole, or one line;
    a refusal keeps at most the resumable .part in DATA."""
    raw.reply = _reply(status, headers, pad, long_line, body)
    with _sandbox() as (root, base), _no_network():
        path = os.path.join(base, "data")
        before = _tree(root)
        got = _one_line(lambda: dl.download(["fuzzset"], path, raw.base, ONE, timeout=2))
        _check_changes(root, before, path, got == 0)
        if (status, headers, pad, long_line, body) == GOOD_REPLY:
            assert got == 0 and os.listdir(path) == ["fuzz-1"]


# ------------------------------------------------------------------- Ctrl-C (item 5)

def _interrupt_after(n):
    """A stand-in that raises KeyboardInterrupt on its n-th call, else calls through."""
    state = {"calls": 0}

    def wrap(real):
        def hit(*a, **k):
            state["calls"] += 1
            if state["calls"] > n:
                raise KeyboardInterrupt
            return real(*a, **k)
        return hit
    return wrap


# where a Ctrl-C can land: the connection, a read, a write (the bar after it), the sums, the unpacking
POINTS = {"connect": (dl.urllib.request, "urlopen"), "read": (http.client.HTTPResponse, "read1"),
          "progress": (dl.Progress, "update"), "sums": (dl, "_check_sums"),
          "unpack": (dl, "write_new_dataset")}


@settings(FUZZ, max_examples=25)
@given(point=st.sampled_from(sorted(POINTS)), after=st.integers(0, 6))
@example(point="progress", after=2)
@example(point="read", after=1)
def test_ctrl_c_anywhere_keeps_the_part_and_the_same_command_resumes(files, point, after):
    """Ctrl-C at any point of a download: one line saying what was kept, exit status 130, nothing
    but the resumable .part in DATA; the same command again finishes the set, whole."""
    where, name = POINTS[point]
    with _sandbox() as (root, base), _no_network(), mock.patch.object(dl, "CHUNK", 4096):
        path = os.path.join(base, "data")
        with mock.patch.object(where, name, _interrupt_after(after)(getattr(where, name))):
            got = _one_line(lambda: dl.download(["fuzzset"], path, files.base + "/good", ONE))
        if got == 0:                        # the stand-in was not reached often enough
            return
        assert getattr(got, "status", 2) == 130 and "interrupted" in str(got), str(got)
        left = os.listdir(path) if os.path.isdir(path) else []
        assert set(left) <= {"fuzz-1.zip.part"}, left
        assert ("kept" in str(got)) == bool(left) and "run the same command again" in str(got)
        assert _one_line(lambda: dl.download(["fuzzset"], path, files.base + "/good", ONE)) == 0
        assert os.listdir(path) == ["fuzz-1"]
        with open(os.path.join(path, "fuzz-1", "a.txt"), "rb") as f:
            assert f.read() == ALPHA


def test_ctrl_c_during_a_transfer_is_one_line_and_exit_130(files, tmp_path):
    """Through train.py: `error: interrupted ...` naming the part kept, exit 130, then a resume."""
    data = tmp_path / "data"
    table = {"wikitext2": (_entry("fuzz-1.zip", ZIP, "fuzz-1", 1 << 20),)}
    hit, real = _interrupt_after(1)(dl.Progress.update), dl.download
    with mock.patch.object(dl, "CHUNK", 4096), mock.patch.object(dl.Progress, "update", hit), \
            mock.patch.object(dl, "download", lambda n, d, m, timeout: real(n, d, m, table, timeout)):
        rc, _, line = _cli(["download", "wikitext2", "--data", str(data), "--from", files.base + "/good"])
    assert rc == 130 and "interrupted" in line and "fuzz-1.zip.part" in line and "kept" in line
    assert os.listdir(data) == ["fuzz-1.zip.part"] and 0 < (data / "fuzz-1.zip.part").stat().st_size < len(ZIP)


# ------------------------------------------------------------------------ archives (item 6)

TOP = "top"
SAFE_PART = st.sampled_from(["a", "b", "c", "é", "n" * 200, "with space", ".hidden"])
SAFE_NAME = st.lists(SAFE_PART, min_size=1, max_size=3).map(lambda ps: TOP + "/" + "/".join(ps))
BAD_NAME = st.sampled_from(["../evil", "/tmp/evil", "top/../../evil", "top\\..\\evil", "elsewhere/f",
                            "top//f", "top/" + "x" * 300, "top/" + "d/" * 70 + "f",
                            "top/" + "d/" * 3000 + "f", "top/" + "p" * 250 + "/" + "q" * 250 + "/"
                            + "r" * 250 + "/" + "s" * 250 + "/" + "t" * 250])
KINDS_OK = ("file", "dir")
KINDS_BAD = ("symlink", "hardlink", "chardev", "blockdev", "fifo", "unknown")
TAR_TYPES = {"file": tarfile.REGTYPE, "cont": tarfile.CONTTYPE, "dir": tarfile.DIRTYPE,
             "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "chardev": tarfile.CHRTYPE,
             "blockdev": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE, "unknown": b"Z"}
ZIP_MODES = {"file": [0, 0o644, stat.S_IFREG | 0o644, 0o100755], "dir": [0, 0o755, stat.S_IFDIR | 0o755],
             "symlink": [stat.S_IFLNK | 0o777], "hardlink": [stat.S_IFLNK | 0o777],
             "chardev": [stat.S_IFCHR | 0o600], "blockdev": [stat.S_IFBLK | 0o600],
             "fifo": [stat.S_IFIFO | 0o600], "unknown": [stat.S_IFSOCK | 0o600]}


@st.composite
def member(draw, bad_ok=True):
    """(name, kind, data, zip mode index, bad): one archive member, bad when the rules refuse it
    whatever else the archive holds."""
    bad_name = bad_ok and draw(st.integers(0, 5)) == 0
    bad_kind = bad_ok and draw(st.integers(0, 7)) == 0
    name = draw(BAD_NAME if bad_name else st.one_of(SAFE_NAME, st.just(TOP)))
    kind = draw(st.sampled_from(KINDS_BAD if bad_kind else KINDS_OK + ("cont",)))
    data = draw(st.binary(max_size=1500)) if kind in ("file", "cont") else b""
    top_file = name == TOP and kind != "dir"
    return name, kind, data, draw(st.integers(0, 3)), bad_name or bad_kind or top_file


def _conflicts(members) -> bool:
    """True when a path is given twice (but a folder), or both as a file and a folder (the model)."""
    kinds = {TOP: "dir"}
    for name, kind, *_ in members:
        k = "dir" if kind == "dir" else "file"
        parts = name.split("/")
        for i in range(1, len(parts)):
            if kinds.setdefault("/".join(parts[:i]), "dir") != "dir":
                return True
        if name in kinds and (kinds[name], k) != ("dir", "dir"):
            return True
        kinds[name] = k
    return False


def _build(members, fmt) -> bytes:
    """The members as a .tar(.gz/.bz2/.xz) in GNU or pax format, or a .zip stored or deflated."""
    buf = io.BytesIO()
    if fmt.startswith("zip"):
        method = zipfile.ZIP_STORED if fmt == "zip" else zipfile.ZIP_DEFLATED
        with warnings.catch_warnings(), zipfile.ZipFile(buf, "w", method) as z:
            warnings.simplefilter("ignore")                     # duplicate names are the point
            for name, kind, data, mode, _ in members:
                info = zipfile.ZipInfo(name + ("/" if kind == "dir" else ""))
                modes = ZIP_MODES["file" if kind == "cont" else kind]
                info.external_attr, info.compress_type = modes[mode % len(modes)] << 16, method
                z.writestr(info, data)
        return buf.getvalue()
    comp, _, tar_format = fmt.partition("-")
    with tarfile.open(fileobj=buf, mode="w:" + comp,
                      format=tarfile.GNU_FORMAT if tar_format == "gnu" else tarfile.PAX_FORMAT) as t:
        for name, kind, data, _, _ in members:
            info = tarfile.TarInfo(name)
            info.type, info.size = TAR_TYPES[kind], len(data)
            info.linkname = "/etc/passwd" if kind in ("symlink", "hardlink") else ""
            t.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


FORMATS = st.sampled_from(["zip", "zip-deflated", "-gnu", "gz-pax", "bz2-gnu", "xz-pax", "gz-gnu"])
DAMAGE = st.one_of(st.just(None), st.tuples(st.sampled_from(["cut", "flip", "size"]), st.floats(0, 1)))


def _damage(blob: bytes, damage) -> bytes:
    """`blob` cut short, a byte flipped, or (an uncompressed tar) its first header's size made
    huge, its checksum right (a member past the data, like a pax size)."""
    if damage is None or not blob:
        return blob
    how, where = damage
    at = min(int(where * len(blob)), len(blob) - 1)
    if how == "size":
        if blob[257:262] != b"ustar":
            return blob
        head = bytearray(blob[:512])
        head[124:136] = b"\x80" + (1 << 62 if where > 0.5 else 8**11 - 1).to_bytes(11, "big")
        head[148:156] = b" " * 8
        head[148:156] = b"%06o\0 " % sum(head)
        return bytes(head) + blob[512:]
    return blob[:at] if how == "cut" else blob[:at] + bytes([blob[at] ^ 0x5A]) + blob[at + 1:]


def _unpack_in_sandbox(blob: bytes, fmt: str, limit: int):
    """_unpack of `blob` (as DIR/../dl/x.{zip,tar.gz}.part) into an empty data folder: (outcome,
    the data folder, the sandbox, its tree before)."""
    root = tempfile.mkdtemp(prefix="fuzz-archive-")
    os.makedirs(os.path.join(root, "dl"))
    data = os.path.join(root, "data")
    os.makedirs(data)
    name = "x.zip" if fmt.startswith("zip") else "x.tar.gz"
    archive = os.path.join(root, "dl", name + ".part")
    with open(archive, "wb") as f:
        f.write(blob)
    before = _tree(root)
    f = dl.File(f"https://example.invalid/{name}", len(blob), "0" * 64, TOP, max_unpacked=limit)
    return _one_line(lambda: dl._unpack("fuzzset", archive, f, data)), data, root, before


def _expect_tree(members) -> dict:
    out = {}
    for name, kind, data, *_ in members:
        if kind in ("file", "cont"):
            out[name] = data
    return out


@settings(FUZZ, max_examples=50)
@given(members=st.lists(member(), max_size=6), fmt=FORMATS, damage=DAMAGE,
       limit=st.sampled_from([64, 4096, 1 << 20]), dup=st.booleans())
@example(members=[("top/a", "file", b"1", 0, False)], fmt="gz-gnu", damage=None, limit=4096, dup=True)
@example(members=[("top/a", "file", b"1", 0, False), ("top/a/b", "file", b"2", 0, False)],
         fmt="gz-gnu", damage=None, limit=4096, dup=False)                     # file, then a folder
@example(members=[("top/" + "x" * 300, "file", b"1", 0, True)], fmt="gz-pax", damage=None,
         limit=4096, dup=False)                                                 # a 300-character name
@example(members=[("top/" + "d/" * 3000 + "f", "file", b"1", 0, True)], fmt="gz-pax", damage=None,
         limit=4096, dup=False)                                                 # 3,000 deep
@example(members=[("top/a", "file", b"x" * 1000, 0, False)], fmt="gz-gnu", damage=("cut", 0.6),
         limit=4096, dup=False)                                                 # a truncated gzip
@example(members=[("top/a", "file", b"x" * 1000, 0, False)], fmt="zip", damage=("flip", 0.3),
         limit=4096, dup=False)                                                 # a bad CRC
@example(members=[("top/a", "file", b"1", 1, False)], fmt="zip", damage=None, limit=4096,
         dup=False)                                                             # permission bits only
def test_archives_unpack_whole_or_are_refused_in_one_line(members, fmt, damage, limit, dup):
    """_unpack of any archive: the set whole, byte for byte, or one line and an empty data folder;
    nothing outside it touched. Undamaged, a refusal is exactly when a rule is broken."""
    if dup and members:
        members = members + [members[0]]
    try:
        blob = _damage(_build(members, fmt), damage)
    except (ValueError, OSError, tarfile.TarError):
        reject()                                     # the writer cannot make it (e.g. a NUL in pax)
    got, data, root, before = _unpack_in_sandbox(blob, fmt, limit)
    try:
        changed = {p for p in _changed(before, _tree(root)) if not _within(p, "data")}
        assert changed == set(), changed
        if got is None:
            assert os.listdir(data) == [TOP]
        else:
            assert os.listdir(data) == [], os.listdir(data)
        if damage is None:
            files = _expect_tree(members)
            broken = (any(m[4] for m in members) or _conflicts(members)
                      or sum(len(m[2]) for m in members if m[1] in ("file", "cont")) > limit)
            assert (got is None) == (not broken), (got, broken)
            for name, content in (files.items() if got is None else ()):
                with open(os.path.join(data, name), "rb") as f:
                    assert f.read() == content
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_pax_size_past_the_data_is_one_line(tmp_path):
    """A pax header that gives a member more bytes than the archive holds: one line, nothing
    unpacked."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as t:
        info = tarfile.TarInfo("top/a")
        info.size, info.pax_headers = 5, {"size": "999999"}
        t.addfile(info, io.BytesIO(b"12345"))
    got, data, root, _ = _unpack_in_sandbox(buf.getvalue(), "gz-pax", 1 << 20)
    try:
        assert isinstance(got, tasks.DataError) and "damaged" in str(got) and os.listdir(data) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- plain regressions (item 5)

@pytest.mark.parametrize("value", ["nan", "-1", "inf", "1e308", "0", "5e-324", "-inf"])
def test_a_timeout_not_a_sane_number_of_seconds_is_refused(value, tmp_path):
    data = tmp_path / "data"
    rc, out, line = _cli(["download", "wikitext2", "--data", str(data), f"--timeout={value}"])
    assert rc == 2 and "--timeout" in line and "seconds" in line and out == "" and not data.exists()


@pytest.mark.parametrize("value, words", [("mirror", "http://, https:// or file://"), ("http://[::1", "not a URL"),
                                          ("http://a\nb/", "a space or a control character"),
                                          ("", "empty"), ("http://u:p@h/", "user name"),
                                          ("http://h/?q=1", "?")])
def test_a_mirror_that_is_not_a_base_url_is_refused(value, words, tmp_path):
    data = tmp_path / "data"
    rc, out, line = _cli(["download", "wikitext2", "--data", str(data), "--from", value])
    assert rc == 2 and "--from" in line and words in line and out == "" and not data.exists()


@pytest.mark.parametrize("command", ["download", "imagenet100"])
@pytest.mark.parametrize("case, words", [("a file", "is a file"), ("under a file", "under a file"),
                                         ("not creatable", "cannot be made"), ("empty", "empty")])
def test_a_data_folder_that_cannot_be_one_is_refused(command, case, words, tmp_path):
    (tmp_path / "afile").write_text("mine\n")
    data = {"a file": str(tmp_path / "afile"), "under a file": str(tmp_path / "afile" / "sub"),
            "not creatable": "/proc/nope/data", "empty": ""}[case]
    src = _imagenet1k(str(tmp_path / "in1k")) if command == "imagenet100" else None
    before = _tree(tmp_path)
    argv = (["download", "wikitext2", "--from", "http://127.0.0.1:1"] if command == "download"
            else ["imagenet100", "--from", src])
    rc, out, line = _cli(argv + ["--data", data])
    assert rc == 2 and "--data" in line and words in line and _tree(tmp_path) == before


@pytest.mark.parametrize("reply, words", [
    (_reply(b"HTTP/1.1 200 OK", [(b"Content-Length", b"12abc")], 0, False, ZIP), "Content-Length"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", "not an HTTP reply"),
    (_reply(b"HTTP/1.1 200 OK", [], 101, False, ZIP), "100 headers"),
    (_reply(b"HTTP/1.1 200 OK", [], 0, True, ZIP), "header line"),
], ids=["non-numeric Content-Length", "not HTTP", "101 headers", "a header line too long"])
def test_a_reply_that_is_not_good_http_is_one_line(raw, reply, words, tmp_path):
    raw.reply = reply
    data = tmp_path / "data"
    got = _one_line(lambda: dl.download(["fuzzset"], str(data), raw.base, ONE, timeout=2))
    assert isinstance(got, tasks.DataError) and words in str(got), str(got)
    assert not data.exists()


@pytest.mark.parametrize("case", ["duplicate", "file then folder", "folder then file", "300 characters",
                                  "3000 deep", "truncated gzip", "bad crc", "pax size"])
def test_a_broken_archive_is_one_line_saying_what_is_wrong(case, tmp_path):
    """Item 6's cases, each named in its line; nothing left in the data folder."""
    m = {"duplicate": [("top/a", "file", b"1", 0, 0), ("top/a", "file", b"2", 0, 0)],
         "file then folder": [("top/a", "file", b"1", 0, 0), ("top/a/b", "file", b"2", 0, 0)],
         "folder then file": [("top/a", "dir", b"", 0, 0), ("top/a", "file", b"2", 0, 0)],
         "300 characters": [("top/" + "x" * 300, "file", b"1", 0, 0)],
         "3000 deep": [("top/" + "d/" * 3000 + "f", "file", b"1", 0, 0)]}
    words = {"duplicate": "given twice", "file then folder": "lies under", "folder then file": "given twice",
             "300 characters": "255 bytes", "3000 deep": "folders deep", "truncated gzip": "damaged",
             "bad crc": "damaged", "pax size": "damaged"}[case]
    if case in m:
        blob, fmt = _build(m[case], "gz-pax"), "gz-pax"
    elif case == "truncated gzip":
        blob, fmt = _build([("top/a", "file", os.urandom(3000), 0, 0)], "gz-gnu")[:-200], "gz-gnu"
    elif case == "bad crc":
        good = _build([("top/a", "file", b"x" * 1000, 0, 0)], "zip")
        at = good.index(b"x" * 1000) + 500
        blob, fmt = good[:at] + b"y" + good[at + 1:], "zip"
    else:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as t:
            info = tarfile.TarInfo("top/a")
            info.size, info.pax_headers = 5, {"size": "999999"}
            t.addfile(info, io.BytesIO(b"12345"))
        blob, fmt = buf.getvalue(), "gz-pax"
    got, data, root, _ = _unpack_in_sandbox(blob, fmt, 1 << 20)
    try:
        assert isinstance(got, tasks.DataError) and words in str(got), str(got)
        assert "nothing unpacked" in str(got) and os.listdir(data) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_zip_member_with_permission_bits_only_is_a_plain_file(tmp_path):
    """Item 6: external_attr 0o644 << 16 (no file type bits) is a file, not 'a link or a device'."""
    blob = _build([("top/", "dir", b"", 1, 0), ("top/a", "file", b"hello", 1, 0)], "zip")
    got, data, root, _ = _unpack_in_sandbox(blob, "zip", 1 << 20)
    try:
        assert got is None and open(os.path.join(data, "top", "a"), "rb").read() == b"hello"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_refused_download_says_the_part_was_deleted(files, tmp_path):
    """An unsafe archive whose sums match: its .part is deleted, and the line says so."""
    bad = _build([("top/a", "symlink", b"", 0, 0)], "zip")
    table = {"fuzzset": (_entry("bad.zip", bad, "top", 1 << 20),)}
    server = LoopServer({"bad.zip": bad})
    try:
        got = _one_line(lambda: dl.download(["fuzzset"], str(tmp_path / "d"), server.base + "/good", table))
    finally:
        server.close()
    assert isinstance(got, tasks.DataError) and "a link" in str(got) and "deleted" in str(got)
    assert os.listdir(tmp_path / "d") == [] if (tmp_path / "d").exists() else True


def test_a_full_disk_while_unpacking_keeps_the_download(files, tmp_path):
    """A write that fails on this side (ENOSPC) is not the archive's fault: one line, the checked
    .part kept for the same command, nothing unpacked; the same command then finishes."""
    data, real = tmp_path / "data", open

    def full(path, mode="r", *a, **k):
        if mode == "xb":
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, mode, *a, **k)
    with mock.patch.object(dl, "open", full, create=True):
        got = _one_line(lambda: dl.download(["fuzzset"], str(data), files.base + "/good", ONE))
    assert isinstance(got, dl.WriteError) and "No space left" in str(got) and "is kept" in str(got)
    assert os.listdir(data) == ["fuzz-1.zip.part"]
    assert _one_line(lambda: dl.download(["fuzzset"], str(data), files.base + "/good", ONE)) == 0
    assert os.listdir(data) == ["fuzz-1"]


def test_ctrl_c_during_an_imagenet100_build_is_one_line_and_leaves_nothing(in1k, tmp_path):
    """Ctrl-C while the tree is linked: Interrupted (exit status 130), the staging folder and the
    data folder made for it removed."""
    data, calls, real = tmp_path / "new" / "data", [], os.link

    def link(*a, **k):
        calls.append(a)
        if len(calls) == 50:
            raise KeyboardInterrupt
        return real(*a, **k)
    with mock.patch.object(datafetch.imagenet100.os, "link", link):
        got = _one_line(lambda: datafetch.imagenet100.build(in1k, str(data)))
    assert getattr(got, "status", None) == 130 and "nothing built" in str(got)
    assert os.listdir(tmp_path) == []


def test_a_folder_on_this_machine_is_a_mirror(tmp_path):
    """Offline, with the files put by hand in a folder: `--from FOLDER` (or its file:// URL) fetches and checks them
    as from a server; a folder that lacks a file is one line naming it."""
    local = tmp_path / "by hand"
    local.mkdir()
    (local / "fuzz-1.zip").write_bytes(ZIP)
    for i, mirror in enumerate((str(local), local.as_uri())):
        data = tmp_path / f"data{i}"
        assert dl.download(["fuzzset"], str(data), mirror, ONE) == 0
        assert (data / "fuzz-1" / "a.txt").read_bytes() == ALPHA
    got = _one_line(lambda: dl.download(["fuzzset"], str(tmp_path / "data9"), str(tmp_path), ONE))
    assert got != 0 and "fuzz-1.zip" in str(got) and "\n" not in str(got), str(got)


# ---------------------------------------------------------------------------------------- datafetch: download

@pytest.fixture
def loop_server():
    servers = []

    def start(files):
        servers.append(LoopServer(files))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def _tar_gz(folder: Path, top: str, extra=()) -> bytes:
    """folder/top as a .tar.gz (the CIFAR releases' format), plus `extra` TarInfo members (name, type, data)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(folder / top, arcname=top)
        for name, kind, data in extra:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.linkname = kind, len(data), "/etc/passwd" if kind in (tarfile.SYMTYPE,
                                                                                             tarfile.LNKTYPE) else ""
            t.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def _zip(folder: Path, top: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(top + "/", "")
        for p in sorted((folder / top).rglob("*")):
            z.write(p, p.relative_to(folder).as_posix())
    return buf.getvalue()


@pytest.fixture
def fixture_sets(tmp_path):
    """({set: (File,)}, {file name: bytes}): CIFAR-10 as its python .tar.gz, WikiText-2's tokens as its .zip and
    TinyStories' two text files, each in its release's exact layout, made small."""
    src = tmp_path / "src"
    _write_layout(src, "cifar10 python")
    make_wikitext(src)
    stories = make_tinystories(src / "ts")
    blobs = {
        "cifar-10-python.tar.gz": _tar_gz(src, "cifar-10-batches-py"),
        "wikitext-2-v1.zip": _zip(src, "wikitext-2"),
        "TinyStoriesV2-GPT4-train.txt": (stories / "TinyStoriesV2-GPT4-train.txt").read_bytes(),
        "TinyStoriesV2-GPT4-valid.txt": (stories / "TinyStoriesV2-GPT4-valid.txt").read_bytes(),
    }
    table = {"cifar10": (_entry("cifar-10-python.tar.gz", blobs["cifar-10-python.tar.gz"], "cifar-10-batches-py",
                                1 << 20),),
             "wikitext2": (_entry("wikitext-2-v1.zip", blobs["wikitext-2-v1.zip"], "wikitext-2", 1 << 20),),
             "tinystories": tuple(_entry(n, blobs[n], n) for n in ("TinyStoriesV2-GPT4-train.txt",
                                                                  "TinyStoriesV2-GPT4-valid.txt"))}
    return table, blobs


@pytest.mark.parametrize("name", ["cifar10", "wikitext2", "tinystories"])
def test_download_fetches_checks_and_unpacks_a_set_whole(name, tmp_path, loop_server, fixture_sets, capsys):
    table, blobs = fixture_sets
    server, data = loop_server(blobs), tmp_path / "data"
    assert datafetch.download.download([name], str(data), server.base + "/good", table) == 0
    assert tasks.TASKS[name].locate(str(data))                     # its reader finds it, where reproduce.sh looks
    assert sorted(os.listdir(data)) == sorted(f.target for f in table[name])    # no .part, no staging folder left
    out = capsys.readouterr().out
    assert "100%" in out and out.count("%  ") <= 10 * len(table[name]) and "is in place" in out
    assert datafetch.download.download([name], str(data), server.base + "/e404", table) == 0  # there: no request made
    assert "already there; left as it is" in capsys.readouterr().out and len(server.ranges) == len(table[name])


def test_download_refuses_a_corrupt_file_naming_both_sums_and_keeps_nothing(tmp_path, loop_server, fixture_sets):
    table, blobs = fixture_sets
    bad = bytearray(blobs["cifar-10-python.tar.gz"])
    bad[len(bad) // 2] ^= 0xFF
    server, data = loop_server({"cifar-10-python.tar.gz": bytes(bad)}), tmp_path / "data"
    (data / "notes").mkdir(parents=True)
    before = _bytes_tree(data)
    with pytest.raises(tasks.DataError) as e:
        datafetch.download.download(["cifar10"], str(data), server.base + "/good", table)
    text = str(e.value)
    assert hashlib.sha256(bytes(bad)).hexdigest() in text and table["cifar10"][0].sha256 in text and "\n" not in text
    assert _bytes_tree(data) == before


def test_download_cut_short_resumes_from_its_part_with_a_range_request(tmp_path, loop_server, fixture_sets):
    table, blobs = fixture_sets
    server, data = loop_server(blobs), tmp_path / "data"
    size = len(blobs["cifar-10-python.tar.gz"])
    with pytest.raises(tasks.DataError, match="run the same command again to resume"):
        datafetch.download.download(["cifar10"], str(data), server.base + "/cut", table)
    assert os.listdir(data) == ["cifar-10-python.tar.gz.part"]
    assert (data / "cifar-10-python.tar.gz.part").stat().st_size == size // 2
    datafetch.download.download(["cifar10"], str(data), server.base + "/good", table)
    assert server.ranges == [None, f"bytes={size // 2}-"] and os.listdir(data) == ["cifar-10-batches-py"]
    assert tasks.read_cifar(str(data), "cifar10")["train"][0].shape[0] == 10


@pytest.mark.parametrize("kind", ["link to a user's file", "link to nowhere", "folder", "hard link to a user's file",
                                  "FIFO"])
def test_download_never_writes_through_a_part_that_is_not_its_own(kind, tmp_path, loop_server, fixture_sets):
    """Issues 64 and 73's data loss: a .part that is a link (symbolic, to a user's file or dangling; hard, to a
    user's file: a regular file with two links), a folder or a FIFO is not a download of ours: refused in one line
    before any byte is fetched, without blocking, the user's file and the .part as they were (the hard link used to
    take the whole transfer, and the message said the part was deleted)."""
    table, blobs = fixture_sets
    server, data, user = loop_server(blobs), tmp_path / "data", tmp_path / "user.txt"
    data.mkdir()
    user.write_bytes(b"the user's own words\n")
    part = data / "wikitext-2-v1.zip.part"
    if kind == "folder":
        part.mkdir()
    elif kind == "FIFO":
        os.mkfifo(part)
    elif kind.startswith("hard"):
        os.link(user, part)
    else:
        part.symlink_to(user if kind.endswith("user's file") else tmp_path / "absent")
    before, words = _bytes_tree(data), user.read_bytes()
    with pytest.raises(tasks.DataError, match=r"wikitext-2-v1.zip.part is a link or not a regular file \(.*\), so "
                                              r"not a download of ours; nothing was written or removed") as err:
        with _deadline(30):
            datafetch.download.download(["wikitext2"], str(data), server.base + "/cut", table)
    assert "\n" not in str(err.value) and server.ranges == []                # refused before a request
    assert _bytes_tree(data) == before and user.read_bytes() == words and not (tmp_path / "absent").exists()
    assert os.path.islink(part) == ("link to" in kind and not kind.startswith("hard"))


def test_a_fifo_in_a_from_folder_is_one_line_and_never_blocks(tmp_path, fixture_sets):
    """Issue 73: --from FOLDER holding a FIFO where a file should be: the read checks the opened descriptor (opened
    without blocking), so one line, nothing fetched, never a hang."""
    table, _ = fixture_sets
    mirror, data = tmp_path / "mirror", tmp_path / "data"
    mirror.mkdir()
    for f in table["wikitext2"]:
        os.mkfifo(mirror / f.name)
    with pytest.raises(tasks.DataError, match=r"is a FIFO \(named pipe\), not a regular file; nothing fetched") as err:
        with _deadline(30):
            datafetch.download.download(["wikitext2"], str(data), dl.local_mirror(str(mirror)), table)
    assert "\n" not in str(err.value) and (not data.exists() or not [n for n in os.listdir(data)
                                                                   if not n.startswith(".")])


@pytest.mark.parametrize("member", [("cifar-10-batches-py/../../evil", tarfile.REGTYPE, b"x"),
                                    ("/tmp/evil", tarfile.REGTYPE, b"x"),
                                    ("cifar-10-batches-py/link", tarfile.SYMTYPE, b""),
                                    ("cifar-10-batches-py/hard", tarfile.LNKTYPE, b""),
                                    ("cifar-10-batches-py/dev", tarfile.CHRTYPE, b""),
                                    ("elsewhere/file", tarfile.REGTYPE, b"x"),
                                    ("cifar-10-batches-py/big", tarfile.REGTYPE, b"\0" * (1 << 20))])
def test_download_refuses_an_unsafe_archive_and_leaves_the_folder_as_it_was(member, tmp_path, loop_server):
    src, data = tmp_path / "src", tmp_path / "data"
    _write_layout(src, "cifar10 python")
    blob = _tar_gz(src, "cifar-10-batches-py", [member])
    table = {"cifar10": (_entry("cifar-10-python.tar.gz", blob, "cifar-10-batches-py", 1 << 20),)}
    server = loop_server({"cifar-10-python.tar.gz": blob})
    data.mkdir()
    with pytest.raises(tasks.DataError, match="refused, nothing unpacked"):
        datafetch.download.download(["cifar10"], str(data), server.base + "/good", table)
    assert os.listdir(data) == [] and not (tmp_path / "evil").exists()


@pytest.mark.parametrize("mode, words", [("e404", "HTTP 404"), ("e500", "HTTP 500"), ("stall", "stopped at 10 of")])
def test_download_server_errors_and_stalls_are_one_line(mode, words, tmp_path, loop_server, fixture_sets):
    table, blobs = fixture_sets
    server, data = loop_server(blobs), tmp_path / "data"
    t0 = time.monotonic()
    with pytest.raises(tasks.DataError, match=words) as e:
        datafetch.download.download(["cifar10"], str(data), f"{server.base}/{mode}", table, timeout=0.5)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 2.5
    assert (os.listdir(data) == ["cifar-10-python.tar.gz.part"]) if mode == "stall" else not data.exists()


def test_download_command_wiring_refusals_and_the_lock(tmp_path, loop_server, capsys):
    data = tmp_path / "data"
    server = loop_server({})
    assert train.main(["download", "cifar10", "--data", str(data), "--from", server.base + "/e404"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HTTP 404" in err and f"{server.base}/e404/cifar-10-python.tar.gz" in err
    assert train.main(["download", "imagenet100", "--data", str(data)]) == 2
    assert "python train.py imagenet100 --from" in capsys.readouterr().err and not data.exists()
    data.mkdir()
    fd = os.open(data, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert train.main(["download", "wikitext2", "--data", str(data), "--from", server.base + "/good"]) == 75
        assert "another download" in capsys.readouterr().err
    finally:
        os.close(fd)
    assert os.listdir(data) == []


def test_progress_draws_a_bar_on_a_terminal_and_lines_in_a_log():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        p = datafetch.download.Progress(1000, 0, stream)
        for got in range(50, 1001, 50):
            p.update(got)
        p.done()
    assert "\r  [" in tty.getvalue() and "MiB/s" in tty.getvalue() and "ETA" in tty.getvalue()
    assert log.getvalue().count("\n") == 10 and "\r" not in log.getvalue() and " 100%" in log.getvalue()


def test_pinned_sources_name_their_sums_and_the_readers_folders():
    for name, files in datafetch.download.SOURCES.items():
        for f in files:
            assert len(f.sha256) == 64 and f.size > 0 and f.url.endswith("/" + f.name)
            assert (f.md5 is not None) == name.startswith("cifar") or name == "wikitext2"
    assert [f.target for f in datafetch.download.SOURCES["wikitext2"]] == [
        tasks.WIKITEXT_RELEASES[r][0] for r in ("tokens", "raw")
    ]


# ---- imagenet100: the 100 classes from an ImageNet-1k folder

def _imagenet1k_folder(root: Path, skip=()) -> Path:
    for split in ("train", "val"):
        for w in tasks.IMAGENET100_WNIDS + ("n99999999",):             # one class not of the 100
            if (split, w) not in skip:
                write(root / split / w / f"{w}_{split}.JPEG", f"{split} {w}")
    return root


def test_imagenet100_builds_the_tree_with_hard_links(tmp_path):
    src, data = _imagenet1k_folder(tmp_path / "in1k"), tmp_path / "data"
    line = datafetch.imagenet100.build(str(src), str(data))
    assert "200 images, hard links" in line and os.listdir(data) == ["imagenet100"]
    assert tasks.imagenet100_layout(str(data / "imagenet100")) == "folder"
    assert sorted(os.listdir(data / "imagenet100" / "val")) == sorted(tasks.IMAGENET100_WNIDS)
    w = tasks.IMAGENET100_WNIDS[5]
    assert os.path.samefile(
        data / "imagenet100" / "train" / w / f"{w}_train.JPEG", src / "train" / w / f"{w}_train.JPEG"
    )
    assert "already there; left as it is" in datafetch.imagenet100.build(str(src), str(data))


def test_imagenet100_copies_where_links_are_refused(tmp_path, monkeypatch):
    src, data = _imagenet1k_folder(tmp_path / "in1k"), tmp_path / "data"

    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "cross-device link")
    monkeypatch.setattr(datafetch.imagenet100.os, "link", refuse)
    assert "0 hard links, 200 copies" in datafetch.imagenet100.build(str(src), str(data))
    w = tasks.IMAGENET100_WNIDS[0]
    assert (data / "imagenet100" / "val" / w / f"{w}_val.JPEG").read_text() == f"val {w}"


@pytest.mark.parametrize("case", ["missing class", "empty class", "a symlink"])
def test_imagenet100_refuses_an_incomplete_source_and_builds_nothing(case, tmp_path):
    w = tasks.IMAGENET100_WNIDS[7]
    src = _imagenet1k_folder(tmp_path / "in1k", skip={("val", w)} if case == "missing class" else ())
    if case == "empty class":
        (src / "val" / w / f"{w}_val.JPEG").unlink()
    if case == "a symlink":
        os.symlink("/etc/hostname", src / "train" / w / "x.JPEG")
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(tasks.DataError, match="nothing built"):
        datafetch.imagenet100.build(str(src), str(data))
    assert os.listdir(data) == []
    assert train.main(["imagenet100", "--from", str(src), "--data", str(data)]) == 2
