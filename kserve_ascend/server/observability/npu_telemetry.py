"""Temperature, power and health of each NPU, read through the Ascend driver's DCMI library at scrape.

`libdcmi.so` comes with the driver (/usr/local/Ascend/driver/lib64/driver, which the CANN images
put on LD_LIBRARY_PATH). It is loaded with ctypes where the dynamic loader finds it
(LD_LIBRARY_PATH, its cache: where Ascend/ascend-npu-exporter looks, common-utils/utils/path.go
GetDriverLibPath), else from that directory. The calls, their signatures, units and codes are
Huawei's DCMI API reference's (hiascend.com, Atlas 200I A2 "DCMI API参考" re/api: api_008
dcmi_get_card_list, api_020 dcmi_get_device_power_info, api_024 dcmi_get_device_health, api_040
dcmi_get_device_temperature, api_075 dcmi_get_device_logic_id, api_177 the return codes) and the
driver's dcmi_interface_api.h (as ascend-npu-exporter's devmanager/dcmi/ carries it); which chips
to ask, and the bounds of a sane reading, are ascend-npu-exporter's (devmanager/dcmi/dcmi.go:
DcGetLogicIDList, DcGetDeviceTemperature, DcGetDevicePowerInfo, DcGetDeviceHealth):

- at start, `dcmi_init`, then every chip: the cards (`dcmi_get_card_list`), the chips of each
  (`dcmi_get_device_num_in_card`) and the chip's logic ID (`dcmi_get_device_logic_id`), the
  `device` label. Without ASCEND_RT_VISIBLE_DEVICES a logic ID is the device ID acl.rt.set_device
  takes (CANN runtime API, aclrtGetLogicDevIdByUserDevId: "if ASCEND_RT_VISIBLE_DEVICES is not
  set, the logical device ID is the same as the user device ID"), so it meets the `device` of
  `npu_utilization_percent`; npu-exporter labels its chips with the physical ID instead;
- at each scrape, per chip: `ascend_npu_temperature_celsius` (`dcmi_get_device_temperature`,
  degrees Celsius), `ascend_npu_power_watts` (`dcmi_get_device_power_info`, in 0.1 W) and
  `ascend_npu_health` (`dcmi_get_device_health`: 0 normal, 1 general (minor) alarm, 2 major
  alarm, 3 critical alarm; the most severe alarm of the chip).

Without the library (a CPU host), or when it does not load, or `dcmi_init` or listing the chips
fails, there are no such metrics, said once in the log at start. A call that fails at a scrape (a
negative DCMI code) or answers no reading (health 0xFFFFFFFF: no such chip; a temperature below
-275 °C or a negative power, which npu-exporter refuses too) leaves that one sample out, logged
once per chip, call and code; the scrape answers with the rest.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

LIBRARY = "libdcmi.so"
#: Where the driver installs it, for a process whose loader path lacks it.
DRIVER_DIRECTORY = Path("/usr/local/Ascend/driver/lib64/driver")
#: dcmi_get_card_list: "最大支持64个" cards (api_008); npu-exporter's HiAIMaxCardNum.
MAX_CARDS = 64
#: DCMI's codes (api_177) that say more than their number.
CODES = {
    -8001: "DCMI_ERR_CODE_INVALID_PARAMETER", -8002: "DCMI_ERR_CODE_OPER_NOT_PERMITTED",
    -8005: "DCMI_ERR_CODE_INNER_ERR", -8006: "DCMI_ERR_CODE_TIME_OUT", -8007: "DCMI_ERR_CODE_INVALID_DEVICE_ID",
    -8008: "DCMI_ERR_CODE_DEVICE_NOT_EXIST", -8012: "DCMI_ERR_CODE_NOT_REDAY",
    -8013: "DCMI_ERR_CODE_NOT_SUPPORT_IN_CONTAINER", -8255: "DCMI_ERR_CODE_NOT_SUPPORT",
}
#: Below it a temperature is a failed reading (npu-exporter's DefaultTemperatureWhenQueryFailed).
COLDEST = -275
HEALTH_CODES = range(4)

_int_p, _uint_p = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint)
#: name -> argument types; each returns an int, 0 (DCMI_OK) or a negative code.
_SIGNATURES = {
    "dcmi_init": [],
    "dcmi_get_card_list": [_int_p, _int_p, ctypes.c_int],
    "dcmi_get_device_num_in_card": [ctypes.c_int, _int_p],
    "dcmi_get_device_logic_id": [_int_p, ctypes.c_int, ctypes.c_int],
    "dcmi_get_device_temperature": [ctypes.c_int, ctypes.c_int, _int_p],
    "dcmi_get_device_power_info": [ctypes.c_int, ctypes.c_int, _int_p],
    "dcmi_get_device_health": [ctypes.c_int, ctypes.c_int, _uint_p],
}


class DcmiError(Exception):
    """A DCMI call answered a code other than 0, or a value the reference does not define."""

    def __init__(self, call: str, problem: str):
        super().__init__(f"{call} {problem}")
        self.call = call


def _describe(code: int) -> str:
    return f"returned {code}" + (f" ({CODES[code]})" if code in CODES else "")


@dataclass(frozen=True)
class Chip:
    """An NPU as DCMI addresses it (card, device in card) and names it (its logic ID)."""

    card: int
    device: int
    logic_id: int


class Dcmi:
    """The few DCMI calls used, over a loaded libdcmi.so."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int

    def call(self, name: str, *args) -> None:
        if code := getattr(self.library, name)(*args):
            raise DcmiError(name, _describe(code))

    def chips(self) -> list[Chip]:
        self.call("dcmi_init")
        count, cards = ctypes.c_int(), (ctypes.c_int * MAX_CARDS)()
        self.call("dcmi_get_card_list", ctypes.byref(count), cards, MAX_CARDS)
        found = []
        for card in cards[:count.value]:
            in_card, logic_id = ctypes.c_int(), ctypes.c_int()
            self.call("dcmi_get_device_num_in_card", card, ctypes.byref(in_card))
            for device in range(in_card.value):
                self.call("dcmi_get_device_logic_id", ctypes.byref(logic_id), card, device)
                found.append(Chip(card, device, logic_id.value))
        return found

    def temperature_celsius(self, chip: Chip) -> float:
        value = ctypes.c_int()
        self.call("dcmi_get_device_temperature", chip.card, chip.device, ctypes.byref(value))
        if value.value < COLDEST:
            raise DcmiError("dcmi_get_device_temperature", f"answered {value.value} °C, a failed reading")
        return value.value

    def power_watts(self, chip: Chip) -> float:
        value = ctypes.c_int()
        self.call("dcmi_get_device_power_info", chip.card, chip.device, ctypes.byref(value))
        if value.value < 0:
            raise DcmiError("dcmi_get_device_power_info", f"answered a negative power, {value.value}")
        return value.value / 10  # in 0.1 W

    def health(self, chip: Chip) -> float:
        value = ctypes.c_uint()
        self.call("dcmi_get_device_health", chip.card, chip.device, ctypes.byref(value))
        if value.value not in HEALTH_CODES:
            raise DcmiError("dcmi_get_device_health", f"answered {value.value:#x}, no health code (0xffffffff: no such chip)")
        return value.value


