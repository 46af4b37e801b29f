"""Files that hold tensors off the device: the swap space of optimizer offload (the NVMe tier
of ZeRO-Infinity, usable on any device, the CPU included).

A `SwapFile` is one file in a directory it creates under the user's `Config.nvme_path`
(`fxspeed-swap-<host>-pid<pid>-<rank>-*`) and removes when it is closed or garbage-collected; a
directory left by a killed process of this host is removed by the next one that starts there. Its size is reserved up front
(`posix_fallocate`), so a disk too small is an error when the engine is built, before any
state exists, not a failed write in the middle of a step. Regions and host buffers are
page-aligned so reads and writes can bypass the page cache (`O_DIRECT`) where the filesystem
allows it (tmpfs does not: buffered I/O is used there and `direct` says so). Reads and writes
run in a small thread pool (`os.preadv`/`os.pwritev` release the GIL) and return futures, so
the caller overlaps them with compute.
"""

from __future__ import annotations

import errno
import mmap
import os
import logging
import shutil
import socket
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from fxspeed.errors import FxspeedError
from fxspeed.units import size

log = logging.getLogger("fxspeed")
ALIGN = 4096  # the largest logical block size O_DIRECT asks alignment to on common disks


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class AlignedBuffer:
    """A page-aligned host buffer (anonymous mmap) seen as a flat tensor of `dtype`."""

    def __init__(self, nbytes: int, dtype: torch.dtype = torch.float32) -> None:
        self.nbytes = round_up(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=self.nbytes // dtype.itemsize)

    def memoryview(self, nbytes: int) -> memoryview:
        return memoryview(self._map)[:round_up(nbytes)]


def aligned_tensor(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` rounded up to the alignment, starting on a page boundary, from
    torch's allocator: unlike an `AlignedBuffer` (a fresh mapping, zero-filled page by page on
    first touch) its memory comes from, and goes back to, the heap that freed activations left."""
    n = round_up(max(nbytes, 1))
    raw = torch.empty(n + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + n]


def _view(t: torch.Tensor, nbytes: int) -> memoryview:
    return memoryview(t.numpy())[:round_up(nbytes)]


class SwapFile:
    """One preallocated file of `nbytes` under `root` (Config.nvme_path); async aligned I/O."""

    def __init__(self, root: str | os.PathLike, nbytes: int, *, name: str, workers: int = 2) -> None:
        root_path = Path(os.path.abspath(root))  # (removed at close by this path, whatever the cwd is then)
        if not root_path.is_dir():
            raise FxspeedError(f"Config.nvme_path={str(root)!r} does not exist or is not a directory; create it (on "
                               "a local disk with room for the offloaded states) or choose another path")
        if not os.access(root_path, os.W_OK | os.X_OK):
            raise FxspeedError(f"Config.nvme_path={str(root)!r} is not writable by this process; choose a directory "
                               "you can write to")
        self.nbytes = round_up(nbytes)
        try:
            remove_stale_swap_dirs(root_path)
            self.dir = tempfile.mkdtemp(prefix=f"{_PREFIX}{socket.gethostname()}-pid{os.getpid()}-{name}-",
                                        dir=root_path)
        except OSError as e:  # os.access passes root everywhere: /proc, /sys, a read-only mount
            raise FxspeedError(f"Config.nvme_path={str(root)!r}: cannot create a swap directory there ({e}); choose a "
                               "directory on a local disk you can write to") from e
        self.path = os.path.join(self.dir, "states.bin")
        self.direct = hasattr(os, "O_DIRECT")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                shutil.rmtree(self.dir, ignore_errors=True)
                raise FxspeedError(f"cannot create the swap file {self.path!r} (Config.nvme_path): {e}") from e
            self.direct = False  # the filesystem refuses O_DIRECT (tmpfs): buffered I/O
            fd = os.open(self.path, flags, 0o600)
        self.fd = fd
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"fxspeed-swap-{name}")
        self._finalizer = weakref.finalize(self, _close, fd, self.dir, self._pool)
        try:
            if self.nbytes:  # (posix_fallocate refuses a zero length: every state stayed in memory)
                os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                os.ftruncate(fd, self.nbytes)  # no fallocate on this filesystem: a sparse file
                return
            self.close()
            if e.errno == errno.ENOSPC:
                free = shutil.disk_usage(root_path).free
                ours = _own_swap_bytes(root_path)  # (this file is closed and gone: the others')
                held = (f" (this process's other swap files there hold {size(ours)}: "
                        f"{size(ours + self.nbytes)} in all)") if ours else ""
                raise FxspeedError(f"Config.nvme_path={str(root)!r}: the offloaded states need {size(self.nbytes)} "
                                   f"more and that filesystem has {size(free)} free{held}; free space there or choose "
                                   "a path on a larger disk (nothing was written)") from e
            raise FxspeedError(f"cannot reserve {size(self.nbytes)} for the swap file {self.path!r}: {e}") from e

    # The pool's tasks hold the file's descriptor and name, never the SwapFile: the last reference
    # to it must not be dropped on an I/O thread, whose finalizer would then try to join that
    # very thread and leave the directory behind.
    def read(self, offset: int, into: AlignedBuffer, nbytes: int) -> Future:
        """Fill the first `nbytes` (rounded up to the alignment) of `into` from `offset`."""
        return self._pool.submit(_io, self.fd, self.path, self.nbytes, os.preadv, offset, into.memoryview(nbytes),
                                 "reading")

    def write(self, offset: int, source: AlignedBuffer, nbytes: int) -> Future:
        return self._pool.submit(_io, self.fd, self.path, self.nbytes, os.pwritev, offset,
                                 source.memoryview(nbytes), "writing")

    def write_copy(self, offset: int, src: torch.Tensor, nbytes: int) -> Future:
        """Copy `src` (flat bytes) into an aligned buffer and write it at `offset`, both on an I/O
        thread: the caller only submits, and `src` is released once copied."""
        return self._pool.submit(_copy_and_write, self.fd, self.path, self.nbytes, offset, [src], nbytes)

    def read_after(self, first: Future, offset: int, into: torch.Tensor, nbytes: int) -> Future:
        """Like `read` into an `aligned_tensor`, once `first` (the write of that region) has finished."""
        return self._pool.submit(_wait_and_read, first, self.fd, self.path, self.nbytes, offset, _view(into, nbytes))

    def close(self) -> None:
        """Remove the swap directory (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


_PREFIX = "fxspeed-swap-"


def remove_stale_swap_dirs(root: Path) -> list[str]:
    """Remove swap directories under `root` left by processes of this host that no longer run (a
    killed process cannot clean up after itself); another host's, or a live process's, stay."""
    removed = []
    head = f"{_PREFIX}{socket.gethostname()}-pid"
    for entry in root.glob(f"{head}*"):
        pid = entry.name[len(head):].split("-", 1)[0]
        if not (pid.isascii() and pid.isdigit()) or not entry.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or not ours to signal: alive too)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(str(entry))
        log.warning("fxspeed: removed %s, the swap directory of process %s, which is gone", entry, pid)
    return removed


def _io(fd: int, path: str, size: int, call, offset: int, view: memoryview, what: str) -> None:  # noqa: ANN001
    """One whole read or write (`call`: os.preadv / os.pwritev) of `view` at `offset`."""
    done = 0
    while done < len(view):  # both may return short counts
        try:
            n = call(fd, [view[done:]], offset + done)
        except OSError as e:
            raise FxspeedError(f"{what} {len(view)} bytes at offset {offset} of the swap file {path!r} failed: {e}") from e
        if n == 0:
            raise FxspeedError(f"{what} the swap file {path!r} stopped at offset {offset + done} "
                               f"(file shorter than {size} bytes: was it truncated?)")
        done += n


def _copy_and_write(fd: int, path: str, size: int, offset: int, holder: list[torch.Tensor], nbytes: int) -> None:
    buf = aligned_tensor(nbytes)
    buf[:nbytes].copy_(holder.pop())  # the pool's task keeps its arguments to the end: the source
    # (an activation) is released here, once copied, not when the disk is done
    _io(fd, path, size, os.pwritev, offset, _view(buf, nbytes), "writing")


def _wait_and_read(first: Future, fd: int, path: str, size: int, offset: int, view: memoryview) -> None:
    # The pool runs tasks in submission order: `first`, submitted earlier, has started on another
    # thread or finished, so waiting here cannot deadlock the pool.
    first.result()
    _io(fd, path, size, os.preadv, offset, view, "reading")


def _close(fd: int, directory: str, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    try:
        os.close(fd)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _own_swap_bytes(root: Path) -> int:
    """Bytes of the swap files this process holds under `root` (its engines' other tiers)."""
    head = f"{_PREFIX}{socket.gethostname()}-pid{os.getpid()}-"
    total = 0
    for d in root.glob(head + "*"):
        for f in d.glob("*"):
            try:
                total += f.stat().st_blocks * 512  # allocated, not the apparent size of a sparse file
            except OSError:
                continue
    return total


