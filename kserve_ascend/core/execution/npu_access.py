"""Can this process open the NPU? Its device nodes and the driver's library, checked before ACL starts.

The NPU driver's device nodes (/dev/davinci<N>, one per NPU, and /dev/davinci_manager,
/dev/devmm_svm, /dev/hisi_hdc, the ones every container that uses an NPU is given: Ascend
Docker Runtime, Ascend's device plugin) and its libraries (/usr/local/Ascend/driver/lib64, where
CANN's set_env.sh looks for libascend_hal.so: hicann/runtime scripts/package/runtime/set_env.sh)
belong to the host's HwHiAiUser group (`crw-rw---- 1 HwHiAiUser HwHiAiUser 239, 0 ... /dev/davinci0`,
as Ascend/ascend-npu-exporter's dsmi/dsmi.go reads them), whose gid differs between hosts. A
process outside that group fails inside ACL with a code that does not say why; this says which
node or library, whose group it is, and how to join it. Permissions only (access(2)): a device
is not opened here.

The server checks when it first uses the NPU (an .om model, or an ONNX model on the CANN
execution provider) and logs a WARNING per problem; a CPU-only host serving CPU models is never
checked. `make check-ascend` checks the same (tools/check_ascend_host.py).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

log = logging.getLogger(__name__)

#: FOR TESTS ONLY: a directory standing for / where the device nodes and driver libraries are looked
#: for (tests make fake ones there, with permissions the process lacks). Never set it in production.
TEST_ROOT_ENV = "KSERVE_ASCEND_TEST_DEVICE_ROOT"
MANAGEMENT_NODES = ("davinci_manager", "devmm_svm", "hisi_hdc")
DRIVER_LIBRARY = "libascend_hal.so"
#: Where the driver's libascend_hal.so is: lib64/driver/ of current drivers (the CANN images put
#: it on LD_LIBRARY_PATH: Ascend/cann-container-image cann/*/Dockerfile), lib64/ of older ones.
DRIVER_LIBRARIES = ("usr/local/Ascend/driver/lib64/driver", "usr/local/Ascend/driver/lib64")
_GIVE_NPU = (
    "give the container the NPU (Kubernetes: the device plugin's resource, e.g. huawei.com/Ascend910: 1;"
    " docker: Ascend Docker Runtime with ASCEND_VISIBLE_DEVICES, or --device for /dev/davinci<N>,"
    " /dev/davinci_manager, /dev/devmm_svm and /dev/hisi_hdc)"
)


def problems() -> list[str]:
    """What keeps this process from the NPU's device nodes and driver library, each with its fix; [] if nothing."""
    root = Path(os.environ.get(TEST_ROOT_ENV) or "/")
    dev = root / "dev"
    found, missing = [], []
    chips = sorted((p for p in dev.glob("davinci*") if p.name[len("davinci"):].isdigit()), key=lambda p: int(p.name[7:]))
    if not chips:
        missing.append(str(dev / "davinci<N>"))
    for node in [*chips, *(dev / name for name in MANAGEMENT_NODES)]:
        if not node.exists():
            missing.append(str(node))
        elif not os.access(node, os.R_OK | os.W_OK):
            found.append(f"{node} cannot be opened for reading and writing: {_denied(node, stat.S_IRGRP | stat.S_IWGRP)}")
    if missing:
        found.insert(0, f"no {', '.join(missing)}: {_GIVE_NPU}")
    library = _driver_library(root)
    if isinstance(library, str):
        found.append(library)
    return found


def _driver_library(root: Path) -> Path | str:
    """The readable libascend_hal.so, or why there is none."""
    for directory in (root / d for d in DRIVER_LIBRARIES):
        for step in [*reversed(directory.parents), directory]:
            if not os.path.isdir(step):
                break
            if not os.access(step, os.X_OK):
                return f"the NPU driver's {DRIVER_LIBRARY} cannot be reached: {step} cannot be entered: {_denied(step, stat.S_IXGRP)}"
        library = directory / DRIVER_LIBRARY
        if library.exists():
            if os.access(library, os.R_OK):
                return library
            return f"the NPU driver's library {library} cannot be read: {_denied(library, stat.S_IRGRP)}"
    return (
        f"the NPU driver's {DRIVER_LIBRARY} is in none of {', '.join(str(root / d) for d in DRIVER_LIBRARIES)}:"
        " mount the host's /usr/local/Ascend/driver/lib64 there (Ascend Docker Runtime and the device plugin do)"
    )


def _denied(path: Path, group_bits: int) -> str:
    """Whose `path` is, who this process is, and how to become one who may (the group, when its `group_bits` allow)."""
    info = path.stat()
    whose = f"{stat.filemode(info.st_mode)} uid {info.st_uid} gid {info.st_gid}"
    me = f"this process is uid {os.getuid()} with gids {sorted({os.getgid(), *os.getgroups()})}"
    if info.st_mode & group_bits == group_bits:
        return (
            f"it is {whose}, {me}. Run it in group {info.st_gid}, the NPU driver's group (HwHiAiUser) on this host:"
            f" build the image with --build-arg HWHIAIUSER_GID={info.st_gid}, or add the group"
            f" (Kubernetes: securityContext.supplementalGroups: [{info.st_gid}]; docker run --group-add {info.st_gid})"
        )
    return f"it is {whose}, {me}. Only its owner may: run as uid {info.st_uid} (build the image with --build-arg HWHIAIUSER_UID={info.st_uid})"


_warned = threading.Event()


def warn_once() -> list[str]:
    """`problems()`, each logged as a WARNING the first time this process asks; [] if nothing."""
    found = problems()
    if not _warned.is_set():
        _warned.set()
        for problem in found:
            log.warning("NPU access: %s", problem)
    return found
