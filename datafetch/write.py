"""Writing a data set into a folder, whole (`write_new_dataset`: `download` and `imagenet100` write through it), and
the stand-ins: small real data sets in the real release layouts, so that the readers, the tests and a CPU trial run on
real files (`train.py make-digits DIR`, `train.py make-wikitext DIR FILE...`). Nothing on the run path calls them."""
from __future__ import annotations

import collections
import contextlib
import errno
import io
import itertools
import os
import pickle
import re
import shutil
import tempfile
from typing import Callable

import numpy as np

from runfiles import ReadError, UsageError, umask, atomic_write, open_back
from tasks import DataError, find_first, find_wikitext_files


class Interrupted(UsageError):
    """Ctrl-C (SIGINT) in a download or a build: one line saying what was kept, exit status 130 (the shell's)."""
    status = 130


# a data folder's path, before anything is made: (test, what is wrong with it)
FOLDER_MUST = ((lambda p: isinstance(p, str), "is not a path"),
               (lambda p: p != "", "is empty"),
               (lambda p: "\0" not in p, "holds a NUL byte"),
               (lambda p: p.isprintable(), "holds a control or other unprintable character"),
               (lambda p: encodable(p), "is not text the file system can hold"))
# why a folder could not be made, by errno (any other: the system's own words)
FOLDER_ERRNOS = {errno.EEXIST: "is a file, a device or a link, not a folder",
                 errno.ENOTDIR: "lies under a file, not a folder",
                 errno.ENAMETOOLONG: "cannot be made: a name in it is too long for the file system"}


def encodable(path: str) -> bool:
    """Whether the file system can hold `path` (no lone surrogate the file system encoding refuses)."""
    try:
        os.fsencode(path)
        return True
    except UnicodeError:
        return False


def make_folder(path: str, flag: str = "the data folder") -> list:
    """`path` as a folder: made, with its missing parents, where it is not one yet. Returns the
    folders it made, outermost first (`unmake` removes them again); a UsageError of one line where
    `path` is empty, a file, under a file, cannot be made or written in, and then nothing is left made."""
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    made, wrong = [], next((wrong for test, wrong in FOLDER_MUST if not test(path)), None)
    if wrong is None:
        made, wrong = _make_dirs(path)
    if wrong is None and not os.access(path, os.W_OK | os.X_OK):
        wrong = "is a folder this user cannot write in"
    if wrong is not None:
        unmake(made)
        raise UsageError(f"{flag} {path!r} {wrong}; give a folder that exists or can be made (it is made, with "
                         "its parents, if missing) and that this user can write in")
    return made


def _make_dirs(path: str) -> tuple[list, str | None]:
    """(the folders made for `path`, outermost first; what stopped it, by FOLDER_ERRNOS, or None)."""
    missing, p, made = [], path, []
    while p and not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p.rstrip(os.sep))
    try:
        for q in reversed(missing):
            with contextlib.suppress(FileExistsError):      # q/.. or q/. : a folder already, by another name
                os.mkdir(q)
                made.append(q)
    except OSError as e:
        return made, FOLDER_ERRNOS.get(e.errno, f"cannot be made ({e.strerror})")
    return made, None if os.path.isdir(path) else FOLDER_ERRNOS[errno.EEXIST]


def unmake(made: list) -> None:
    """Remove the folders `make_folder` made, innermost first, where they are still empty."""
    for q in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(q)


@contextlib.contextmanager
def data_folder(path: str, flag: str = "the data folder"):
    """`path` made a folder for the block (`make_folder`); if the block fails, the folders made for
    it are removed again where they are still empty, so a refusal leaves no trace."""
    made = make_folder(path, flag)
    try:
        yield path
    except BaseException:
        unmake(made)
        raise


