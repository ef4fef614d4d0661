"""The save lock: one save at a time into a checkpoint path, across jobs.

The coordinating rank creates `save.lock` (exclusively, where the storage can) before it touches
the path, and removes it once the save has committed or failed. A lock whose owner is a dead
process on this host (a killed job) is stale and taken over; an owner on another host cannot be
checked and holds the lock until `cleanup` removes it.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Optional

from .errors import SaveError
from .storage import Storage

LOCK_FILE = "save.lock"


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "id": uuid.uuid4().hex}


def holder(storage: Storage) -> Optional[dict]:
    """The lock's owner, or None when the path is not locked (or the lock is unreadable)."""
    try:
        if not storage.exists(LOCK_FILE):
            return None
        value = json.loads(storage.read_bytes(LOCK_FILE))
        return value if isinstance(value, dict) else {}
    except FileNotFoundError:  # released between the two calls
        return None
    except (OSError, ValueError):
        return {}


def is_alive(owner: dict) -> bool:
    """Whether the owning process may still be saving (a process elsewhere is assumed to be)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return True
    if owner["pid"] == os.getpid():
        return False  # this process: its earlier save was waited for before this one began
    try:
        os.kill(owner["pid"], 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def acquire(storage: Storage) -> None:
    data = json.dumps(_owner()).encode()
    if storage.create_exclusive(LOCK_FILE, data):
        return
    owner = holder(storage)
    if owner is not None and is_alive(owner):
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        raise SaveError(f"{storage} is being written by another save (host {owner.get('host')}, pid "
                        f"{owner.get('pid')}, since {since}); wait for it or save elsewhere. If that job is "
                        f"gone, remove {LOCK_FILE} (bcp cleanup does for dead local jobs)")
    storage.remove(LOCK_FILE)  # stale: its job died
    if not storage.create_exclusive(LOCK_FILE, data):
        raise SaveError(f"{storage}: another save took the lock at the same moment")


def release(storage: Storage) -> None:
    try:
        storage.remove(LOCK_FILE)
    except OSError:
        pass  # the commit (or the failure) stands; a leftover lock is stale once this job ends
