"""Files replaced whole or not at all: trained weights a worker may be loading while a trainer writes
new ones (docs/architecture.md, "Semantic dedup").

Pure (no Kafka or Faust): each content is written to a temporary file in its folder, flushed to disk,
then renamed over its path in the order given, so a reader never sees a half-written file and a
failure before the renames leaves the old files as they were.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def replace_files(files: Sequence[tuple[Path, bytes]]) -> None:
    """Write each ``(path, content)`` to a temporary file in its folder, then rename them over the
    paths in order (put the file a loader opens and checks first last); the temporary files are
    removed whatever happens."""
    temps: list[Path] = []
    try:
        for path, content in files:
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            temps.append(Path(name))
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), 0o644)  # mkstemp's 0600 would hide the weights from other users
                fh.write(content)
                fh.flush()
                os.fsync(fh.fileno())
        for (path, _), temp in zip(files, temps, strict=True):
            os.replace(temp, path)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def npz_bytes(arrays: dict[str, Any], *, compressed: bool = True) -> bytes:
    """``arrays`` as the bytes of an ``.npz`` file (no pickled objects), made in memory."""
    buf = io.BytesIO()
    save = np.savez_compressed if compressed else np.savez
    save(buf, **arrays)
    return buf.getvalue()
