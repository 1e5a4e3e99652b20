"""The paper's public data sets fetched into a data folder in one command, checked, resumable, extracted safely.

    python train.py download cifar10 cifar100 wikitext2 tinystories --data data
    python train.py download cifar10 --data data --from https://mirror.example/cifar     # same file, same sum
    python train.py imagenet100 --from /datasets/imagenet --data data                 # see datafetch/imagenet100.py

Each file of a set (SOURCES) goes the same way:

1. its target in DIR (the folder its archive unpacks to, or the text file) already there: one line, left as it is;
2. fetched to DIR/FILE.part, resumed from where a cut transfer stopped (an HTTP Range request), with a progress bar on a
   terminal (bytes, rate, ETA) and a line per 10% otherwise; then the whole file's sha256 (and md5, where its authors
   publish one) is checked against the pinned sum: a mismatch is one line naming both sums, and the .part is deleted (a
   wrong whole file cannot be resumed into a right one);
3. an archive is unpacked into a hidden staging folder in DIR, member by member: every member under the archive's one
   top folder, no absolute path or `..`, no links or devices, each path given once (a folder may be given again), no
   member under a file member, at most DEPTH_MAX folders deep and names a file system holds (MEMBER_MUST), at most
   `max_unpacked` bytes in all; the set's reader must then find it there (`Task.locate`) before the folder is renamed
   into place (datafetch.write.write_new_dataset), so DIR holds the set whole or not at all; then the .part is deleted.

The arguments are checked before anything is written (`refusal`, and `datafetch.write.make_folder` for DIR): bad
input is one line, exit status 2. Every failure after is a DataError (train.py: one line, exit status 2) that leaves
DIR as it was, but for a resumable .part: whatever urllib, http.client, socket or ssl raise (NET_WORDS), and
whatever a damaged archive makes tarfile or zipfile raise (DAMAGED), is worded at that boundary. Ctrl-C is one line
too (Interrupted, exit status 130), saying what .part is kept for the same command to resume from. One download into
a folder at a time (a lock on DIR; a second is refused with exit status 75). Standard library only."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import os
import pathlib
import re
import shutil
import stat
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass

import runfiles
import tasks
from datafetch.write import Interrupted, data_folder, encodable, write_new_dataset

try:
    import lzma
except ImportError:             # a Python built without it: tarfile reads no .tar.xz either
    lzma = None

try:
    import fcntl
except ImportError:             # not on POSIX: the data folder is not locked
    fcntl = None


@dataclass(frozen=True)
class File:
    """One published file: where it is, its size and sums, and what it becomes in DIR (`target`:
    the top folder of an archive, whose members all lie under it, or the name of a plain file)."""
    url: str
    size: int
    sha256: str
    target: str
    md5: str | None = None          # where the authors publish one (CIFAR): checked too
    max_unpacked: int = 0           # an archive: the most bytes its members may hold (0: a plain file)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


MB = 1 << 20

# The sources, pinned: a file whose sum differs is refused, from whichever mirror it came (--from).
SOURCES = {
    "cifar10": (File("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", 170_498_071,
                     "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce", "cifar-10-batches-py",
                     md5="c58f30108f718f92721af3b95e74349a", max_unpacked=200 * MB),),
    "cifar100": (File("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", 169_001_437,
                      "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7", "cifar-100-python",
                      md5="eb9058c3a382ffc7106e4002c42a8d85", max_unpacked=200 * MB),),
    "wikitext2": (File("https://wikitext.smerity.com/wikitext-2-v1.zip", 4_475_746,
                       "92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c", "wikitext-2",
                       md5="542ccefacc6c27f945fb54453812b3cd", max_unpacked=16 * MB),
                  File("https://wikitext.smerity.com/wikitext-2-raw-v1.zip", 4_721_645,
                       "ef7edb566e3e2b2d31b29c1fdb0c89a4cc683597484c3dc2517919c615435a11", "wikitext-2-raw",
                       max_unpacked=16 * MB)),
    "tinystories": (File("https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/"
                         "TinyStoriesV2-GPT4-train.txt", 2_227_753_162,
                         "6418d412de72888f52b5142c761ac21a582f7d1166f0bfbdb5f03ccfdec90443",
                         "TinyStoriesV2-GPT4-train.txt"),
                    File("https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/"
                         "TinyStoriesV2-GPT4-valid.txt", 22_502_601,
                         "6874bae9a4c1a4e7edcf0e53b86c17817e9cf881fc75ff2368da457b80c0585d",
                         "TinyStoriesV2-GPT4-valid.txt")),
}
NOT_DOWNLOADABLE = {"imagenet100": "ImageNet needs a licence and is not downloaded: build "
                                   "ImageNet-100 from an ImageNet-1k copy with python train.py "
                                   "imagenet100 --from IMAGENET_1K_DIR --data DIR"}
CHUNK = 1 << 20
MIN_TIMEOUT, MAX_TIMEOUT = 0.001, 3600.0    # below a millisecond a socket's timeout rounds to 0
NAME_MAX, PATH_MAX, DEPTH_MAX = 255, 1024, 64     # what a member's path may be (bytes, folders)

# download's arguments, checked before anything is written: (test, what was expected)
TIMEOUT_MUST = (lambda t: type(t) in (int, float) and MIN_TIMEOUT <= t <= MAX_TIMEOUT,   # NaN: neither
                f"a number of seconds from {MIN_TIMEOUT} to {MAX_TIMEOUT:,.0f}, how long a transfer "
                "waits for a byte before it stops (the default is 30)")
# --from: (test on the text and its urlsplit parts, what is wrong), the first that fails is the line
SOURCE_MUST = (
    (lambda s, u: isinstance(s, str), "is not text"),
    (lambda s, u: s != "", "is empty"),
    (lambda s, u: s.isascii(), "holds a character that is not ASCII (percent-encode it; a host in its xn-- form)"),
    (lambda s, u: s.isprintable() and " " not in s, "holds a space or a control character"),
    (lambda s, u: u is not None, "is not a URL urllib can read (a bad [IPv6] host, or a port not in 0..65535)"),
    (lambda s, u: u.scheme in ("http", "https", "file"), "does not start with http://, https:// or file://"),
    (lambda s, u: bool(u.hostname) or u.scheme == "file", "names no host"),
    (lambda s, u: u.username is None and u.password is None,
     "holds a user name or password, which the download does not send"),
    (lambda s, u: not (u.query or u.fragment), "has a ? or # part, so no file name can follow it"),
)
# The reader's boundary: what urllib, http.client, socket and ssl raise (ssl.SSLError and a
# socket's timeout are OSErrors, a bad host name a ValueError), each named in words; first match
NET_WORDS = ((urllib.error.HTTPError, "the server answered HTTP {code}"),
             (http.client.RemoteDisconnected, "the server closed the connection without a reply"),
             (http.client.BadStatusLine, "the reply is not an HTTP reply"),
             (http.client.HTTPException, "the reply is not good HTTP"),
             (urllib.error.URLError, "cannot connect"),
             (OSError, "the connection failed"),
             (ValueError, "cannot connect"))
NET_ERRORS = tuple(kind for kind, _ in NET_WORDS)
# what the archive readers (tarfile, zipfile, gzip, bz2, lzma, zlib) raise on a damaged archive
DAMAGED = (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, ValueError, OverflowError,
           NotImplementedError, RuntimeError, zlib.error) + ((lzma.LZMAError,) if lzma else ())
# a zip member's kind by the file type bits of its Unix mode (external_attr >> 16); 0, none given
# (DOS, or permission bits only): a file, or a folder by its trailing /. Any other: "other"
ZIP_KINDS = {0: None, stat.S_IFREG: None, stat.S_IFDIR: "dir", stat.S_IFLNK: "link",
             stat.S_IFCHR: "device", stat.S_IFBLK: "device", stat.S_IFIFO: "pipe"}
TAR_KINDS = {tarfile.SYMTYPE: "link", tarfile.LNKTYPE: "link", tarfile.CHRTYPE: "device",
             tarfile.BLKTYPE: "device", tarfile.FIFOTYPE: "pipe"}
KIND_WORDS = {"file": "file", "dir": "folder"}
REFUSED_KINDS = {"link": "a link", "device": "a device", "pipe": "a pipe (FIFO)",
                 "other": "a special member, not a file or a folder"}
# every member's path, split at / (and \): (test, what is wrong), the first that fails is the line
MEMBER_MUST = (
    (lambda name, parts, kind, f: (not name.startswith(("/", "\\")) and parts[:1] == [f.target]
                                   and ".." not in parts and "" not in parts[1:]
                                   and (len(parts) > 1 or kind == "dir")), "lies outside {target}/"),
    (lambda name, parts, kind, f: len(parts) <= DEPTH_MAX, f"is more than {DEPTH_MAX} folders deep"),
    (lambda name, parts, kind, f: max(map(_size, parts)) <= NAME_MAX,
     f"has a name longer than {NAME_MAX} bytes, more than a file system holds"),
    (lambda name, parts, kind, f: _size(name) <= PATH_MAX, f"is longer than {PATH_MAX} bytes"),
    (lambda name, parts, kind, f: "\0" not in name and encodable(name),
     "has a name no file system holds (a NUL, or not Unicode)"),
)


class WriteError(tasks.DataError):
    """Unpacking failed on this side (the disk, the folder), not the archive's: the download is kept."""


