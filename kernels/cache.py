"""On-disk cubin cache: one file per key, checksummed, written atomically."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import struct
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # non-POSIX: atomic replace alone keeps entries whole
    fcntl = None

_MAGIC = b"GDCUBIN1"
_HEADER = struct.Struct("<8sQQ32s")  # magic, cubin bytes, log bytes, sha256(cubin + log)
_FALLBACK_VERSION = "0.1.0"
_MAX_ENTRY = 64 << 20  # a cubin of this project is well under 1 MB; anything larger is not an entry
# never follow a link, never wait on a FIFO
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def package_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:
        return _FALLBACK_VERSION
    try:
        return version("gdecode")
    except PackageNotFoundError:
        return _FALLBACK_VERSION


def default_cache_dir() -> Path:
    """`$GDECODE_CACHE_DIR`, else `$XDG_CACHE_HOME/gdecode/<version>`, else `~/.cache/gdecode/<version>`."""
    explicit = os.environ.get("GDECODE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gdecode" / package_version()


def encode_entry(cubin: bytes, log: str) -> bytes:
    log_bytes = log.encode()
    digest = hashlib.sha256(cubin + log_bytes).digest()
    return _HEADER.pack(_MAGIC, len(cubin), len(log_bytes), digest) + cubin + log_bytes


def decode_entry(data: bytes) -> tuple[bytes, str] | None:
    """(cubin, log), or None when the entry is truncated, padded or corrupt."""
    if len(data) < _HEADER.size:
        return None
    magic, n_cubin, n_log, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC or len(data) != _HEADER.size + n_cubin + n_log:
        return None
    body = data[_HEADER.size :]
    if hashlib.sha256(body).digest() != digest:
        return None
    return body[:n_cubin], body[n_cubin:].decode(errors="replace")


class CubinCache:
    """A directory of `<key>.cubin` entries; `root=None` means `default_cache_dir()` at each use."""

    def __init__(self, root: str | os.PathLike | None = None):
        self._root = Path(root) if root is not None else None

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else default_cache_dir()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.cubin"

    def get(self, key: str) -> tuple[bytes, str] | None:
        """The entry, or None when it is missing, corrupt, or not a plain file of sane size (a link,
        FIFO, device or directory is never followed or read, and is replaced by the next put)."""
        data = read_regular(self.path(key), _MAX_ENTRY)
        return None if data is None else decode_entry(data)

    def put(self, key: str, cubin: bytes, log: str) -> Path:
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(encode_entry(cubin, log))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return self.path(key)

    @contextlib.contextmanager
    def lock(self, key: str):
        """Serialise compiles of one key across processes; the OS drops the lock if its holder dies."""
        if fcntl is None:
            yield
            return
        fd = _open_lock(self.root, self.root / f"{key}.lock")
        if fd is None:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of path if it is a regular file (not a link) of at most limit bytes, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def _open_lock(root: Path, path: Path) -> int | None:
    """A descriptor on the regular lock file at path; anything else there (a link, FIFO, device) is
    removed and a fresh file made. None when no lock can be had: compiles then only rely on os.replace."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o644)
            except OSError:
                fd = None
            if fd is not None:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    return fd
                os.close(fd)
            if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
                os.unlink(path)
            else:
                return None
    except OSError:
        return None
    return None
