"""The coordinator's run directory: where its socket, state file, history and
single-instance lock live, made so that no other local user can take any of
them over.

Rules (docs/coordinator.md, "Security model"):
  * Every directory on the way is owned by root or by the coordinator's uid
    and writable by no one else, unless it is sticky (like /tmp, where no one
    may rename or remove another user's entries): no other user can swap a
    path component. A symbolic link on the way is followed only when the
    directory holding it passed the same check.
  * The run directory itself is made with mkdir, mode 0750, its group the
    --group (else the coordinator's own group). One that exists already must
    be a directory (not a link) owned by the coordinator's uid and writable
    by no one else; with --group it is given to that group.
  * Files inside are opened relative to the directory's descriptor with
    O_NOFOLLOW, new ones with O_EXCL, so a link planted in the directory is
    never followed.
  * The state file is replaced atomically and durably: written to a new file,
    fsync'd, renamed over the old one, and the directory fsync'd.
  * One coordinator per socket: an exclusive flock on `<socket>.lock`, held
    for the daemon's life. The lock file is never removed (removing it would
    let two coordinators lock two different files).
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import pwd
import socket
import stat
from typing import Any, Dict, Optional, Tuple

from cotenant.coordinator import paths

_MAX_LINKS = 40  # as the kernel's ELOOP limit


class UnsafeRunDirectory(Exception):
    """The run directory, or a directory on its way, could be changed by
    another user; the message says which and what to do."""


class UnreadableJson(ValueError):
    """A file of the run directory holds no JSON object (a disk error, a hand
    edit); the message names it and why."""


class AlreadyRunning(Exception):
    """Another coordinator holds this socket's lock."""


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _check_ancestor(info: os.stat_result, path: str, uid: int) -> None:
    if info.st_uid not in (0, uid):
        raise UnsafeRunDirectory(
            f"{path} belongs to {_user(info.st_uid)}, who could replace the coordinator's files below it; "
            "choose a socket path whose directories belong to root or to you")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafeRunDirectory(
            f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}), who could replace the "
            "coordinator's files below it; choose another socket path or remove that write permission")


def _check_run_directory(info: os.stat_result, path: str, uid: int) -> None:
    if info.st_uid != uid:
        raise UnsafeRunDirectory(
            f"the run directory {path} belongs to {_user(info.st_uid)}, not to the coordinator's {_user(uid)}: "
            "someone else may have made it to take the coordinator over; remove it, or choose another --socket")
    if info.st_mode & 0o022:
        raise UnsafeRunDirectory(
            f"the run directory {path} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"make it 0750 (chmod 0750 {path}) or choose another --socket")


def _open_directory(path: str, mode: int, gid: int, uid: int) -> int:
    """Walks `path` from / one component at a time and returns a descriptor of
    its last directory, creating missing ones (mode `mode`, group `gid`)."""
    pending = [c for c in path.split("/") if c]
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    where, links = "/", 0
    try:
        _check_ancestor(os.fstat(fd), where, uid)
        while pending:
            part = pending.pop(0)
            if part == ".":
                continue
            below = os.path.normpath(os.path.join(where, part))
            last = not pending
            try:
                info = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if part == "..":
                    raise
                os.mkdir(part, mode, dir_fd=fd)
                info = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode) and info.st_uid == uid:
                    os.chown(part, -1, gid, dir_fd=fd, follow_symlinks=False)
                    os.chmod(part, mode, dir_fd=fd)  # mkdir applies the umask
                    info = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                # The directory holding the link passed the check: its target is trusted.
                links += 1
                if links > _MAX_LINKS:
                    raise UnsafeRunDirectory(f"too many symbolic links on the way to {path}")
                target = os.readlink(part, dir_fd=fd)
                pending = [c for c in target.split("/") if c] + pending
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    where = "/"
                continue
            if not stat.S_ISDIR(info.st_mode):
                raise UnsafeRunDirectory(f"{below} is not a directory; choose another socket path")
            flags = (os.O_RDONLY if last else os.O_PATH) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            next_fd = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd, where = next_fd, below
            info = os.fstat(fd)
            if last:
                _check_run_directory(info, where, uid)
            else:
                _check_ancestor(info, where, uid)
        return fd
    except BaseException:
        os.close(fd)
        raise


