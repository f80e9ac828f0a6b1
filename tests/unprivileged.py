"""Commands run as the images' unprivileged user, from tests that run as root.

The images run as uid 1000 (HwHiAiUser, docker/kserve.Dockerfile) in a root-owned working
directory; `as_user` runs a command so (util-linux setpriv, with only the groups given: Docker's
USER uid:gid gives its process that one group). What such a user must reach is made in a
`Workspace`, a directory all may enter (pytest's own temporary directories are root's alone).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

#: The images' user and group (docker/kserve.Dockerfile, HWHIAIUSER_UID and HWHIAIUSER_GID).
UID = GID = 1000


def as_user(argv: list[str], uid: int = UID, gid: int = GID, groups: tuple[int, ...] = ()) -> list[str]:
    """`argv` run as `uid`, in group `gid` and the supplementary `groups` only."""
    supplementary = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *supplementary, *argv]


class Workspace:
    """A root-owned directory anyone may enter, for what an unprivileged process reads, runs or writes."""

    def __init__(self):
        self.path = Path(tempfile.mkdtemp(prefix="kserve-ascend-unprivileged-"))
        self.path.chmod(0o755)

    def directory(self, name: str, owner: int | None = UID, mode: int = 0o755) -> Path:
        """A directory in the workspace: the user's (writable) by default, root's (read-only to it) with owner None."""
        made = self.path / name
        made.mkdir(parents=True)
        made.chmod(mode)
        if owner is not None:
            os.chown(made, owner, owner)
        return made

    def python(self, venv: Path) -> Path:
        """An interpreter the user can run that imports what `venv` has installed.

        Usually `venv`'s own; where its base interpreter lies in a directory others cannot
        enter (a root's pyenv under /root), a virtualenv of a reachable interpreter of the same
        version, with `venv`'s site-packages on its path (a .pth file)."""
        own = venv / "bin" / "python"
        base = Path(os.path.realpath(own))
        if reachable(base):
            return own
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        found = shutil.which(f"python{version}", path="/usr/local/bin:/usr/bin")
        assert found and reachable(Path(found)), f"no Python {version} uid {UID} can run: not {base}, none in /usr/local/bin or /usr/bin"
        view = self.path / "python"
        subprocess.run([str(found), "-m", "venv", "--without-pip", str(view)], check=True)
        site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
        (Path(sysconfig.get_path("purelib", vars={"base": str(view), "platbase": str(view)})) / "view.pth").write_text(f"{site}\n")
        return view / "bin" / "python"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def reachable(path: Path) -> bool:
    """Whether any user can run `path`: every directory above it enterable by others, and it executable."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in [*path.parents, path])