def write_new_dataset(folder: str, name: str, write: Callable[[str], None], held: str | None = None) -> str:
    """Write a data set as folder/name, whole: `write(tmp)` fills a temporary folder inside `folder`, which is
    renamed to folder/name once complete, so an interrupted write leaves no folder/name (a killed process, at most
    its hidden `.name.*.tmp`). Refused (DataError, nothing written) when folder/name exists or `held` names a set
    already in `folder` that the new one would shadow; `folder` is made if missing (`make_folder`: one line where it
    cannot be; it stays if the write fails; `data_folder` around the call removes it). Returns folder/name."""
    target = os.path.join(folder, name)
    held = held or (target if os.path.lexists(target) else None)
    if held:
        raise DataError(f"{folder} already holds a data set ({held}); a data set is never overwritten or shadowed: "
                        "give another folder, or move that one away first")
    make_folder(folder)
    tmp = tempfile.mkdtemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~umask())            # mkdtemp's 0700 would hide the set from the group
        os.rename(tmp, target)                     # refused if a non-empty folder/name appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def digits_arrays() -> tuple:
    """scikit-learn's bundled handwritten digits (1,797 8x8 images, no download) as 32x32 RGB uint8
    (N, 3, 32, 32), nearest-upscaled, split 1,500 train / 297 test by seed 0.
    Returns (x_train, y_train, x_test, y_test); DataError without scikit-learn."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("make-digits needs scikit-learn for its bundled digits: pip install scikit-learn") from None
    d = load_digits()
    x = np.clip(d.images * (255 / 16), 0, 255).astype(np.uint8)          # (N, 8, 8), values 0..16
    x = np.repeat(np.repeat(x, 4, axis=1), 4, axis=2)                        # nearest upscaling to 32x32
    x = np.repeat(x[:, None], 3, axis=1)                                     # grey -> RGB
    order = np.random.default_rng(0).permutation(len(x))
    tr, te = order[:1500], order[1500:]
    return x[tr], d.target[tr], x[te], d.target[te]


def write_cifar10_python(folder: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                         y_test: np.ndarray, label_names=None) -> str:
    """Write images in the CIFAR-10 python release layout: folder/cifar-10-batches-py/ with data_batch_1..5,
    test_batch and batches.meta, pickled with protocol 2 and bytes keys. x: (N, 3, 32, 32) uint8, y: (N,) ints.
    Returns the batches folder. A folder that already holds a CIFAR-10 set in any layout `read_cifar` reads is
    refused (`write_new_dataset`): a set is never overwritten or shadowed."""
    def write(out):
        def dump(name, x, y, label):
            d = {b"batch_label": label.encode(), b"labels": [int(v) for v in y],
                 b"data": np.ascontiguousarray(x, dtype=np.uint8).reshape(len(x), -1),
                 b"filenames": [f"{name}_{i}.png".encode() for i in range(len(x))]}
            atomic_write(os.path.join(out, name), pickle.dumps(d, protocol=2))

        for i, part in enumerate(np.array_split(np.arange(len(x_train)), 5), 1):
            dump(f"data_batch_{i}", x_train[part], y_train[part], f"training batch {i} of 5")
        dump("test_batch", x_test, y_test, "testing batch 1 of 1")
        names = label_names or [str(i) for i in range(10)]
        d = {b"label_names": [n.encode() for n in names], b"num_cases_per_batch": len(x_train) // 5, b"num_vis": 3072}
        atomic_write(os.path.join(out, "batches.meta"), pickle.dumps(d, protocol=2))

    held = find_first(folder, [os.path.join("cifar-10-batches-py", "data_batch_1"), "data_batch_1",
                               "cifar-10-batches-py", os.path.join("cifar-10-batches-bin", "data_batch_1.bin"),
                               "data_batch_1.bin"])
    return write_new_dataset(folder, "cifar-10-batches-py", write, held)


_WORD = re.compile(r"\w+(?:[-,.]\w+)*|[^\w\s]")


def wikitext_tokenize(text: str) -> list[str]:
    """Plain English -> WikiText-style tokens: punctuation split off, and the in-word joiners of
    WikiText: 'well-known' -> well @-@ known, '1,000' -> 1 @,@ 000, '3.5' -> 3 @.@ 5."""
    return [w for tok in _WORD.findall(text) for w in re.sub(r"(?<=\w)([-,.])(?=\w)", r" @\1@ ", tok).split()]


def write_wikitext_layout(articles, folder: str, min_count: int = 3, every: int = 12) -> str:
    """Write (title, [paragraph, ...]) articles as WikiText-2's word-level release, wiki.{train,valid,test}.tokens in
    folder/wikitext-2/, with ' = Title = ' headings, blank lines between paragraphs, and words seen fewer than
    `min_count` times in train replaced by <unk>. Articles go to valid / test when their index mod `every` is every - 7
    / every - 1, else train. A folder that already holds a WikiText-2 release is refused (`write_new_dataset`)."""
    articles = list(articles)
    if len(articles) < every:
        raise DataError(f"make-wikitext needs at least {every} articles (text files) so that "
                        f"train, valid and test each get one (articles i with i mod {every} = "
                        f"{every - 7} go to valid, {every - 1} to test); got {len(articles)}")
    split_of = ["train"] * every
    split_of[every - 7], split_of[every - 1] = "valid", "test"
    toks = {s: [] for s in ("train", "valid", "test")}
    for i, (title, paragraphs) in enumerate(articles):
        toks[split_of[i % every]].append((wikitext_tokenize(title), [wikitext_tokenize(p) for p in paragraphs]))
    counts = collections.Counter(itertools.chain.from_iterable(itertools.chain(t, *ps) for t, ps in toks["train"]))

    def line(words):
        return " " + " ".join(w if counts.get(w, 0) >= min_count else "<unk>" for w in words) + " \n"
    def write(out):
        for split, arts in toks.items():
            text = []
            for title, paras in arts:
                text.append(" \n = " + line(title).strip() + " = \n \n")
                text += [line(p) + " \n" for p in paras if p]
            atomic_write(os.path.join(out, f"wiki.{split}.tokens"), "".join(text))

    try:                 # the WikiText-2 release `find_wikitext_files` would read from `folder`, if any
        held = str(find_wikitext_files(folder)[1]["train"].parent)
    except DataError:
        held = find_first(folder, ["wikitext-2"])
    return write_new_dataset(folder, "wikitext-2", write, held)


def make_digits(folder: str) -> str:
    """python train.py make-digits DIR: scikit-learn's bundled handwritten digits upscaled to 32x32 RGB and written in
    the CIFAR-10 python format (`digits_arrays`): a small, real, learnable image set to try the vision path on a CPU."""
    x_train, y_train, x_test, y_test = digits_arrays()
    out = write_cifar10_python(folder, x_train, y_train, x_test, y_test)
    return (f"wrote {len(y_train)} train / {len(y_test)} test digits in CIFAR-10 python format to {out}\ntrain on "
            f"them with: python train.py --task cifar10 --data-dir {folder} --init mask")


def make_wikitext(folder: str, files: list) -> str:
    """python train.py make-wikitext DIR FILE...: plain-text files (one article each; paragraphs separated by blank
    lines; the first line is the title) written in WikiText-2's word-level layout under DIR/wikitext-2/, so that any
    English text can stand in for the corpus. Returns what it says."""
    articles = []
    for path in files:
        try:
            with io.TextIOWrapper(open_back(path), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except (OSError, ReadError) as e:
            raise DataError(f"make-wikitext: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None
        paras = [p for p in (" ".join(q.split()) for q in text.split("\n\n")) if p]
        if paras:
            articles.append((paras[0][:80], paras[1:]))
    out = write_wikitext_layout(articles, folder)
    sizes = {}
    for s in ("train", "valid", "test"):
        with io.TextIOWrapper(open_back(os.path.join(out, f"wiki.{s}.tokens")), encoding="utf-8") as f:
            sizes[s] = sum(len(line.split()) + 1 for line in f)
    return f"wrote {len(articles)} articles to {out}: " + ", ".join(f"{s} {n:,} tokens" for s, n in sizes.items())
