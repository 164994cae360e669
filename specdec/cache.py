"""specdec's cache folder, and files made into it the first time they are needed.

The folder: $SPECDEC_CACHE if set, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec (specdec's
own package folder may be read-only). A made file lives in a folder named by `source_digest` of
what it was made from, so a changed source is never served a file made from the old one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from specdec.errors import SpecDecError


def cache_dir() -> Path:
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def source_digest(*sources: Path, salt: str = "") -> str:
    """16 hex digits of a sha256 over `salt` and the names and contents of the source files (a
    folder: every file under it). Contents are hashed once per process per file version."""
    digest = hashlib.sha256(salt.encode())
    for source in sources:
        files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
        for path in files:
            stat = path.stat()
            digest.update(path.name.encode() + b"\0" + _file_digest(str(path), stat.st_size, stat.st_mtime_ns))
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> bytes:
    """sha256 of a file's bytes; size and mtime_ns key the memo, so an edited file is hashed again."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").digest()


def made_once(path: Path, make: Callable[[Path], None], what: str) -> Path:
    """`path`, made by `make(temporary path)` unless it is already there. Invariant: a file at `path`
    is always complete: `make` writes a temporary file in the same folder, renamed onto `path` in
    one step (os.replace), so processes making it at the same time (Ray replicas, test workers)
    each rename a whole file and readers never see a partial one."""
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as error:
        raise SpecDecError(f"cannot write {what} into {path.parent} ({error}); "
                           "set SPECDEC_CACHE to a writable folder") from error
    os.close(descriptor)
    temporary = Path(name)
    print(f"[specdec] making {what} (first use, once) in {path.parent}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        make(temporary)
        temporary.chmod(0o644)  # mkstemp's 0600 would hide a shared cache's files from other users
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    print(f"[specdec] made {path.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return path
