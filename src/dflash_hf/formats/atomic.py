"""Atomic folder writes: every export is written beside its destination and renamed into place.

A killed export (SIGKILL runs no cleanup) leaves its temporary folder behind; the next export to the same destination
removes it, and only what it can prove is such a leftover (`_remove_stale_partials`).
"""

import glob
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

FOLDER_MODE = 0o777  # before the umask, as mkdir would
# Inside each export's temporary folder while it is written: who writes it, so a later export can prove a leftover
# folder is a dead export's and remove it (`_remove_stale_partials`).
PARTIAL_MARKER = ".dflash-hf-partial.json"
PARTIAL_WRITER = "dflash-hf export"
# A partial this old is stale even when its writer cannot be checked (another host, or a pid reused since): an export
# writes one draft, minutes even at Kimi-K2.6 size, so nothing is still writing it a day later.
STALE_PARTIAL_SECONDS = 24 * 3600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # no harmless liveness probe (os.kill(pid, 0) signals on Windows): rely on the age
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def _is_stale_partial(folder: Path, dst: Path) -> bool:
    """Whether `folder` is provably an export to `dst` whose writer is gone: its marker names our writer and `dst`,
    and the writer's pid is dead on this host, or the marker is older than STALE_PARTIAL_SECONDS."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    try:
        marker = json.loads((folder / PARTIAL_MARKER).read_text())
        pid, host, started = int(marker["pid"]), str(marker["host"]), float(marker["started"])
        if marker["writer"] != PARTIAL_WRITER or marker["destination"] != dst.name:
            return False
    except (OSError, ValueError, TypeError, KeyError):
        return False  # no marker, or not ours: never touched
    if time.time() - started > STALE_PARTIAL_SECONDS:
        return True
    return host == socket.gethostname() and not _pid_alive(pid)


def _remove_stale_partials(dst: Path) -> None:
    """Remove the temporary folders that killed exports to `dst` left (SIGKILL runs no cleanup), and nothing else."""
    for folder in dst.parent.glob(f".{glob.escape(dst.name)}.*.partial"):
        if _is_stale_partial(folder, dst):
            shutil.rmtree(folder, ignore_errors=True)
            logger.info("Removed %s, left by an export to %s that did not finish.", folder, dst)


@contextmanager
def atomic_folder(dst, overwrite: bool = False):
    """Yield a temporary folder beside `dst`; on success it replaces `dst` by rename, on failure it vanishes.

    The folder holds a marker (writer, pid, host, start time) until the rename, so a later call for the same `dst`
    can remove what a killed run left, and only that.
    """
    dst = Path(dst)
    if dst.exists() and not overwrite and (dst.is_file() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not empty; pass overwrite=True (--overwrite) to replace it.")
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(dst)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        marker = {"writer": PARTIAL_WRITER, "destination": dst.name, "pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.time()}
        (staging / PARTIAL_MARKER).write_text(json.dumps(marker))
        yield staging
        (staging / PARTIAL_MARKER).unlink()
        staging.chmod(FOLDER_MODE & ~_umask())  # mkdtemp makes it private; the result is an ordinary folder
        if dst.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
            os.replace(dst, retired / dst.name)
            try:
                os.replace(staging, dst)
            except BaseException:
                os.replace(retired / dst.name, dst)
                raise
            finally:
                shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