def download(names, data_dir: str, mirror: str | None = None, sources: dict = SOURCES, timeout: float = 30.0) -> int:
    """Fetch, check and unpack each named set of `sources` into `data_dir` (see the module's docstring); `mirror`: a
    base URL that holds the same file names. Its arguments are checked first (nothing written on a refusal). Returns
    0; DataError or UsageError (exit 2), BusyError (75) or Interrupted (Ctrl-C: 130) otherwise, each one line."""
    mirror = local_mirror(mirror)
    if error := refusal(names, mirror, timeout, sources):
        raise error
    with data_folder(data_dir, "--data"), _locked(data_dir):
        for n in dict.fromkeys(names):
            for f in sources[n]:
                with _resumable(f, data_dir):
                    _fetch_one(n, f, data_dir, mirror, timeout)
    return 0


def local_mirror(mirror):
    """--from a folder on this machine (where the files were put by hand, offline) -> its file:// URL; else as given."""
    if isinstance(mirror, str) and mirror and "://" not in mirror and os.path.isdir(mirror):
        return pathlib.Path(mirror).resolve().as_uri()
    return mirror


def refusal(names, mirror, timeout, sources: dict) -> Exception | None:
    """download's arguments in one pass: the error saying what is first wrong (a set it cannot fetch, a --from
    that is not a base URL file names can follow by SOURCE_MUST, a --timeout outside TIMEOUT_MUST), else None."""
    for n in names:
        if n not in sources:
            return tasks.DataError(NOT_DOWNLOADABLE.get(n) or f"unknown data set {n!r}; downloadable: "
                                   f"{', '.join(sources)}")
    parts = _split_url(mirror) if isinstance(mirror, str) else None
    for test, wrong in SOURCE_MUST if mirror is not None else ():
        if not test(mirror, parts):
            return runfiles.UsageError(f"--from {mirror!r} {wrong}; give the base URL of a mirror that holds the "
                                       "same file names, e.g. https://mirror.example/data, or a folder holding "
                                       "them, or leave --from out for the authors' servers")
    test, expected = TIMEOUT_MUST
    return None if test(timeout) else runfiles.UsageError(f"--timeout {timeout!r} is not {expected}")


