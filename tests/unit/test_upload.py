"""Safe extraction of package archives: nothing may land outside the extraction folder."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from controlplane import upload
from controlplane.errors import InvalidPackageError
from controlplane.upload import PackageTooLargeError, extract_package

MiB = 2**20


def tar_of(*members: tuple[str, bytes | str | None, bytes], mode: str = "w:gz") -> io.BytesIO:
    """Members are (name, data for a file / link target, tar type)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, payload, kind in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = str(payload)
                tar.addfile(info)
            elif kind == tarfile.REGTYPE:
                data = payload if isinstance(payload, bytes) else str(payload).encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    buf.seek(0)
    return buf


def f(name: str, data: bytes = b"data") -> tuple[str, bytes, bytes]:
    return name, data, tarfile.REGTYPE


def sym(name: str, target: str) -> tuple[str, str, bytes]:
    return name, target, tarfile.SYMTYPE


def zip_of(*files: tuple[str, bytes], symlinks: tuple[tuple[str, str], ...] = ()) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in files:
            zf.writestr(name, data)
        for name, target in symlinks:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    buf.seek(0)
    return buf


def extract(buf: io.BytesIO, tmp_path: Path, max_bytes: int = MiB) -> Path:
    return extract_package(buf, tmp_path / "out", max_bytes=max_bytes, archive_name="pkg.tgz")


def test_files_at_the_root_make_the_package(tmp_path: Path) -> None:
    root = extract(tar_of(f("snooze_model.py"), f("weights/w.bin", b"\1\2")), tmp_path)
    assert root == tmp_path / "out"
    assert (root / "weights" / "w.bin").read_bytes() == b"\1\2"


def test_single_top_level_folder_is_the_package(tmp_path: Path) -> None:
    root = extract(tar_of(f("my-net/snooze_model.py"), f("my-net/sub/a.txt")), tmp_path)
    assert root == tmp_path / "out" / "my-net"


def test_a_root_file_beside_the_folder_keeps_the_root(tmp_path: Path) -> None:
    root = extract(tar_of(f("my-net/snooze_model.py"), f("README")), tmp_path)
    assert root == tmp_path / "out"


def test_dot_prefixed_names_are_normalised(tmp_path: Path) -> None:
    root = extract(tar_of(("./", None, tarfile.DIRTYPE), f("./snooze_model.py")), tmp_path)
    assert (root / "snooze_model.py").is_file()


def test_uncompressed_tar_and_zip_are_accepted(tmp_path: Path) -> None:
    assert (extract(tar_of(f("a.py"), mode="w"), tmp_path / "t") / "a.py").is_file()
    assert (extract(zip_of(("pkg/a.py", b"x"), ("pkg/d/", b"")), tmp_path / "z") / "a.py").is_file()


@pytest.mark.parametrize(
    ("member", "fragment"),
    [
        ("../evil.py", "'../evil.py' escapes the package folder"),
        ("a/../../evil.py", "escapes the package folder"),
        ("/etc/cron.d/evil", "'/etc/cron.d/evil' has an absolute path"),
        ("C:/evil.py", "has an absolute path"),
        ("..\\evil.py", "backslash"),
    ],
)
def test_member_paths_escaping_the_root_are_refused(tmp_path: Path, member: str, fragment: str) -> None:
    with pytest.raises(InvalidPackageError) as info:
        extract(tar_of(f("ok.py"), f(member)), tmp_path)
    assert fragment in info.value.message
    assert info.value.message.startswith("pkg.tgz: member")
    assert info.value.hint
    assert not (tmp_path / "evil.py").exists()


def test_zip_member_escaping_the_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidPackageError, match="escapes the package folder"):
        extract(zip_of(("../evil.py", b"x")), tmp_path)


def test_symlinks_inside_the_package_are_kept(tmp_path: Path) -> None:
    archive = tar_of(f("weights/w.bin", b"w"), sym("current", "weights/w.bin"), sym("weights/self", "."))
    root = extract(archive, tmp_path)
    assert os.readlink(root / "current") == "weights/w.bin"
    assert (root / "current").read_bytes() == b"w"


