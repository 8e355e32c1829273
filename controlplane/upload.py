"""Safe extraction of an uploaded package archive (.tar.gz, .tgz, .tar, .zip).

Nothing in an archive is trusted: every member path must stay inside the extraction folder, links
may only point inside it, device files and FIFOs are refused, and the uncompressed total is counted
while decompressing (a declared size can lie), so a zip bomb stops at the limit. Symlinks are
created after every regular file is written, so no write ever goes through a link.
"""

from __future__ import annotations

import gzip
import os
import posixpath
import re
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from controlplane.errors import InvalidPackageError

MAX_MEMBERS = 100_000
_CHUNK = 1024 * 1024
_DRIVE = re.compile(r"^[A-Za-z]:")
_TAR_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)
_FORMATS_HINT = "upload a .tar.gz, .tgz, .tar or .zip of the package folder (snoozectl publish builds one)"


class PackageTooLargeError(InvalidPackageError):
    status_code = 413
    code = "package_too_large"


def too_large(what: str, limit_bytes: int) -> PackageTooLargeError:
    return PackageTooLargeError(
        f"{what} is larger than the {limit_bytes / 2**20:g} MiB limit",
        hint="shrink the package (leave out checkpoints and caches) or raise SNOOZE_MAX_UPLOAD_MB on the server",
    )


@dataclass(frozen=True)
class _Member:
    name: str  # normalised relative POSIX path
    kind: str  # "dir" | "file" | "symlink" | "hardlink"
    link: str | None = None  # symlink target as written; hardlink: the normalised member it repeats


def _refuse(archive_name: str, member: str, problem: str, hint: str) -> InvalidPackageError:
    return InvalidPackageError(f"{archive_name}: member '{member}' {problem}", hint=hint)


def _safe_name(archive_name: str, raw: str) -> str:
    """The member's path relative to the package root, or an error naming it."""
    if "\x00" in raw or "\\" in raw:
        raise _refuse(
            archive_name,
            raw,
            "has a backslash or NUL in its name",
            "build the archive with forward-slash paths (tar or zip on Linux/macOS, or snoozectl publish)",
        )
    if raw.startswith("/") or _DRIVE.match(raw):
        raise _refuse(
            archive_name,
            raw,
            "has an absolute path",
            "archive the package with paths relative to its folder (tar -C <folder> -czf pkg.tgz .)",
        )
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _refuse(
            archive_name,
            raw,
            "escapes the package folder ('..' in its path)",
            "archive the package with paths relative to its folder, without '..'",
        )
    return "/".join(parts)


def _check_link_target(archive_name: str, member: str, target: str, *, relative_to_member: bool) -> str:
    """Normalised target of a link, which must stay inside the package."""
    if target.startswith("/") or _DRIVE.match(target):
        raise _refuse(
            archive_name,
            member,
            f"is a link to the absolute path '{target}'",
            "copy the file into the package instead of linking to it",
        )
    base = posixpath.dirname(member) if relative_to_member else ""
    resolved = posixpath.normpath(posixpath.join(base, target))
    if resolved == ".." or resolved.startswith("../"):
        raise _refuse(
            archive_name,
            member,
            f"is a link pointing outside the package (to '{target}')",
            "copy the file into the package instead of linking to it",
        )
    return resolved


class _Budget:
    """Counts uncompressed bytes and members against the limits."""

    def __init__(self, archive_name: str, max_bytes: int) -> None:
        self.archive_name = archive_name
        self.max_bytes = max_bytes
        self.total = 0
        self.members = 0

    def add_member(self) -> None:
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise InvalidPackageError(
                f"{self.archive_name}: more than {MAX_MEMBERS} entries",
                hint="leave caches and datasets out of the package",
            )

    def add_bytes(self, n: int) -> None:
        self.total += n
        if self.total > self.max_bytes:
            raise too_large(f"{self.archive_name} (uncompressed)", self.max_bytes)


def _copy_counted(src: IO[bytes], dest: Path, budget: _Budget) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        while chunk := src.read(_CHUNK):
            budget.add_bytes(len(chunk))
            out.write(chunk)


def _tar_members(tar: tarfile.TarFile, archive_name: str) -> Iterator[tuple[_Member, tarfile.TarInfo]]:
    for info in tar:
        name = _safe_name(archive_name, info.name)
        if info.isdir():
            yield _Member(name, "dir"), info
        elif info.isreg():
            yield _Member(name, "file"), info
        elif info.issym():
            _check_link_target(archive_name, name, info.linkname, relative_to_member=True)
            yield _Member(name, "symlink", info.linkname), info
        elif info.islnk():
            target = _check_link_target(
                archive_name, name, _safe_name(archive_name, info.linkname), relative_to_member=False
            )
            yield _Member(name, "hardlink", target), info
        else:
            raise _refuse(
                archive_name,
                info.name,
                "is a device file or FIFO",
                "a package holds regular files, folders and links inside the package only",
            )


def _zip_kind(info: zipfile.ZipInfo) -> str:
    file_type = stat.S_IFMT(info.external_attr >> 16)  # 0 when the zip tool recorded no Unix mode
    if info.is_dir() or file_type == stat.S_IFDIR:
        return "dir"
    if file_type == stat.S_IFLNK:
        return "symlink"
    if file_type not in (0, stat.S_IFREG):
        return "special"
    return "file"