def _split_url(text: str):
    """urlsplit's parts of `text`, or None where urllib cannot read it (a bad [IPv6] host, a port out of range)."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port
        return parts
    except ValueError:
        return None


@contextlib.contextmanager
def _locked(folder: str):
    """An exclusive lock on the data folder, refused at once (BusyError) while another download holds it."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise runfiles.BusyError(f"another download into {folder} is running; wait for it, or give "
                                         "another --data") from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _resumable(f: File, data_dir: str):
    """Ctrl-C while `f` is fetched, checked or unpacked: one line saying what is kept
    (Interrupted: exit status 130); its .part stays, for the same command to resume from."""
    try:
        yield
    except KeyboardInterrupt:
        part = os.path.join(data_dir, f.name + ".part")
        try:
            info = os.lstat(part)
            kept = info.st_size if stat.S_ISREG(info.st_mode) else None
        except OSError:
            kept = None
        raise Interrupted(f"interrupted: {part} is kept, {kept:,} of the {f.size:,} bytes of {f.name}; run the same "
                          "command again to resume from it" if kept is not None else f"interrupted before {f.name} "
                          "was fetched; nothing written for it: run the same command again") from None


def _fetch_one(set_name: str, f: File, data_dir: str, mirror: str | None, timeout: float) -> None:
    target = os.path.join(data_dir, f.target)
    if os.path.lexists(target):
        print(f"{set_name}: {target} is already there; left as it is", flush=True)
        return
    url = f"{mirror.rstrip('/')}/{f.name}" if mirror is not None else f.url
    part = os.path.join(data_dir, f.name + ".part")
    have = _own_part(part)
    _check_room(set_name, f, part, have, data_dir)
    if have < f.size:
        print(f"{set_name}: {url} ({f.size / MB:,.1f} MiB{f', resuming at {have / MB:,.1f} MiB' if have else ''})",
              flush=True)
        _transfer(url, part, have, f.size, timeout)
    _check_sums(part, f)
    if f.max_unpacked:
        _unpack_part(set_name, part, f, data_dir)
    else:
        _place(part, target, f)
    print(f"{set_name}: {target} is in place", flush=True)


