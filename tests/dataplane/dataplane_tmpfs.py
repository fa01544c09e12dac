"""A small tmpfs of the test's own, to fill for real: the kernel's ENOSPC, not a mock.

Mounting needs CAP_SYS_ADMIN (root here); where it is not permitted the test that asked is skipped
with the reason. The mount is lazily unmounted at the end, so a file still mapped by a data plane
does not keep it.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

FILLER = "filler"


@contextmanager
def small_tmpfs(size_bytes: int, *, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of `size_bytes` (and at most `inodes` files) mounted on a fresh temporary directory."""
    where = Path(tempfile.mkdtemp(prefix="of-tmpfs-"))
    options = f"size={size_bytes},mode=1777" + (f",nr_inodes={inodes}" if inodes else "")
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({exc}): a full shared-memory directory cannot be made for real")
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip()}): a full shared-memory "
                    f"directory cannot be made for real")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30, check=False)
        where.rmdir()


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def fill(directory: Path, *, leave_bytes: int = 0) -> Path:
    """Take all of the filesystem's room but `leave_bytes` (rounded down to pages) with one file."""
    path = directory / FILLER
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        have = os.fstat(fd).st_size
        want = have + free_bytes(directory) - leave_bytes
        if want > have:
            os.posix_fallocate(fd, have, want - have)
    finally:
        os.close(fd)
    return path


def ours(directory: Path, prefix: str) -> list[str]:
    """The files of a test prefix in `directory` (arenas, segments)."""
    return sorted(n for n in os.listdir(directory) if n.startswith(f"of-{prefix}-"))
