"""On-disk cubin cache: one file per key, checksummed, written atomically."""

from __future__ import annotations

import contextlib
import hashlib
import os
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
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return None
        return decode_entry(data)

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
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            f = open(self.root / f"{key}.lock", "a+b")
        except OSError:
            yield
            return
        with f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
