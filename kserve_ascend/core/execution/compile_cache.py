"""The directory where ONNX Runtime's CANN execution provider keeps the models it compiles.

onnxruntime-cann 1.22.1 compiles a subgraph on its first run at each input shape and saves it
through CANN's aclgrphSaveModel under a *relative* name, `<subgraph>_<shape hash>` (CANN adds
".om"); when the save fails, the run fails. On a later run, in this process or the next, it loads
`<subgraph>_<shape hash>.om` from the working directory instead of compiling, when that file is
there (CANNExecutionProvider::Compile in onnxruntime v1.22.1's
onnxruntime/core/providers/cann/cann_execution_provider.cc; the save is its `dump_om_model`
option, on by default). The provider has no option for the directory, so a process about to use
it works in this cache directory from then on: writable whichever directory the process started
in (the images start in a root-owned one), and a compile cache across restarts where it is kept.
CANN's own compiler writes its working files into the working directory as well.

    KSERVE_ASCEND_CACHE_DIR   the cache directory (default: $XDG_CACHE_HOME/kserve-ascend, that is
                              ~/.cache/kserve-ascend); on a read-only root file system, a volume
                              mounted there (Kubernetes: an emptyDir; a persistent volume keeps
                              the compiled models across pods).

The compiled models of one onnxruntime and one CANN go into a subdirectory of their own (an .om
belongs to the CANN that built it). `<subgraph>` carries a hash of the model file's *path*, not of
its content (GenerateMetaDefId, onnxruntime/core/framework/model_metadef_id_generator.cc: "prefer
path the model was loaded from"), so a model file replaced at the same path would load the .om
compiled from its predecessor: the sha256 of each model is recorded, and when a model's file has
changed, the compiled models in the directory are removed (those of other models compile again too).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "KSERVE_ASCEND_CACHE_DIR"
#: The content digest of each model compiled here, by a digest of its path.
RECORDS = ".models"


class Unwritable(Exception):
    """The cache directory cannot be made or written; the message says which and how to fix it."""


def root() -> Path:
    """The cache directory: KSERVE_ASCEND_CACHE_DIR, else kserve-ascend's under the XDG cache home.

    Raises Unwritable when neither is set and the user has no home directory."""
    configured = os.environ.get(ENV)
    if configured:
        return Path(configured).absolute()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if cache.startswith("~"):
        raise Unwritable(f"uid {os.getuid()} has no home directory for the compile cache: set {ENV} to a writable directory")
    return Path(cache, "kserve-ascend").absolute()


def cann_version() -> str | None:
    """`version=` of <arch>-linux/ascend_toolkit_install.info in the CANN toolkit set_env.sh set up
    (CANN installation guide, "File Paths"), or None."""
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    for info in Path(home).glob("*-linux/ascend_toolkit_install.info") if home else ():
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("version="):
                return line.split("=", 1)[1].strip()
    return None


_lock = threading.Lock()
_entered: Path | None = None
#: (path, size, mtime) -> sha256: a model's digest is computed once per version of its file.
_digests: dict[tuple[str, int, int], str] = {}


def enter(model: Path, compiler: str) -> Path:
    """Makes this process work in the cache directory of `compiler` (e.g. "onnxruntime-1.22.1")
    and the installed CANN, with no model compiled from an earlier content of `model` in it.

    Raises Unwritable when the directory cannot be made or written."""
    global _entered
    directory = root() / f"{compiler}-cann-{cann_version() or 'unknown'}"
    with _lock:
        try:
            (directory / RECORDS).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise Unwritable(_unwritable(directory, f"cannot be made ({error.strerror})")) from None
        if not os.access(directory, os.W_OK | os.X_OK) or not os.access(directory / RECORDS, os.W_OK | os.X_OK):
            raise Unwritable(_unwritable(directory, "is not writable"))
        os.chdir(directory)
        if _entered != directory:
            _entered = directory
            log.info("working directory: %s (the compile cache of ONNX Runtime's CANN execution provider)", directory)
        _forget_if_changed(directory, model)
    return directory


def _unwritable(directory: Path, why: str) -> str:
    return (
        f"the compile cache {directory} {why} for uid {os.getuid()}: ONNX Runtime's CANN execution provider saves"
        f" the models it compiles there. Set {ENV} to a writable directory, or mount a writable volume there"
        " (Kubernetes: an emptyDir)"
    )


def _forget_if_changed(directory: Path, model: Path) -> None:
    """Records `model`'s digest; removes the compiled models when it differs from the one recorded."""
    path = str(model)
    record = directory / RECORDS / hashlib.sha256(path.encode()).hexdigest()
    digest = _digest(model)
    try:
        recorded = record.read_text().split("\n", 1)[0]
    except FileNotFoundError:
        recorded = digest  # compiled here for the first time: nothing of it to forget
    if recorded != digest:
        removed = [om for om in directory.glob("*.om") if om.is_file()]
        for om in removed:
            om.unlink(missing_ok=True)
        log.warning(
            "%s changed since models were compiled from it into %s: %d compiled model(s) removed (each compiles again when first used)",
            path, directory, len(removed),
        )
    if recorded != digest or not record.exists():
        written = record.with_name(f"{record.name}.{os.getpid()}")
        written.write_text(f"{digest}\n{path}\n")
        os.replace(written, record)


def _digest(model: Path) -> str:
    stat = model.stat()
    key = (str(model), stat.st_size, stat.st_mtime_ns)
    if key not in _digests:
        sha256 = hashlib.sha256()
        with open(model, "rb") as file:
            while chunk := file.read(1 << 20):
                sha256.update(chunk)
        _digests[key] = sha256.hexdigest()
    return _digests[key]
