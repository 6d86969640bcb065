"""Where an import writes: which OUTDIR may be replaced, the hidden temp folder, and its cleanup."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from engine.errors import GDecodeError

MARKER = ".gdecode-import"
# everything an import writes; a folder holding anything else is not ours to replace
WRITTEN = {MARKER, "model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
           "tokenizer_config.json"}
# .<outdir name>.gdecode-<owner pid>-<random>.tmp (being written) or .old (the import it replaces)
_TEMP = re.compile(r"^\..*\.gdecode-(\d+)-[^.]+\.(tmp|old)$")


def check_outdir(outdir: Path, source: Path, force: bool) -> None:
    """Raise GDecodeError unless outdir is absent, or force is given and outdir is an empty folder or an
    earlier import that holds nothing else (and in particular not the source file)."""
    if not os.path.lexists(outdir):
        return
    if outdir.is_symlink():
        raise GDecodeError(f"{outdir} is a symbolic link; pass the folder it points to, or another OUTDIR")
    if not outdir.is_dir():
        raise GDecodeError(f"{outdir} exists and is not a directory")
    if not force:
        raise GDecodeError(f"{outdir} already exists (pass --force to replace it)")
    with contextlib.suppress(OSError):
        if source.resolve().is_relative_to(outdir.resolve()):
            raise GDecodeError(f"{source} is inside {outdir}; --force would delete it: choose another OUTDIR")
    try:
        names = sorted(p.name for p in outdir.iterdir())
    except OSError as e:
        raise GDecodeError(f"cannot read {outdir}: {e.strerror or e}") from None
    if not names:
        return
    foreign = [n for n in names if n not in WRITTEN]
    if MARKER not in names or foreign:
        what = f"holds {foreign[0]!r}, which" if foreign else f"has no {MARKER} marker:"
        raise GDecodeError(
            f"{outdir} {what} import-gguf did not write it; --force replaces only an empty folder or an "
            "earlier import: move its files away or choose another OUTDIR"
        )


def _owner_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale(parent: Path) -> list[Path]:
    """Remove the temp folders that killed imports left in parent (their owner process is gone, and
    they hold an import marker or nothing); returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        m = _TEMP.match(e.name)
        if not m or not e.is_dir(follow_symlinks=False) or _owner_alive(int(m.group(1))):
            continue
        path = Path(e.path)
        try:
            inside = os.listdir(path)
            if inside and MARKER not in inside:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def temp_dir(outdir: Path, source: str) -> Path:
    """A new hidden folder beside outdir, marked as an import's, named with this process's id."""
    try:
        outdir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.gdecode-{os.getpid()}-", suffix=".tmp",
                                    dir=outdir.parent))
    except OSError as e:
        what = next((f"{p} is a file, not a folder" for p in outdir.parents if os.path.isfile(p)), e.strerror or e)
        raise GDecodeError(f"cannot write {outdir}: {what}") from None
    try:
        tmp.chmod(0o755)
        (tmp / MARKER).write_text(f"written by gdecode import-gguf from {source}\n", encoding="utf-8")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GDecodeError(f"cannot write {outdir}: {e.strerror or e}") from None
    return tmp


def replace_dir(tmp: Path, outdir: Path, source: Path, force: bool) -> None:
    """Move tmp to outdir; an existing outdir is checked again, set aside, and removed only after."""
    if not os.path.lexists(outdir):
        tmp.rename(outdir)
        return
    check_outdir(outdir, source, force)  # it may have changed while the weights were written
    old = tmp.with_name(tmp.name[: -len(".tmp")] + ".old")
    outdir.rename(old)
    try:
        tmp.rename(outdir)
    except BaseException:
        old.rename(outdir)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def import_signals():
    """SIGTERM and SIGHUP interrupt like Ctrl-C while an import writes, so its temp folder is removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            saved[sig] = signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