class RunDirectory:
    """The open run directory of one socket path; every file operation goes
    through its descriptor. `group_gid`: the --group, whose members may reach
    the socket (None: the coordinator's own group)."""

    def __init__(self, socket_path: str, group_gid: Optional[int] = None) -> None:
        self.socket_path = os.path.abspath(socket_path)
        self.path = os.path.dirname(self.socket_path)
        self.base = os.path.basename(self.socket_path)
        self.uid = os.geteuid()
        self.gid = group_gid if group_gid is not None else os.getegid()
        self.fd = _open_directory(self.path, 0o750, self.gid, self.uid)
        info = os.fstat(self.fd)
        if group_gid is not None and (info.st_gid != group_gid or not info.st_mode & 0o010):
            # Made by an earlier coordinator without --group, or given to
            # another group: the group's members must be able to reach the socket.
            os.fchown(self.fd, -1, group_gid)
            os.fchmod(self.fd, (stat.S_IMODE(info.st_mode) | 0o050) & ~0o022)
        self._lock_fd: Optional[int] = None
        self._socket_id: Optional[Tuple[int, int]] = None

    def name(self, suffix: str) -> str:
        return self.base + suffix

    # --- the single-instance lock ----------------------------------------------

    def lock(self) -> None:
        """Takes `<socket>.lock` for this process's life; raises AlreadyRunning
        when another coordinator holds it."""
        fd = os.open(self.name(paths.LOCK_SUFFIX), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640,
                     dir_fd=self.fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise AlreadyRunning(
                f"a coordinator already serves {self.socket_path}" + (f" (pid {holder})" if holder else "") +
                "; stop it first or give another --socket") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    # --- the socket ------------------------------------------------------------

    def listen(self, backlog: int) -> socket.socket:
        """Binds and listens on the socket path (mode 0660, the directory's
        group). Needs the lock: a socket file left there is a dead coordinator's."""
        assert self._lock_fd is not None, "take the lock before binding"
        try:
            info = os.stat(self.base, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            info = None
        if info is not None:
            if not stat.S_ISSOCK(info.st_mode):
                raise UnsafeRunDirectory(
                    f"{self.socket_path} exists and is not a socket; remove it or give another --socket")
            _refuse_if_answering(self.socket_path)  # a coordinator of a version without the lock
            os.unlink(self.base, dir_fd=self.fd)  # stale socket of a dead coordinator
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)  # born 0660: never a moment with a wider mode
        try:
            sock.bind(self.socket_path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old_umask)
        os.chown(self.base, -1, self.gid, dir_fd=self.fd, follow_symlinks=False)
        info = os.stat(self.base, dir_fd=self.fd, follow_symlinks=False)
        self._socket_id = (info.st_dev, info.st_ino)
        sock.listen(backlog)
        return sock

    def remove_socket(self) -> bool:
        """Removes the socket file if it is still the one listen() made;
        another's (replaced since) stays. Returns True when removed."""
        try:
            info = os.stat(self.base, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (info.st_dev, info.st_ino) != self._socket_id:
            return False
        os.unlink(self.base, dir_fd=self.fd)
        return True

    # --- files -----------------------------------------------------------------

    def read_json(self, suffix: str) -> Dict[str, Any]:
        """The JSON object in `<socket><suffix>`; {} when there is none. A file
        that holds no JSON object raises UnreadableJson, a link there
        UnsafeRunDirectory."""
        try:
            fd = os.open(self.name(suffix), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return {}
        except OSError as error:
            raise self._link_error(suffix, error) from None
        with io.open(fd, "rb") as f:
            try:
                value = json.loads(f.read())
            except ValueError as error:  # UnicodeDecodeError too
                raise UnreadableJson(f"{self.name(suffix)} is not JSON ({error})") from None
        if not isinstance(value, dict):
            raise UnreadableJson(f"{self.name(suffix)} holds a JSON {type(value).__name__}, not an object")
        return value

    def write_durably(self, suffix: str, data: bytes) -> None:
        """Replaces `<socket><suffix>` with `data`: when this returns, the new
        content survives a crash of the process or of the machine."""
        name, tmp = self.name(suffix), self.name(suffix + ".tmp")
        try:
            os.unlink(tmp, dir_fd=self.fd)  # a leftover of a killed coordinator
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640,
                     dir_fd=self.fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)  # renames the entry, follows nothing
        os.fsync(self.fd)

    def open_append(self, suffix: str) -> io.TextIOWrapper:
        """`<socket><suffix>` opened for appending, line-buffered."""
        try:
            fd = os.open(self.name(suffix), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o640, dir_fd=self.fd)
        except OSError as error:
            raise self._link_error(suffix, error) from None
        return io.open(fd, "a", buffering=1)

    def rename(self, suffix: str, new_suffix: str) -> None:
        os.replace(self.name(suffix), self.name(new_suffix), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def _link_error(self, suffix: str, error: OSError) -> OSError:
        if error.errno == errno.ELOOP:
            return UnsafeRunDirectory(
                f"{self.socket_path}{suffix} is a symbolic link; the coordinator follows none in its run "
                "directory: remove it")
        return error

    def close(self) -> None:
        os.close(self.fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None


def _refuse_if_answering(path: str) -> None:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return
    finally:
        probe.close()
    raise AlreadyRunning(f"a coordinator already serves {path}; stop it first or give another --socket")