#: (name, help, reading) of each metric, labelled `device`.
_READINGS: tuple[tuple[str, str, Callable[[Dcmi, Chip], float]], ...] = (
    ("ascend_npu_temperature_celsius", "Temperature of the NPU in degrees Celsius (DCMI)", Dcmi.temperature_celsius),
    ("ascend_npu_power_watts", "Power drawn by the NPU in watts (DCMI)", Dcmi.power_watts),
    ("ascend_npu_health", "Health of the NPU (DCMI): 0 normal, 1 minor alarm, 2 major alarm, 3 critical alarm", Dcmi.health),
)
METRICS = tuple(name for name, _, _ in _READINGS)


class NpuTelemetryCollector(Collector):
    """The readings of every chip, taken when scraped; one scrape at a time (no DCMI call is said to be thread-safe)."""

    def __init__(self, dcmi: Dcmi, chips: list[Chip]):
        self.dcmi, self.chips = dcmi, chips
        self._lock = threading.Lock()
        self._logged: set[tuple[str, Chip, str]] = set()

    def describe(self) -> list[Metric]:
        return []  # registering must not call DCMI (a registry collects a collector without one to learn its names)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            for name, documentation, read in _READINGS:
                metric = GaugeMetricFamily(name, documentation, labels=("device",))
                for chip in self.chips:
                    try:
                        metric.add_metric([str(chip.logic_id)], read(self.dcmi, chip))
                    except DcmiError as error:
                        self._log_once(chip, error)
                yield metric

    def _log_once(self, chip: Chip, error: DcmiError) -> None:
        key = (error.call, chip, str(error))
        if key not in self._logged:
            self._logged.add(key)
            log.warning("NPU telemetry: device %d (card %d, chip %d): %s; its sample is left out (logged once)",
                        chip.logic_id, chip.card, chip.device, error)


def load_library() -> ctypes.CDLL | str:
    """libdcmi.so where the loader finds it, else from the driver's directory; or why neither loads
    (the library is there but another it needs is not on the loader path)."""
    problems = []
    for candidate in (LIBRARY, DRIVER_DIRECTORY / LIBRARY):
        try:
            return ctypes.CDLL(str(candidate))
        except OSError as error:
            if f"{candidate}: cannot open shared object file" not in str(error):  # found, but it does not load
                problems.append(f"{candidate} does not load: {error}")
    return "; ".join(problems) or f"the Ascend driver's {LIBRARY} is neither on the loader path nor in {DRIVER_DIRECTORY}"


def open_collector() -> NpuTelemetryCollector | None:
    """The NPUs' collector, or None (said in the log) where DCMI is absent or cannot list them."""
    off = f"no {', '.join(METRICS)}"
    library = load_library()
    if isinstance(library, str):
        log.info("NPU telemetry off: %s: %s", library, off)
        return None
    try:
        dcmi = Dcmi(library)
        chips = dcmi.chips()
    except (AttributeError, DcmiError) as error:  # AttributeError: a library without one of the calls
        log.warning("NPU telemetry off: %s from %s: %s", error, library._name, off)
        return None
    log.info("NPU telemetry: %d NPU(s) through DCMI (%s): devices %s", len(chips), library._name,
             ", ".join(str(chip.logic_id) for chip in chips) or "none")
    return NpuTelemetryCollector(dcmi, chips)