def _check_room(set_name: str, f: File, part: str, have: int, data_dir: str) -> None:
    """The .part no longer than the file, and room in DATA for the rest and what it unpacks to."""
    if have > f.size:
        raise tasks.DataError(f"{part} holds {have:,} bytes, more than the {f.size:,} of {f.name}; it "
                          "is not a cut download of it: move it away and run again")
    need = f.size - have + f.max_unpacked
    free = shutil.disk_usage(data_dir).free
    if free < need:
        raise tasks.DataError(f"{set_name}: {data_dir} has {free / MB:,.0f} MiB free, {f.name} needs "
                          f"{need / MB:,.0f} MiB (the rest of the download and what it unpacks to)")


def _unpack_part(set_name: str, part: str, f: File, data_dir: str) -> None:
    """The checked archive unpacked, then deleted. A refused one is deleted too (a checked file that is unsafe stays
    unsafe), and the line says so; a failed write on this side (WriteError) or Ctrl-C keeps it, to unpack again."""
    try:
        _unpack(set_name, part, f, data_dir)
    except WriteError as e:
        raise WriteError(f"{e}; {part} is kept: run the same command again once that is fixed") from None
    except tasks.DataError as e:
        _remove_part(part)
        raise tasks.DataError(f"{e}; deleted {part}") from None
    _remove_part(part)


def _place(part: str, target: str, f: File) -> None:
    """A checked file, still ours, hard-linked into place (never over one that appeared), then its .part deleted."""
    _own_part(part)
    try:
        os.link(part, target)
    except FileExistsError:
        raise tasks.DataError(f"{target} appeared while {f.name} downloaded; left as it is ({part} kept)") from None
    except OSError as e:
        raise tasks.DataError(f"cannot link {part} to {target} ({e.strerror}); {part} kept") from None
    os.remove(part)