class _Extraction:
    def __init__(self, dest: Path, archive_name: str, max_bytes: int) -> None:
        self.root = dest
        self.archive_name = archive_name
        self.budget = _Budget(archive_name, max_bytes)
        self.files: set[str] = set()
        self.symlinks: list[_Member] = []

    def path_of(self, member: _Member) -> Path:
        return self.root / member.name if member.name else self.root

    def write(self, member: _Member, stream: IO[bytes]) -> None:
        _copy_counted(stream, self.path_of(member), self.budget)
        self.files.add(member.name)

    def hardlink(self, member: _Member) -> None:
        # Copied, never linked: a later write to one name must not change the other.
        if member.link not in self.files:
            raise _refuse(
                self.archive_name,
                member.name,
                f"is a hard link to '{member.link}', which is not a file before it",
                "archive the package with tar's default options (or replace the link by a copy)",
            )
        target = self.root / str(member.link)
        self.budget.add_bytes(target.stat().st_size)
        dest = self.path_of(member)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, dest)
        self.files.add(member.name)

    def finish_symlinks(self) -> None:
        root = self.root.resolve()
        for member in self.symlinks:
            dest = self.path_of(member)
            if os.path.lexists(dest):
                raise _refuse(
                    self.archive_name,
                    member.name,
                    "is a symlink and also a file or folder of the archive",
                    "keep one entry per path in the archive",
                )
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(str(member.link), dest)
        for member in self.symlinks:  # links to links: check where each one really ends
            if not self.path_of(member).resolve().is_relative_to(root):
                raise _refuse(
                    self.archive_name,
                    member.name,
                    f"is a link pointing outside the package (to '{member.link}')",
                    "copy the file into the package instead of linking to it",
                )

    def add(self, member: _Member) -> bool:
        """Handle what needs no content; False when the member's data must be written."""
        self.budget.add_member()
        if not member.name and member.kind != "dir":
            raise _refuse(self.archive_name, member.name, "has an empty name", "keep one entry per path in the archive")
        if member.kind == "dir":
            self.path_of(member).mkdir(parents=True, exist_ok=True)
        elif member.kind == "symlink":
            self.symlinks.append(member)
        elif member.kind == "hardlink":
            self.hardlink(member)
        else:
            return False
        return True


def _extract_tar(fileobj: BinaryIO, job: _Extraction) -> None:
    try:
        with tarfile.open(fileobj=fileobj, mode="r:*") as tar:
            for member, info in _tar_members(tar, job.archive_name):
                if not job.add(member):
                    stream = tar.extractfile(info)
                    assert stream is not None  # a regular file always has a stream
                    job.write(member, stream)
    except _TAR_ERRORS as exc:
        raise InvalidPackageError(
            f"{job.archive_name}: damaged or truncated tar archive ({exc})", hint=_FORMATS_HINT
        ) from exc


def _extract_zip(fileobj: BinaryIO, job: _Extraction) -> None:
    try:
        with zipfile.ZipFile(fileobj) as zf:
            infos = zf.infolist()
            declared = sum(i.file_size for i in infos)
            if declared > job.budget.max_bytes:  # fast refusal; the real count happens while inflating
                raise too_large(f"{job.archive_name} (uncompressed)", job.budget.max_bytes)
            for info in infos:
                name = _safe_name(job.archive_name, info.filename)
                kind = _zip_kind(info)
                if kind == "special":
                    raise _refuse(
                        job.archive_name,
                        info.filename,
                        "is a device file or FIFO",
                        "a package holds regular files, folders and links inside the package only",
                    )
                link = None
                if kind == "symlink":
                    link = zf.read(info).decode("utf-8", errors="replace")
                    _check_link_target(job.archive_name, name, link, relative_to_member=True)
                member = _Member(name, kind, link)
                if not job.add(member):
                    with zf.open(info) as stream:
                        job.write(member, stream)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, zlib.error) as exc:
        raise InvalidPackageError(f"{job.archive_name}: damaged zip archive ({exc})", hint=_FORMATS_HINT) from exc


def _is_zip(fileobj: BinaryIO) -> bool:
    fileobj.seek(0)
    magic = fileobj.read(4)
    fileobj.seek(0)
    return magic in (b"PK\x03\x04", b"PK\x05\x06")


def package_root(extracted: Path) -> Path:
    """A single top-level folder is the package when the archive has nothing else at its root."""
    entries = list(extracted.iterdir())
    # A numbered folder alone is a Triton model folder's version (an ensemble's 1/, an auto-complete model's
    # 1/model.py): the archive's root is the model folder then.
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink() and not entries[0].name.isdigit():
        return entries[0]
    return extracted


def extract_package(fileobj: BinaryIO, dest: Path, *, max_bytes: int, archive_name: str = "upload") -> Path:
    """Extract an uploaded archive into the empty folder ``dest``; return the package root.

    Raises InvalidPackageError (PackageTooLargeError past ``max_bytes``) naming the member and the fix;
    ``dest`` may then hold a partial extraction, which the caller discards."""
    dest.mkdir(parents=True, exist_ok=True)
    job = _Extraction(dest, archive_name, max_bytes)
    if _is_zip(fileobj):
        _extract_zip(fileobj, job)
    else:
        try:
            tarfile.open(fileobj=fileobj, mode="r:*").close()
        except _TAR_ERRORS as exc:
            raise InvalidPackageError(f"{archive_name}: not a tar or zip archive", hint=_FORMATS_HINT) from exc
        fileobj.seek(0)
        _extract_tar(fileobj, job)
    job.finish_symlinks()
    if job.budget.members == 0:
        raise InvalidPackageError(f"{archive_name}: the archive is empty", hint=_FORMATS_HINT)
    return package_root(dest)
