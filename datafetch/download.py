"""The paper's public data sets fetched into a data folder in one command, checked, resumable,
extracted safely.

    python train.py download cifar10 cifar100 wikitext2 tinystories --data data
    python train.py download cifar10 --data data --from https://mirror.example/cifar     # same file, same sum
    python train.py imagenet100 --from /datasets/imagenet --data data                 # see datafetch/imagenet100.py

Each file of a set (SOURCES) goes the same way:

1. its target in DIR (the folder its archive unpacks to, or the text file) already there: one line,
   left as it is;
2. fetched to DIR/FILE.part, resumed from where a cut transfer stopped (an HTTP Range request),
   with a progress bar
   on a terminal (bytes, rate, ETA) and a line per 10% otherwise; then the whole file's sha256 (and md5, where its
   authors publish one) is checked against the pinned sum: a mismatch is one line naming both sums, and the .part
   is deleted (a wrong whole file cannot be resumed into a right one);
3. an archive is unpacked into a hidden staging folder in DIR, member by member: every member under
   the archive's
   one top folder, no absolute path or `..`, no links or devices, at most `max_unpacked` bytes in all; the set's
   reader must then find it there (`Task.locate`) before the folder is renamed into place (datafetch.write.write_new_dataset),
   so DIR holds the set whole or not at all; the .part is deleted once the set is in.

Every failure is a DataError (train.py: one line, exit status 2) that leaves DIR as it was, but for
a resumable .part. One download into a folder at a time (a lock on DIR; a second is refused with
exit status 75). Standard library only.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass

import runfiles
import tasks
from datafetch.write import write_new_dataset

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
    # an archive: the most bytes its members may hold (0: a plain file)
    max_unpacked: int = 0

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


def say(text: str) -> None:
    print(text, flush=True)


def download(names, data_dir: str, mirror: str | None = None, sources: dict = SOURCES,
             timeout: float = 30.0) -> int:
    """Fetch, check and unpack each named set of `sources` into `data_dir` (see the module's
    docstring); `mirror`: a base URL that holds the same file names. Returns 0; DataError (exit 2)
    or BusyError (75) otherwise."""
    for n in names:
        if n not in sources:
            raise tasks.DataError(NOT_DOWNLOADABLE.get(n)
                              or f"unknown data set {n!r}; downloadable: {', '.join(sources)}")
    created = not os.path.isdir(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    try:
        with _locked(data_dir):
            for n in dict.fromkeys(names):
                for f in sources[n]:
                    _fetch_one(n, f, data_dir, mirror, timeout)
    except BaseException:
        if created and not os.listdir(data_dir):
            os.rmdir(data_dir)                 # DIR as it was: not there
        raise
    return 0


class _locked:
    """An exclusive lock on the data folder, refused at once (BusyError) while another download
    holds it."""

    def __init__(self, folder: str):
        self.folder = folder

    def __enter__(self):
        self.fd = os.open(self.folder, os.O_RDONLY)
        if fcntl is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self.fd)
                raise runfiles.BusyError(f"another download into {self.folder} is running; wait for it, "
                                   "or give another --data") from None
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _fetch_one(set_name: str, f: File, data_dir: str, mirror: str | None, timeout: float) -> None:
    target = os.path.join(data_dir, f.target)
    if os.path.lexists(target):
        say(f"{set_name}: {target} is already there; left as it is")
        return
    url = f"{mirror.rstrip('/')}/{f.name}" if mirror else f.url
    part = os.path.join(data_dir, f.name + ".part")
    have = _own_part(part)
    if have > f.size:
        raise tasks.DataError(f"{part} holds {have:,} bytes, more than the {f.size:,} of {f.name}; it "
                          "is not a cut download of it: move it away and run again")
    need = f.size - have + f.max_unpacked
    free = shutil.disk_usage(data_dir).free
    if free < need:
        raise tasks.DataError(f"{set_name}: {data_dir} has {free / MB:,.0f} MiB free, {f.name} needs "
                          f"{need / MB:,.0f} MiB (the rest of the download and what it unpacks to)")
    if have < f.size:
        say(f"{set_name}: {url} ({f.size / MB:,.1f} "
            f"MiB{f', resuming at {have / MB:,.1f} MiB' if have else ''})")
        _transfer(url, part, have, f.size, timeout)
    _check_sums(part, f)
    if f.max_unpacked:
        try:
            _unpack(set_name, part, f, data_dir)
        finally:
            # unpacked, or refused (a checked file that is unsafe stays unsafe)
            os.remove(part)
    else:
        try:
            # refused if the target appeared meanwhile: never overwritten
            os.link(part, target)
        except FileExistsError:
            raise tasks.DataError(f"{target} appeared while {f.name} downloaded; left as it is "
                              f"({part} kept)") from None
        os.remove(part)
    say(f"{set_name}: {target} is in place")


def _own_part(part: str) -> int:
    """The bytes of a cut download of ours at `part` (0 where none is there). Anything but a regular
    file there (a link, a folder, a device) is not ours: one line, and nothing is written through
    it or removed."""
    try:
        info = os.lstat(part)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(info.st_mode):
        raise tasks.DataError(f"{part} is a link or not a regular file, so not a download of ours; "
                              "nothing was written or removed: move it away and run again")
    return info.st_size


def _open_part(part: str, have: int):
    """`part` opened for writing, never through a link (O_NOFOLLOW): appended to from byte `have`,
    or made afresh (empty) from 0."""
    flags = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | (os.O_APPEND if have else os.O_CREAT | os.O_TRUNC)
    try:
        return os.fdopen(os.open(part, flags, 0o666), "ab" if have else "wb")
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise tasks.DataError(f"{part} became a link while it downloaded, so not a download of ours; "
                              "nothing was written through it: move it away and run again") from None


def _transfer(url: str, part: str, have: int, size: int, timeout: float) -> None:
    """Stream `url` into `part` from byte `have` (a Range request); a server that ignores the range
    starts over."""
    request = urllib.request.Request(url, headers={"User-Agent": "maskprior-download",
                                                   **({"Range": f"bytes={have}-"} if have
                                                      else {})})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise tasks.DataError(f"{url}: HTTP {e.code} {e.reason}; try again later, or give a mirror "
                          "with --from URL (the same file name under it)") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise tasks.DataError(f"{url}: cannot connect ({reason}); check the network, or give a mirror "
                          "with --from URL")
    with response:
        if have and response.status != 206:
            # the whole file again: the server ignored the range
            have = 0
        length = response.headers.get("Content-Length")
        if length is not None and have + int(length) != size:
            raise tasks.DataError(f"{url} serves {int(length):,} bytes from byte {have:,}; the pinned "
                              f"file has {size:,}: another file, nothing fetched")
        progress = Progress(size, have)
        with _open_part(part, have) as out:
            got = have
            try:
                while True:
                    # what has come, not a full chunk: a stall keeps it
                    chunk = response.read1(CHUNK)
                    if not chunk:
                        break
                    got += len(chunk)
                    if got > size:
                        out.close()
                        os.remove(part)
                        raise tasks.DataError(f"{url} sent more than the {size:,} bytes of the pinned "
                                          f"file; deleted {part}")
                    out.write(chunk)
                    progress.update(got)
            # a stall (the timeout) or a cut connection
            except (OSError, TimeoutError) as e:
                out.flush()
                progress.done()
                raise tasks.DataError(f"{url}: the transfer stopped at {got:,} of {size:,} bytes "
                                  f"({e or 'timed out'}); run the same command again to resume "
                                  f"from {part}") from None
        progress.done()
    if got < size:
        raise tasks.DataError(f"{url}: the transfer stopped at {got:,} of {size:,} bytes; run the "
                          f"same command again to resume from {part}")


class Progress:
    """A bar on a terminal (bytes, rate, ETA), redrawn at most 10 times a second; a line per 10%
    otherwise."""

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
                bar = "#" * (30 * got // self.size)
                self.stream.write(f"\r  [{bar:<30}] {text}")
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
    with open(part, "rb") as src:
        for block in iter(lambda: src.read(CHUNK), b""):
            sha.update(block)
            md5.update(block)
    for kind, got, want in (("sha256", sha.hexdigest(), f.sha256),
                            ("md5", md5.hexdigest(), f.md5)):
        if want and got != want:
            os.remove(part)
            raise tasks.DataError(f"{f.name}: {kind} {got}, the pinned one is {want}: a corrupt "
                              "transfer or another file; deleted, nothing unpacked (run again to "
                              "fetch it afresh)")


def _unpack(set_name: str, archive: str, f: File, data_dir: str) -> None:
    """The archive's members under f.target/ into DIR/f.target, whole (a staging folder renamed
    into place), after every member is checked (`_member_path`) and the set's reader finds it."""
    def write(tmp):
        total = 0
        for path, kind, read in _members(archive, f):
            dest = os.path.join(tmp, *_member_path(path, f, kind).split("/"))
            if kind == "dir":
                os.makedirs(dest, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with read() as src, open(dest, "xb") as out:
                for block in iter(lambda: src.read(CHUNK), b""):
                    total += len(block)
                    if total > f.max_unpacked:
                        raise tasks.DataError(f"{f.name} unpacks to more than {f.max_unpacked:,} "
                                          "bytes, the most its set holds: refused, nothing "
                                          "unpacked")
                    out.write(block)
        task = tasks.TASKS.get(set_name)
        if task is not None:
            # the reader finds the set where it will lie (DataError if not)
            task.locate(tmp)
    write_new_dataset(data_dir, f.target, write)


def _members(archive: str, f: File):
    """(name, "file" or "dir", open) of each member; DataError for a link, a device or any other
    kind."""
    try:
        if archive.endswith(".zip.part"):
            with zipfile.ZipFile(archive) as z:
                for info in z.infolist():
                    mode = info.external_attr >> 16
                    if stat.S_ISLNK(mode) or (mode
                                              and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))):
                        raise tasks.DataError(f"{f.name}: member {info.filename!r} is a link or a "
                                          "device: refused, nothing unpacked")
                    yield info.filename, "dir" if info.is_dir() else "file", lambda i=info: z.open(i)
        else:
            with tarfile.open(archive, "r:*") as t:
                for m in t:
                    if not (m.isfile() or m.isdir()):
                        raise tasks.DataError(f"{f.name}: member {m.name!r} is a "
                                          f"{'link' if m.issym() or m.islnk() else 'device or special file'}: "
                                          f"refused, nothing unpacked")
                    yield m.name, "dir" if m.isdir() else "file", lambda m=m: t.extractfile(m)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise tasks.DataError(f"{f.name} is not a readable archive ({e}): refused, nothing unpacked") from None


def _member_path(name: str, f: File, kind: str) -> str:
    """A member's path below f.target/ ('' for the top folder itself); DataError for anything
    outside it."""
    parts = [p for p in name.replace("\\", "/").rstrip("/").split("/") if p != "."]
    if (name.startswith(("/", "\\")) or ".." in parts or "" in parts[1:] or not parts
            or parts[0] != f.target or (len(parts) == 1 and kind != "dir")):
        raise tasks.DataError(f"{f.name}: member {name!r} lies outside {f.target}/: refused, nothing "
                          "unpacked")
    return "/".join(parts[1:])