def _own_part(part: str) -> int:
    """The bytes of a cut download of ours at `part` (0: none): opened without following a link or blocking on a FIFO
    and checked on its descriptor (`runfiles.own_problem`: a regular file of this user with one link). Else (a link, a
    hard link to someone's file, a folder, a FIFO) it is not ours: one line, nothing written through it or removed."""
    try:
        fd = os.open(part, os.O_RDONLY | runfiles.NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return 0
    except OSError as e:
        problem = e.strerror
    else:
        info = os.fstat(fd)
        os.close(fd)
        problem = runfiles.own_problem(info)
    if problem:
        raise tasks.DataError(f"{part} is a link or not a regular file ({problem}), so not a download of ours; "
                              "nothing was written or removed: move it away and run again")
    return info.st_size


def _remove_part(part: str) -> None:
    """Delete the .part where it is still ours (`_own_part`: a DataError, nothing removed, where it is not)."""
    _own_part(part)
    os.remove(part)


def _open_part(part: str, have: int):
    """`part` opened for writing where it is provably ours: appended to from byte `have` (opened without following a
    link or blocking, and checked on the descriptor: `runfiles.own_problem`, `have` bytes long), or made new (O_EXCL)
    from 0, an earlier .part of ours removed first (a server that ignored the range starts over)."""
    if not have:
        with contextlib.suppress(FileNotFoundError):
            _remove_part(part)
    flags = os.O_WRONLY | runfiles.NOFOLLOW | os.O_NONBLOCK | (os.O_APPEND if have else os.O_CREAT | os.O_EXCL)
    try:
        fd = os.open(part, flags, 0o666)
    except OSError as e:
        what = "became a link or a FIFO" if e.errno in (errno.ELOOP, errno.ENXIO, errno.EEXIST) else "cannot be written"
        raise tasks.DataError(f"{part} {what} while it downloaded ({e.strerror}), so not a download of ours; nothing "
                              "was written through it: move it away and run again") from None
    info = os.fstat(fd)
    problem = runfiles.own_problem(info) or (f"holds {info.st_size:,} bytes, not the {have:,} checked"
                                            if info.st_size != have else None)
    if problem:
        os.close(fd)
        raise tasks.DataError(f"{part} {problem}, so not a download of ours; nothing was written through it: move it "
                              "away and run again")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def _transfer(url: str, part: str, have: int, size: int, timeout: float) -> None:
    """Stream `url` into `part` from byte `have` (a Range request); a server that ignores the range
    starts over. Whatever the network or the server does is one line (a DataError)."""
    with _open_url(url, have, timeout) as response:
        have = _start_of(response, url, have, size)
        progress = Progress(size, have)
        try:
            with _open_part(part, have) as out:
                got = _copy(response, out, url, part, have, size, progress)
        finally:
            progress.done()
    if got < size:
        raise tasks.DataError(f"{url}: the transfer stopped at {got:,} of {size:,} bytes; run the "
                              f"same command again to resume from {part}")


class _LocalReply:
    """A file of a --from folder on this machine as a reply: opened through `runfiles.open_back` (a regular file,
    checked on its descriptor: a FIFO never blocks), from byte `have` (206) or the start (200)."""
    def __init__(self, path: str, have: int):
        try:
            self.file = runfiles.open_back(path)
        except runfiles.ReadError as e:
            raise tasks.DataError(f"--from: {e}; nothing fetched") from None
        size = os.fstat(self.file.fileno()).st_size
        self.status = 206 if have and have <= size else 200
        self.file.seek(have if self.status == 206 else 0)
        self.headers = {"Content-Length": str(size - self.file.tell())}
        self.read1 = self.file.read1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def _open_url(url: str, have: int, timeout: float):
    """The reply to a GET of `url` from byte `have` (a file:// URL, a --from folder's file: `_LocalReply`); an HTTP
    error status, or anything the network stack raises on the way, is one line."""
    if url.startswith("file://"):
        return _LocalReply(urllib.request.url2pathname(urllib.parse.urlparse(url).path), have)
    headers = {"User-Agent": "maskprior-download", **({"Range": f"bytes={have}-"} if have else {})}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except NET_ERRORS as e:
        raise tasks.DataError(f"{url}: {_failure(e)}; try again later, check the network, or give a "
                              "mirror with --from URL (the same file name under it)") from None


def _start_of(response, url: str, have: int, size: int) -> int:
    """Where the reply's bytes start in the file: `have` for a 206, else 0 (the server ignored the
    range). One line where its Content-Length is not a number, or not the rest of the file."""
    start = have if have and response.status == 206 else 0
    length = response.headers.get("Content-Length")
    if length is not None and not re.fullmatch(r"\s*[0-9]{1,19}\s*", length):
        raise tasks.DataError(f"{url} sent a Content-Length that is not a number "
                              f"({_words(repr(length))}): not a reply to fetch from; nothing fetched")
    if length is not None and start + int(length) != size:
        raise tasks.DataError(f"{url} serves {int(length):,} bytes from byte {start:,}; the pinned "
                              f"file has {size:,}: another file, nothing fetched")
    return start


def _copy(response, out, url: str, part: str, got: int, size: int, progress) -> int:
    """The reply's bytes appended to `out` (the .part, holding `got`) up to the pinned `size`; returns its bytes then.
    A stall, a cut or a broken reply is one line and keeps the part, to resume; more bytes than the file deletes it."""
    while True:
        try:
            chunk = response.read1(CHUNK)           # what has come, not a full chunk: a stall keeps it
        except NET_ERRORS as e:
            raise tasks.DataError(f"{url}: the transfer stopped at {got:,} of {size:,} bytes ({_failure(e)}); run "
                                  f"the same command again to resume from {part}") from None
        if not chunk:
            return got
        if got + len(chunk) > size:
            out.close()
            _remove_part(part)
            raise tasks.DataError(f"{url} sent more than the {size:,} bytes of the pinned file; deleted {part}")
        try:
            out.write(chunk)
            out.flush()
        except OSError as e:
            raise tasks.DataError(f"cannot write {part} ({e.strerror}); the {got:,} bytes before "
                                  "are kept: make room and run the same command again") from None
        got += len(chunk)
        progress.update(got)


def _failure(e: BaseException) -> str:
    """What went wrong at the reader's boundary, in words (NET_WORDS) and the library's own."""
    words = next(w for kind, w in NET_WORDS if isinstance(e, kind))
    return f"{words.format(code=getattr(e, 'code', ''))} ({_words(getattr(e, 'reason', None) or e)})"


def _words(x, most: int = 200) -> str:
    """A third party's words (an exception, a reason phrase) as one printable line of at most `most` characters."""
    text = " ".join(str(x).split()) or type(x).__name__
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= most else text[:most - 3] + "..."


class Progress:
    """A bar on a terminal (bytes, rate, ETA), redrawn at most 10 times a second; a line per 10% otherwise."""

    def __init__(self, size: int, start: int, stream=None):
        self.size, self.start, self.t0 = size, start, time.monotonic()
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.shown, self.last = 10 * start // size, 0.0

    def update(self, got: int) -> None:
        now = time.monotonic()
        rate = (got - self.start) / max(now - self.t0, 1e-6)
        eta = (self.size - got) / rate if rate > 0 else float("inf")
        text = f"{got / MB:9,.1f} / {self.size / MB:,.1f} MiB  {rate / MB:6.1f} MiB/s  ETA {_clock(eta)}"
        if self.tty:
            if now - self.last >= 0.1 or got == self.size:
                self.stream.write(f"\r  [{'#' * (30 * got // self.size):<30}] {text}")
                self.stream.flush()
                self.last = now
        elif 10 * got // self.size > self.shown:
            self.shown = 10 * got // self.size
            self.stream.write(f"  {10 * self.shown:3d}%  {text}\n")
            self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    if seconds == float("inf"):
        return "--:--"
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def _check_sums(part: str, f: File) -> None:
    """The whole file's sha256 (and md5) against the pinned ones; a mismatch deletes the .part."""
    sha, md5 = hashlib.sha256(), hashlib.md5()
    for block in _chunks(lambda: runfiles.open_back(part)):
        sha.update(block)
        md5.update(block)
    for kind, got, want in (("sha256", sha.hexdigest(), f.sha256), ("md5", md5.hexdigest(), f.md5)):
        if want and got != want:
            _remove_part(part)
            raise tasks.DataError(f"{f.name}: {kind} {got}, the pinned one is {want}: a corrupt transfer or another "
                                  "file; deleted, nothing unpacked (run again to fetch it afresh)")


def _unpack(set_name: str, archive: str, f: File, data_dir: str) -> None:
    """The archive's members under f.target/ into DIR/f.target, whole (a staging folder renamed into place), after
    every member is checked (`_members`, `_member_path`, `_claim`) and the set's reader finds it. A damaged or unsafe
    archive is one line (DataError); a write that fails on this side a WriteError; either way nothing is left in DIR."""
    def write(tmp):
        seen, total = {"": "dir"}, 0
        for name, kind, read in _members(archive, f):
            path = _member_path(name, f, kind)
            _claim(seen, path, kind, name, f)
            total = _write_member(os.path.join(tmp, *path.split("/")) if path else tmp, kind, read, total, f, name)
        task = tasks.TASKS.get(set_name)
        if task is not None:
            task.locate(tmp)            # the reader finds the set where it will lie (DataError if not)
    write_new_dataset(data_dir, f.target, write)


def _write_member(dest: str, kind: str, read, total: int, f: File, name: str) -> int:
    """One checked member at `dest` (a folder, or a file's bytes counted to f.max_unpacked); returns bytes so far."""
    try:
        if kind == "dir":
            os.makedirs(dest, exist_ok=True)
            return total
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "xb") as out:
            for block in _read_guarded(_chunks(read), f):
                total += len(block)
                if total > f.max_unpacked:
                    raise tasks.DataError(f"{f.name} unpacks to more than {f.max_unpacked:,} bytes, the most its "
                                          "set holds: refused, nothing unpacked")
                out.write(block)
    except OSError as e:
        raise WriteError(f"{f.name}: cannot write its member {_shown(name)} ({e.strerror}); nothing unpacked") from None
    return total


