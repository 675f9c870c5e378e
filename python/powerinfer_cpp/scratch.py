"""Scratch files and folders next to an output file, and the clean-up of stale ones.

A conversion writes its output to a hidden temporary file (renamed on success) and the
sparse pipeline keeps a full dense copy of the model in a hidden folder while it profiles.
Both are removed on any error, but a process killed with SIGKILL (or by the OOM killer)
cannot remove them, and a dense copy can be many gigabytes. So every scratch name carries
the PID of its owner, and the next conversion into the same folder removes the scratch of
owners that no longer run.

Names: ``.{output}.{pid}-{random}.tmp`` (file) and ``.{output}.sparse-{pid}-{random}``
(folder).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

# tempfile's random part is 8 characters of [a-z0-9_]
log = logging.getLogger("powerinfer_cpp.convert")

_STALE_FILE = re.compile(r"^\..+\.(\d+)-[a-z0-9_]{8}\.tmp$")
_STALE_DIR = re.compile(r"^\..+\.sparse-(\d+)-[a-z0-9_]{8}$")


def scratch_file(out_path: str) -> tuple[int, str]:
    """(fd, path) of a new private scratch file beside out_path, owned by this process."""
    return tempfile.mkstemp(dir=os.path.dirname(out_path), suffix=".tmp",
                            prefix=f".{os.path.basename(out_path)}.{os.getpid()}-")


def scratch_dir(out_path: str) -> str:
    """A new scratch folder beside out_path, owned by this process."""
    return tempfile.mkdtemp(dir=os.path.dirname(out_path),
                            prefix=f".{os.path.basename(out_path)}.sparse-{os.getpid()}-")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, owned by another user
        return True
    return True


def remove_stale(folder: str) -> list[str]:
    """Remove the scratch files and folders in `folder` whose owner process is gone;
    returns their paths. Anything else (or anything that cannot be removed) is left."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        m = (_STALE_DIR if is_dir else _STALE_FILE).match(name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            if is_dir:
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(path)
        log.warning("removed %s, left by a conversion that was killed (process %s)", path,
                    m.group(1))
    return removed