@pytest.mark.parametrize(
    ("links", "fragment"),
    [
        ([sym("data", "../../etc/passwd")], "pointing outside the package (to '../../etc/passwd')"),
        ([sym("sub/data", "../..")], "pointing outside"),
        ([sym("data", "/etc/passwd")], "link to the absolute path '/etc/passwd'"),
        # each link looks inside on its own; followed together they leave the package
        ([sym("sub/up", ".."), sym("escape", "sub/up/..")], "pointing outside"),
    ],
)
def test_symlinks_pointing_outside_are_refused(tmp_path: Path, links: list, fragment: str) -> None:
    with pytest.raises(InvalidPackageError) as info:
        extract(tar_of(f("sub/a.py"), *links), tmp_path)
    assert fragment in info.value.message


def test_zip_symlink_pointing_outside_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidPackageError, match="pointing outside"):
        extract(zip_of(("a.py", b"x"), symlinks=(("data", "../../secret"),)), tmp_path)


def test_hardlinks_are_copied_inside_and_refused_outside(tmp_path: Path) -> None:
    root = extract(tar_of(f("a.bin", b"abc"), ("b.bin", "a.bin", tarfile.LNKTYPE)), tmp_path / "ok")
    assert (root / "b.bin").read_bytes() == b"abc"
    assert (root / "b.bin").stat().st_ino != (root / "a.bin").stat().st_ino
    with pytest.raises(InvalidPackageError, match="escapes the package folder"):
        extract(tar_of(f("a.bin"), ("b.bin", "../../etc/passwd", tarfile.LNKTYPE)), tmp_path / "out1")
    with pytest.raises(InvalidPackageError, match="hard link to 'missing'"):
        extract(tar_of(f("a.bin"), ("b.bin", "missing", tarfile.LNKTYPE)), tmp_path / "out2")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_device_files_and_fifos_are_refused(tmp_path: Path, kind: bytes) -> None:
    with pytest.raises(InvalidPackageError, match="'dev' is a device file or FIFO"):
        extract(tar_of(f("a.py"), ("dev", None, kind)), tmp_path)


def test_gzip_bomb_stops_at_the_limit(tmp_path: Path) -> None:
    archive = tar_of(f("weights.bin", b"\0" * (3 * MiB)))
    assert len(archive.getvalue()) < 50_000  # small upload, big content
    with pytest.raises(PackageTooLargeError) as info:
        extract(archive, tmp_path)
    assert info.value.status_code == 413
    assert "pkg.tgz (uncompressed) is larger than the 1 MiB limit" in info.value.message
    assert "SNOOZE_MAX_UPLOAD_MB" in info.value.hint


def test_zip_bomb_stops_at_the_limit(tmp_path: Path) -> None:
    with pytest.raises(PackageTooLargeError):
        extract(zip_of(("a.bin", b"\0" * (3 * MiB))), tmp_path)


def test_many_small_files_add_up_to_the_limit(tmp_path: Path) -> None:
    with pytest.raises(PackageTooLargeError):
        extract(tar_of(*(f(f"part{i}.bin", b"\1" * (300 * 1024)) for i in range(4))), tmp_path)


def test_too_many_members_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload, "MAX_MEMBERS", 3)
    with pytest.raises(InvalidPackageError, match="more than 3 entries"):
        extract(tar_of(*(f(f"{i}.py") for i in range(4))), tmp_path)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"not an archive at all", "not a tar or zip archive"),
        (tar_of(f("a.bin", os.urandom(10_000))).getvalue()[:2000], "damaged or truncated tar archive"),
        (tar_of().getvalue(), "the archive is empty"),
    ],
    ids=["not-an-archive", "truncated-tar", "empty-tar"],  # the same on every worker (a gzip header holds a time)
)
def test_broken_archives_are_named(tmp_path: Path, data: bytes, fragment: str) -> None:
    with pytest.raises(InvalidPackageError) as info:
        extract(io.BytesIO(data), tmp_path)
    assert fragment in info.value.message
    assert ".tar.gz" in info.value.hint


def test_a_path_that_is_both_link_and_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidPackageError, match="is a symlink and also a file"):
        extract(tar_of(sym("l", "a"), f("l/x.py")), tmp_path)