def _chunks(read):
    with read() as src:
        yield from iter(lambda: src.read(CHUNK), b"")


def _members(archive: str, f: File):
    """(name, "file" or "dir", open) of each member; one line (DataError) for a member of any
    other kind (REFUSED_KINDS) or a damaged archive."""
    entries = _zip_entries(archive) if archive.endswith(".zip.part") else _tar_entries(archive)
    for name, kind, read in _read_guarded(entries, f):
        if kind not in ("file", "dir"):
            raise tasks.DataError(f"{f.name}: member {_shown(name)} is {REFUSED_KINDS[kind]}: "
                                  "refused, nothing unpacked")
        yield name, kind, read


def _zip_entries(archive: str):
    with runfiles.open_back(archive) as raw, zipfile.ZipFile(raw) as z:
        for info in z.infolist():
            kind = ZIP_KINDS.get(stat.S_IFMT(info.external_attr >> 16), "other")
            yield (info.filename, kind or ("dir" if info.is_dir() else "file"), lambda i=info: z.open(i))


def _tar_entries(archive: str):
    with runfiles.open_back(archive) as raw, tarfile.open(fileobj=raw, mode="r:*") as t:
        for m in t:
            kind = "file" if m.isfile() else "dir" if m.isdir() else TAR_KINDS.get(m.type, "other")
            yield m.name, kind, lambda m=m: t.extractfile(m)


