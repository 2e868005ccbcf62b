"""Paths are URLs: one set of file operations for local paths and `gs://` (any etils/fsspec URL).

Everything jaxlm reads or writes -- checkpoints, metrics, exports, shards, tokenizers -- goes
through these functions, never `os.path` on a string that may be a URL (`os.path.abspath`
turns `gs://b/run` into `<cwd>/gs:/b/run`). They are thin wrappers over `etils.epath.Path`,
which orbax uses too, so a checkpoint and the files beside it land in the same place.

`gs://` needs `gcsfs` (`pip install gcsfs`). TensorFlow's gfile would also serve, but jaxlm
never imports TensorFlow at run time, so `EPATH_USE_TF` is set to false before etils reads it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

os.environ.setdefault("EPATH_USE_TF", "false")

from etils import epath  # noqa: E402


def is_url(path) -> bool:
    return "://" in os.fspath(path)


def path(p) -> epath.Path:
    """An epath.Path for a local path or URL (a local path is made absolute)."""
    p = os.fspath(p)
    return epath.Path(p if is_url(p) else os.path.abspath(p))


def absolute(p) -> str:
    """Local paths made absolute; URLs unchanged."""
    return os.fspath(path(p))


def join(base, *parts) -> str:
    """`base/part/...` for a local path or a URL (URLs keep their scheme)."""
    base = os.fspath(base)
    if is_url(base):
        return "/".join([base.rstrip("/")] + [os.fspath(p).strip("/") for p in parts])
    return os.path.join(base, *parts)


def parent(p) -> str:
    p = os.fspath(p)
    if is_url(p):
        return p.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(p))


def basename(p) -> str:
    return os.fspath(p).rstrip("/").rsplit("/", 1)[-1]


def exists(p) -> bool:
    return path(p).exists()


def isdir(p) -> bool:
    return path(p).is_dir()


def isfile(p) -> bool:
    return path(p).is_file()


def listdir(p) -> list[str]:
    """Names (not paths) of the entries of folder `p`, sorted; [] if it does not exist."""
    d = path(p)
    if not d.is_dir():
        return []
    return sorted(child.name for child in d.iterdir())


def makedirs(p) -> None:
    path(p).mkdir(parents=True, exist_ok=True)


def open_file(p, mode: str = "r", **kwargs):
    """`open` for local paths and URLs (text modes decode UTF-8)."""
    if "b" not in mode:
        kwargs.setdefault("encoding", "utf-8")
    return path(p).open(mode, **kwargs)


def read_text(p) -> str:
    with open_file(p) as f:
        return f.read()


def write_text(p, text: str) -> None:
    with open_file(p, "w") as f:
        f.write(text)


def read_bytes(p) -> bytes:
    with open_file(p, "rb") as f:
        return f.read()


def write_bytes(p, data: bytes) -> None:
    with open_file(p, "wb") as f:
        f.write(data)


def rename(src, dst) -> None:
    """Move file or folder `src` to `dst`: atomic on a local filesystem; on an object store
    (which has no folders, only names) a copy of every object under `src`, then a delete."""
    src, dst = os.fspath(src), os.fspath(dst)
    if not is_url(src):
        os.replace(src, dst)
        return
    import fsspec
    fs, _ = fsspec.core.url_to_fs(src)
    fs.copy(src, dst, recursive=True)  # server-side copies (rewriteTo on Cloud Storage)
    fs.rm(src, recursive=True)
    # Every live instance of this filesystem may still list `src` from its listing cache; etils
    # (so orbax) keeps its own, made with other options, for the life of the process.
    for instance in list(type(fs)._cache.values()):  # fsspec's registry of instances
        instance.invalidate_cache()


def remove_tree(p) -> None:
    d = path(p)
    if d.is_dir():
        d.rmtree()
    elif d.exists():
        d.unlink()


def size(p) -> int:
    return path(p).stat().length


@contextlib.contextmanager
def writing(p, suffix: str = ""):
    """A local file path to write `p` through, for libraries that only write local files (h5py,
    sentencepiece): on success it is renamed into place (local, atomic) or uploaded (URL); on
    failure nothing appears at `p`."""
    target = os.fspath(p)
    local_dir = None if is_url(target) else os.path.dirname(os.path.abspath(target))
    if local_dir is not None:
        os.makedirs(local_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=suffix or ".tmp", prefix=".jaxlm-", dir=local_dir)
    os.close(fd)
    try:
        yield tmp
        if local_dir is not None:
            os.replace(tmp, target)
        else:
            with open(tmp, "rb") as src, open_file(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 24)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def local(p):
    """A local path holding `p`'s bytes, for libraries that only read local files (the gguf
    reader memory-maps its file): `p` itself when local, else a downloaded temporary copy."""
    source = os.fspath(p)
    if not is_url(source):
        yield source
        return
    fd, tmp = tempfile.mkstemp(prefix=".jaxlm-", suffix="-" + basename(source))
    try:
        with os.fdopen(fd, "wb") as dst, open_file(source, "rb") as src:
            shutil.copyfileobj(src, dst, 1 << 24)
        yield tmp
    finally:
        os.remove(tmp)


def check_output_folder(p, what: str) -> None:
    """Fail now, in one line, if folder `p` cannot be written: it is a file, lies under a file,
    or (local) its nearest existing parent is not writable. Nothing is created.

    For a URL only what is cheap is checked: `p` is not an existing object and its bucket can
    be listed (one request); permissions show at the first write.
    """
    from jaxlm.errors import UserError
    p = os.fspath(p)
    if is_url(p):
        if isfile(p):
            raise UserError(f"{what} {p} is an existing object, not a folder; pass a folder URL")
        root = p.split("://", 1)[0] + "://" + p.split("://", 1)[1].split("/", 1)[0]
        try:
            reachable = exists(root)
        except Exception as e:  # noqa: BLE001  auth, network: whatever the path library raises
            raise UserError(f"{what} {p}: cannot reach {root} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if not reachable:
            raise UserError(f"{what} {p}: the bucket {root} does not exist or is not visible")
        return
    here = os.path.abspath(p)
    if os.path.exists(here) and not os.path.isdir(here):
        raise UserError(f"{what} {p} is a file, not a folder; move it away or pass another folder")
    parent = here
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"{what} {p} lies under the file {parent}; pass a folder path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{what} {p}: {parent} is not writable; pass a folder you can write")
