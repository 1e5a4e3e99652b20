"""ImageNet-100 (the CMC class list, shared/data/imagenet100_wnids.txt = tasks.IMAGENET100_WNIDS) built from a copy
of ImageNet-1k, which needs a licence and so is never downloaded:

    python train.py imagenet100 --from /datasets/imagenet --data data      # -> data/imagenet100/{train,val}/<wnid>/

The source holds ImageNet-1k as class folders, train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (the layout torchvision's
ImageNet and most copies use; a flat val/ must first be sorted into its classes). Every one of the 100 classes must
be there in both splits, as regular files; each file is hard-linked where the filesystem allows (no space taken),
else copied. The tree is built in a hidden staging folder in DIR and renamed to DIR/imagenet100 once whole
(datafetch.write.write_new_dataset): a set already there is never touched, and a failure leaves DIR as it was."""
from __future__ import annotations

import os
import shutil
import stat

import tasks
from datafetch.write import Interrupted, data_folder, write_new_dataset

SPLITS = ("train", "val")


def _sources(source: str) -> dict:
    """{(split, wnid): [(path, bytes)]} of the 100 classes in `source`; DataError naming what is missing."""
    out, missing = {}, []
    for split in SPLITS:
        for wnid in tasks.IMAGENET100_WNIDS:
            folder = os.path.join(source, split, wnid)
            if not os.path.isdir(folder):
                missing.append(f"{split}/{wnid}")
                continue
            files = []
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    raise tasks.DataError(f"{path!r} is not a regular file (a link, a folder?): refused, nothing built")
                files.append((path, st.st_size))
            if not files:
                missing.append(f"{split}/{wnid} (empty)")
            out[split, wnid] = files
    if missing:                        # (--from not a folder: every class is missing)
        what = ("is not a folder" if not os.path.isdir(source) else
                f"lacks {len(missing)} of the ImageNet-100 class folders, e.g. {', '.join(missing[:3])}")
        raise tasks.DataError(f"--from {source!r} {what}: give the ImageNet-1k folder that holds train/<wnid>/ "
                              "and val/<wnid>/ (a flat val/ sorted into its classes first); nothing built")
    return out


def build(source: str, data_dir: str) -> str:
    """DIR/imagenet100/{train,val}/<wnid>/ from `source`; returns the line to print. DATA is made if missing (and
    removed on a refusal); every failure, and Ctrl-C (Interrupted, exit 130), is one line leaving DATA as it was."""
    target = os.path.join(data_dir, "imagenet100")
    with data_folder(data_dir, "--data"):
        if os.path.lexists(target):
            return f"imagenet100: {target} is already there; left as it is"
        try:
            files = _on_disk(lambda: _sources(source), f"cannot read {source!r}")
            total = sum(size for fs in files.values() for _, size in fs)
            count = sum(len(fs) for fs in files.values())
            print(f"imagenet100: {count:,} images ({total / 2**30:,.1f} GiB) from {source!r} into "
                  f"{target} (hard links where the filesystem allows, else copies)", flush=True)
            linked = _on_disk(lambda: _build_tree(files, source, data_dir, total), f"cannot build {target}")
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted: nothing built, {data_dir} as it was; run the same command again") from None
    how = "hard links" if linked == count else f"{linked:,} hard links, {count - linked:,} copies"
    return f"imagenet100: {target} built ({count:,} images, {how})"


def _on_disk(work, what: str):
    """work(), with an OSError of the file system (a file unreadable, the disk full) as one line."""
    try:
        return work()
    except OSError as e:
        where = f"{e.filename!r}: " if e.filename else ""
        raise tasks.DataError(f"{what}: {where}{e.strerror or e}; nothing built") from None


def _build_tree(files: dict, source: str, data_dir: str, total: int) -> int:
    """The tree via write_new_dataset (whole or not at all); returns how many images were hard-linked, not copied."""
    state = {"linked": 0, "space_checked": False}

    def write(tmp):
        for i, ((split, wnid), fs) in enumerate(files.items()):
            folder = os.path.join(tmp, split, wnid)
            os.makedirs(folder)
            for path, size in fs:
                dest = os.path.join(folder, os.path.basename(path))
                try:
                    os.link(path, dest)
                    state["linked"] += 1
                except OSError:               # another filesystem, or links not allowed: a copy
                    if not state["space_checked"]:
                        free = shutil.disk_usage(tmp).free
                        if free < total:
                            raise tasks.DataError(f"{source!r} cannot be hard-linked into {data_dir} "
                                              f"and a copy needs {total / 2**30:,.1f} GiB, "
                                              f"{free / 2**30:,.1f} GiB free: nothing built")
                        state["space_checked"] = True
                    shutil.copyfile(path, dest)
            if (i + 1) % 20 == 0:
                print(f"  {i + 1} of {len(files)} class folders", flush=True)
        if tasks.imagenet100_layout(tmp) != "folder":
            raise tasks.DataError(f"the tree built in {tmp} is not read as an ImageFolder tree")

    write_new_dataset(data_dir, "imagenet100", write)
    return state["linked"]