def _read_guarded(items, f: File):
    """The items of `items`, a generator that reads the archive, with whatever a damaged archive
    makes the readers raise (DAMAGED) turned into one line."""
    while True:
        try:
            item = next(items)
        except StopIteration:
            return
        except DAMAGED as e:
            raise tasks.DataError(f"{f.name} is a damaged archive ({_words(e)}): refused, nothing unpacked") from None
        yield item


def _member_path(name: str, f: File, kind: str) -> str:
    """A member's path below f.target/ ('' for the top folder itself); one line (DataError) for
    anything outside it, too deep or too long for a file system (MEMBER_MUST)."""
    parts = [p for p in name.replace("\\", "/").rstrip("/").split("/") if p != "."]
    for test, wrong in MEMBER_MUST:
        if not test(name, parts, kind, f):
            raise tasks.DataError(f"{f.name}: member {_shown(name)} {wrong.format(target=f.target)}: "
                                  "refused, nothing unpacked")
    return "/".join(parts[1:])


def _claim(seen: dict, path: str, kind: str, name: str, f: File) -> None:
    """Record member `path` (and the folders it lies in) in `seen` (path -> kind); one line for a
    path given twice (a folder may be) or for a member under a file member."""
    parts = path.split("/") if path else []
    for i in range(1, len(parts)):
        above = "/".join(parts[:i])
        if seen.setdefault(above, "dir") != "dir":
            raise tasks.DataError(f"{f.name}: member {_shown(name)} lies under {f.target}/{above}, "
                                  "a file member: refused, nothing unpacked")
    if path in seen and (kind, seen[path]) != ("dir", "dir"):
        raise tasks.DataError(f"{f.name}: member {_shown(name)} is given twice (as a {KIND_WORDS[seen[path]]}, "
                              f"then as a {KIND_WORDS[kind]}): refused, nothing unpacked")
    seen[path] = kind


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _shown(name: str, most: int = 80) -> str:
    """A member's name as it goes in a line: quoted, escaped, at most `most` characters."""
    text = repr(name)
    return text if len(text) <= most else text[:most - 5] + "...'"
