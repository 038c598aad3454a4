"""The AMD backend against the fake `amdsmi` module: selection, reads, writes, quirks, every error path."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import threading
import types

import pytest

from perseus.clock import VirtualClock
from perseus.devices import amd, amd_counter_check, amd_smi
from perseus.devices.amd import AMDGPU, _mhz, amd_gpus, clock_grid
from perseus.devices.amd_smi import call
from perseus.devices.select import get_gpus, gpu_backend
from perseus.exceptions import (
    ConfigError,
    DeviceError,
    DeviceNotFoundError,
    DeviceNotSupportedError,
    DevicePermissionError,
)
from perseus.measurement import Monitor
from perseus.safety.watchdog import backend_of
from perseus.testing import amdsmi_codes as codes
from perseus.testing.fake_amdsmi import FakeAMDGPU, installed, unimportable

MI300X_CLOCKS = list(range(2100, 500, -20))


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for var in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "PERSEUS_GPU"):
        monkeypatch.delenv(var, raising=False)


def select(fakes, environ=None, clock=None, **kwargs):
    """amd_gpus() over `fakes`: (the GPUs, the fake's state, the clock)."""
    clock = clock or VirtualClock()
    with installed(fakes, clock=clock, **kwargs) as smi:
        gpus = amd_gpus(environ or {}, clock=clock)
    return gpus, smi, clock


def positions(gpus):
    return [g.amdsmi_index for g in gpus]


# --- Which GPUs -------------------------------------------------------------------------------


def test_every_gpu_in_hip_order():
    fakes = [FakeAMDGPU(hip_id=h) for h in (2, 0, 3, 1)]
    gpus, _, _ = select(fakes)
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert positions(gpus) == [1, 3, 0, 2]  # amdsmi's positions, sorted by hip_id
    assert [g.uuid() for g in gpus] == [fakes[p].uuid for p in (1, 3, 0, 2)]
    assert repr(gpus[0]) == "<AMDGPU 0: AMD Instinct MI300X>"


def test_without_enumeration_info_amdsmis_order_is_kept():
    gpus, _, _ = select([FakeAMDGPU(hip_id=h) for h in (2, 0, 3, 1)], enumeration_info=False)
    assert positions(gpus) == [0, 1, 2, 3]


def test_rocr_then_hip_visible_devices_narrow_in_turn():
    fakes = [FakeAMDGPU() for _ in range(4)]
    env = {"ROCR_VISIBLE_DEVICES": "3,1,0", "HIP_VISIBLE_DEVICES": "2, 0"}
    gpus, _, _ = select(fakes, env)
    assert [g.index for g in gpus] == [0, 1]
    assert positions(gpus) == [0, 3]  # HIP's 2 and 0 among ROCr's [3, 1, 0]


def test_cuda_visible_devices_counts_where_hip_visible_devices_is_unset():
    fakes = [FakeAMDGPU() for _ in range(4)]
    assert positions(select(fakes, {"CUDA_VISIBLE_DEVICES": "2,3"})[0]) == [2, 3]
    both = {"CUDA_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "1"}
    assert positions(select([FakeAMDGPU() for _ in range(4)], both)[0]) == [1]


def test_uuids_rocm_style_amdsmi_style_and_unique_prefixes():
    fakes = [FakeAMDGPU() for _ in range(3)]
    gpus, _, _ = select(fakes)
    rocm = [f"GPU-{int(f.asic_serial, 16):016x}" for f in fakes]  # as rocminfo prints them
    assert positions(select([FakeAMDGPU() for _ in range(3)], {"ROCR_VISIBLE_DEVICES": rocm[2]})[0]) == [2]
    env = {"HIP_VISIBLE_DEVICES": f"{fakes[1].uuid},{rocm[0].upper()}"}
    assert positions(select([FakeAMDGPU() for _ in range(3)], env)[0]) == [1, 0]
    prefix = {"ROCR_VISIBLE_DEVICES": "02ff"}  # a unique prefix of fake 2's amdsmi UUID
    assert positions(select([FakeAMDGPU() for _ in range(3)], prefix)[0]) == [2]


@pytest.mark.parametrize(
    "env, error, message",
    [
        ({"ROCR_VISIBLE_DEVICES": "4"}, ConfigError, "names GPU 4, but 4 GPU"),
        ({"ROCR_VISIBLE_DEVICES": "1,2", "HIP_VISIBLE_DEVICES": "2"}, ConfigError, "names GPU 2, but 2 GPU"),
        ({"HIP_VISIBLE_DEVICES": "1,1"}, ConfigError, "lists GPU '1' twice"),
        ({"HIP_VISIBLE_DEVICES": "gpu-zz"}, ConfigError, "neither a GPU index nor a GPU UUID"),
        ({"HIP_VISIBLE_DEVICES": "GPU-4cc6d2e8d2a9b1"}, ConfigError, "matches 4 GPUs"),
        ({"HIP_VISIBLE_DEVICES": "GPU-ffff"}, ConfigError, "no GPU has a UUID starting 'GPU-ffff'"),
        ({"ROCR_VISIBLE_DEVICES": ""}, DeviceNotFoundError, "ROCR_VISIBLE_DEVICES is set to an empty string"),
        ({"HIP_VISIBLE_DEVICES": " "}, DeviceNotFoundError, "HIP_VISIBLE_DEVICES is set to an empty string"),
    ],
)
def test_bad_visible_devices_are_clear_errors(env, error, message):
    with pytest.raises(error, match=re.escape(message)):
        select([FakeAMDGPU() for _ in range(4)], env)


def test_no_gpu_at_all_says_how_to_simulate_one():
    with pytest.raises(DeviceNotFoundError, match="amdsmi found no AMD GPU.*sim:mi300x"):
        select([])


def test_perseus_gpu_amd_selects_them_with_the_process_environment(monkeypatch):
    monkeypatch.setenv("PERSEUS_GPU", "amd")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    with installed([FakeAMDGPU(), FakeAMDGPU()]):
        (gpu,) = get_gpus()
    assert isinstance(gpu, AMDGPU) and gpu.amdsmi_index == 1
    assert gpu_backend([gpu]) == "amd"
    assert backend_of([gpu]) == ("amd", {})  # the watchdog finds them again through the same backend


def test_auto_detection_takes_amd_gpus_only_where_nvml_finds_no_nvidia_gpu(caplog):
    from perseus.testing import fake_nvml
    from perseus.testing.nvml_codes import NVML_ERROR_DRIVER_NOT_LOADED

    no_driver = {"nvmlInit": NVML_ERROR_DRIVER_NOT_LOADED}
    with fake_nvml.installed([], errors=no_driver), installed([FakeAMDGPU(), FakeAMDGPU()]):
        with caplog.at_level(logging.INFO, logger="perseus.devices.select"):
            gpus = get_gpus()
        assert [type(g) for g in gpus] == [AMDGPU, AMDGPU]
        assert "using the 2 AMD GPU(s) amdsmi found" in caplog.text
        with pytest.raises(DeviceNotFoundError, match="no NVIDIA driver"):
            get_gpus("nvml")  # explicit: no fallback
    with fake_nvml.installed([fake_nvml.FakeGPU()]), installed([FakeAMDGPU()]):
        assert gpu_backend(get_gpus("auto")) == "nvml"  # NVIDIA first
    with fake_nvml.installed([], errors=no_driver), unimportable(ImportError("No module named 'amdsmi'")):
        with pytest.raises(DeviceNotFoundError, match="NVIDIA: no NVIDIA driver.*AMD: cannot import amdsmi"):
            get_gpus()


# --- Reads ------------------------------------------------------------------------------------


def test_reads_convert_amdsmi_units():
    (gpu,), smi, _ = select([FakeAMDGPU(power_w=312)])
    assert gpu.name() == "AMD Instinct MI300X"
    assert gpu.uuid() == smi.gpus[0].uuid
    assert gpu.power_mw() == 312_000.0
    assert gpu.power_limit_mw() == 750_000  # from uW
    assert gpu.power_limit_range_mw() == (200_000, 750_000)
    assert gpu.default_power_limit_mw() == 750_000
    assert gpu.clock_limits() == (500, 2100)  # OD_RANGE, reported in Hz
    assert gpu.supported_frequencies() == MI300X_CLOCKS  # 20 MHz steps above the 500 MHz floor
    assert gpu.max_frequency() == 2100
    assert gpu.sm_clock() == 2100
    gpu.supported_frequencies()
    assert smi.calls["amdsmi_get_gpu_od_volt_info"] == 1  # read once
    assert not smi.writes


def test_name_falls_back_to_the_board_product_name():
    (gpu,), _, _ = select([FakeAMDGPU(market_name="N/A", product_name="AMD Instinct MI250X")])
    assert gpu.name() == "AMD Instinct MI250X"
    unsupported = {"amdsmi_get_gpu_asic_info": codes.AMDSMI_STATUS_NOT_SUPPORTED}
    unsupported["amdsmi_get_gpu_board_info"] = codes.AMDSMI_STATUS_NOT_SUPPORTED
    (gpu,), _, _ = select([FakeAMDGPU(errors=unsupported)])
    assert gpu.name() == "AMD GPU"


def test_power_is_the_field_the_part_reports():
    (mi250x,), _, _ = select([FakeAMDGPU(power_key="average_socket_power", power_w=230)])
    assert mi250x.power_mw() == 230_000.0
    (none,), _, _ = select([FakeAMDGPU(power_key="none")])
    with pytest.raises(DeviceNotSupportedError, match="reports no power"):
        none.power_mw()


def test_clock_range_falls_back_to_the_dpm_levels():
    no_od = {"amdsmi_get_gpu_od_volt_info": codes.AMDSMI_STATUS_NOT_SUPPORTED}
    (gpu,), smi, _ = select([FakeAMDGPU(sclk_range_mhz=(500, 1700), errors=no_od)])
    assert gpu.clock_limits() == (500, 1700)
    assert gpu.supported_frequencies() == list(range(1700, 500, -20))
    assert smi.calls["amdsmi_get_clk_freq"] == 1
    both = dict(no_od, amdsmi_get_clk_freq=codes.AMDSMI_STATUS_NOT_SUPPORTED)
    (gpu,), _, _ = select([FakeAMDGPU(errors=both)])
    with pytest.raises(DeviceNotSupportedError, match="amdsmi_get_clk_freq"):
        gpu.supported_frequencies()


def test_units_and_grid_helpers():
    assert _mhz(2_100_000_000) == 2100 and _mhz(2100) == 2100 and _mhz(1_700_000_000.0) == 1700
    assert _mhz("N/A") is None and _mhz(0) is None and _mhz(2**64 - 1) is None and _mhz(True) is None
    assert clock_grid(500, 560) == [560, 540, 520]  # never the floor itself
    assert clock_grid(500, 510) == [510]


def test_sm_clock_is_what_the_gpu_runs_at_now():
    (gpu,), _, _ = select([FakeAMDGPU(load_clock_mhz=800)])
    assert gpu.sm_clock() == 800  # idle-ish: below the cap
    (gpu,), _, _ = select([FakeAMDGPU(errors={"amdsmi_get_clock_info": codes.AMDSMI_STATUS_NOT_SUPPORTED})])
    with pytest.raises(DeviceNotSupportedError, match="amdsmi_get_clock_info"):
        gpu.sm_clock()


def test_unusable_power_cap_range_is_not_supported():
    (gpu,), _, _ = select([FakeAMDGPU(power_cap_range_uw=(0, 0))])
    with pytest.raises(DeviceNotSupportedError, match="no usable power cap range"):
        gpu.power_limit_range_mw()


# --- Energy counter ---------------------------------------------------------------------------


def test_energy_counter_passes_the_check_and_integrates_power():
    (gpu,), smi, clock = select([FakeAMDGPU(power_w=300)])
    assert gpu.has_energy_counter()
    assert clock.now() == pytest.approx(amd_counter_check.ENERGY_CHECK_S)  # the check waited once
    before = gpu.energy_mj()
    clock.advance(10.0)
    assert gpu.energy_mj() - before == pytest.approx(3_000_000, abs=0.02)  # 300 W x 10 s, 15.3 uJ counts
    assert gpu.has_energy_counter()
    assert clock.now() == pytest.approx(10.0 + amd_counter_check.ENERGY_CHECK_S)  # and only once


def test_energy_before_amdsmi_6_2_1_is_under_the_key_power():
    (gpu,), _, clock = select([FakeAMDGPU(power_w=100)], energy_key="power")
    before = gpu.energy_mj()
    clock.advance(1.0)
    assert gpu.energy_mj() - before == pytest.approx(100_000, abs=0.02)


def test_the_check_runs_once_for_every_gpu_of_a_selection():
    gpus, _, clock = select([FakeAMDGPU(power_w=w) for w in (100, 200, 300, 400)])
    assert gpus[2].has_energy_counter()
    assert clock.now() == pytest.approx(amd_counter_check.ENERGY_CHECK_S)
    assert all(g.has_energy_counter() for g in gpus)
    assert clock.now() == pytest.approx(amd_counter_check.ENERGY_CHECK_S)


@pytest.mark.parametrize("rate, shown", [(2.0, "2.00x"), (0.5, "0.50x"), (0.0, "0.00x")])
def test_a_counter_at_the_wrong_rate_is_not_used_and_the_monitor_samples_power(caplog, rate, shown):
    fakes = [FakeAMDGPU(power_w=200), FakeAMDGPU(power_w=200, counter_rate=rate)]
    (good, bad), _, clock = select(fakes)
    with caplog.at_level(logging.WARNING, logger="perseus.devices.amd_counter_check"):
        assert good.has_energy_counter() and not bad.has_energy_counter()
    assert shown in caplog.text and "ROCm/amdsmi#38" in caplog.text and "GPU 1" in caplog.text
    with pytest.raises(DeviceNotSupportedError, match="sampling power"):
        bad.energy_mj()
    with Monitor(gpus=[good, bad], cpus=[], clock=clock) as monitor:
        assert monitor.power_monitor is not None and monitor.power_monitor.gpu_indices == [1]
        monitor.begin_window("step")
        clock.advance(2.0)
        m = monitor.end_window("step")
    assert m.gpu_energy_j[0] == pytest.approx(400.0, abs=1e-4)
    assert m.gpu_energy_j[1] == pytest.approx(400.0)  # from power samples, not the 2x counter


def test_an_mi250x_second_gcd_reports_neither_power_nor_energy(caplog):
    fakes = [
        FakeAMDGPU(market_name="AMD Instinct MI250X", power_key="average_socket_power", power_w=300),
        FakeAMDGPU(market_name="AMD Instinct MI250X", power_key="average_socket_power", power_w=0),
    ]
    (first, second), _, _ = select(fakes)
    with caplog.at_level(logging.WARNING, logger="perseus.devices.amd_counter_check"):
        assert first.has_energy_counter()
        assert not second.has_energy_counter()
    assert "neither power nor energy" in caplog.text and "measure GPU 0" in caplog.text


def test_a_counter_without_power_to_check_it_against_is_used_if_it_moves(caplog):
    (gpu,), _, _ = select([FakeAMDGPU(power_key="none", power_w=200)])
    assert gpu.has_energy_counter()
    (gpu,), _, _ = select([FakeAMDGPU(power_key="none", counter_rate=0.0)])
    assert not gpu.has_energy_counter()
    no_counter = {"amdsmi_get_energy_count": codes.AMDSMI_STATUS_NOT_SUPPORTED}
    (gpu,), _, _ = select([FakeAMDGPU(errors=no_counter)])
    assert not gpu.has_energy_counter()


def test_a_32_bit_counter_wraps_and_the_energy_goes_on():
    start = 2**32 - 10_000  # 0.153 J before the wrap
    (gpu,), smi, clock = select([FakeAMDGPU(power_w=500, counter_bits=32, counter_start=start)])
    before = gpu.energy_mj()
    clock.advance(1.0)
    assert smi.gpus[0].count() < start  # the raw counter wrapped
    assert gpu.energy_mj() - before == pytest.approx(500_000, abs=0.02)


def test_reads_far_apart_on_a_32_bit_sized_counter_warn_that_wraps_may_be_missed(caplog):
    (gpu,), _, clock = select([FakeAMDGPU(power_w=500, counter_bits=32)])
    gpu.energy_mj()
    with caplog.at_level(logging.WARNING, logger="perseus.devices.amd"):
        clock.advance(60.0)
        gpu.energy_mj()
        assert not caplog.text  # 60 s x 750 W < 65.7 kJ: no wrap could be missed
        clock.advance(200.0)
        gpu.energy_mj()
    assert "100 kJ were drawn in the 200 s" in caplog.text and "wraps between reads are missed" in caplog.text
    caplog.clear()
    (idle,), _, clock = select([FakeAMDGPU(power_w=100)])  # 64 bits, but still below 2**32
    (past,), _, _ = select([FakeAMDGPU(counter_start=2**40)], clock=clock)
    for gpu in (idle, past):
        gpu.energy_mj()
    clock.advance(200.0)  # 20 kJ at 100 W: no wrap's worth
    idle.energy_mj()
    clock.advance(1000.0)
    past.energy_mj()  # past 2**32: never a 32-bit counter
    assert not caplog.text


def test_a_stale_read_is_held_and_a_restart_continues(caplog):
    (gpu,), smi, clock = select([FakeAMDGPU(power_w=100)])
    fake_gpu = smi.gpus[0]
    first = gpu.energy_mj()
    fake_gpu.counter_start -= 100  # the next read is 100 counts behind the last one
    assert gpu.energy_mj() == first
    fake_gpu.counter_start += 100
    clock.advance(1.0)
    second = gpu.energy_mj()
    assert second - first == pytest.approx(100_000, abs=0.02)
    fake_gpu.counter_start -= fake_gpu.count() - 50  # a GPU reset: it starts again from 50
    with caplog.at_level(logging.WARNING, logger="perseus.devices.amd"):
        assert gpu.energy_mj() >= second
    assert "restarted" in caplog.text
    clock.advance(1.0)
    assert gpu.energy_mj() - second == pytest.approx(100_000, abs=0.02)


# --- Writes -----------------------------------------------------------------------------------


def test_lock_caps_the_gfx_clock_and_reset_hands_it_back_to_the_driver():
    (gpu,), smi, _ = select([FakeAMDGPU()])
    fake_gpu = smi.gpus[0]
    gpu.lock_sm_clock(1500)
    assert smi.writes == [("amdsmi_set_gpu_clk_range", 0, (500, 1500, codes.AmdSmiClkType.GFX))]
    assert fake_gpu.soft_range_mhz == (500, 1500) and fake_gpu.perf_level == codes.AmdSmiDevPerfLevel.MANUAL
    assert gpu.sm_clock() == 1500  # busy: at the cap
    smi.writes.clear()
    gpu.reset_sm_clock()
    assert smi.writes == [
        ("amdsmi_set_gpu_clk_range", 0, (500, 2100, codes.AmdSmiClkType.GFX)),
        ("amdsmi_set_gpu_perf_level", 0, (codes.AmdSmiDevPerfLevel.AUTO,)),
    ]
    assert fake_gpu.perf_level == codes.AmdSmiDevPerfLevel.AUTO and gpu.sm_clock() == 2100
    gpu.lock_sm_clock(520)  # the lowest cap: still above the floor, as ROCm SMI needs
    assert fake_gpu.soft_range_mhz == (500, 520)


def test_a_cap_is_a_ceiling_not_a_fixed_clock():
    (gpu,), _, _ = select([FakeAMDGPU(load_clock_mhz=800)])
    gpu.lock_sm_clock(1500)
    assert gpu.sm_clock() == 800
    gpu.lock_sm_clock(700)
    assert gpu.sm_clock() == 700


@pytest.mark.parametrize("mhz, nearest", [(1510, "nearest is 1500 MHz"), (500, "nearest is 520 MHz"), (2200, "2100")])
def test_an_unsupported_clock_is_refused_before_amdsmi(mhz, nearest):
    (gpu,), smi, _ = select([FakeAMDGPU()])
    with pytest.raises(ConfigError, match=f"cap of {mhz} MHz.*520 to 2100 MHz in 20 MHz steps.*{nearest}"):
        gpu.lock_sm_clock(mhz)
    assert not smi.writes


def test_power_cap_set_reset_and_range():
    (gpu,), smi, _ = select([FakeAMDGPU()])
    gpu.set_power_limit_mw(500_000)
    assert smi.writes == [("amdsmi_set_power_cap", 0, (0, 500_000_000))]  # sensor 0, uW
    assert gpu.power_limit_mw() == 500_000
    gpu.reset_power_limit()
    assert smi.writes[-1] == ("amdsmi_set_power_cap", 0, (0, 750_000_000))
    assert gpu.power_limit_mw() == 750_000
    smi.writes.clear()
    with pytest.raises(ConfigError, match="outside the range this GPU accepts, 200 to 750 W"):
        gpu.set_power_limit_mw(100_000)
    assert not smi.writes


def test_can_change_clocks_checks_amdgpus_files_without_changing_anything(tmp_path, monkeypatch):
    (gpu,), smi, _ = select([FakeAMDGPU(bdf="0000:0C:00.0")])
    device = tmp_path / "0000:0c:00.0"
    (device / "hwmon" / "hwmon3").mkdir(parents=True)
    files = [device / "power_dpm_force_performance_level", device / "pp_od_clk_voltage"]
    files.append(device / "hwmon" / "hwmon3" / "power1_cap")
    for f in files:
        f.write_text("auto\n")
    monkeypatch.setattr(amd, "SYSFS_PCI", str(tmp_path))
    assert gpu.can_change_clocks()
    if os.geteuid() != 0:  # root may write whatever the mode says
        files[2].chmod(0o444)
        assert not gpu.can_change_clocks()
    monkeypatch.setattr(amd, "SYSFS_PCI", str(tmp_path / "none"))  # no sysfs (a container): root or not
    assert gpu.can_change_clocks() == (os.geteuid() == 0)
    assert not smi.writes


def test_synchronize_waits_for_torch_only_where_it_drives_the_gpu(monkeypatch):
    synced = []

    def fake_torch(initialized=True, count=1, broken=False):
        def is_initialized():
            if broken:
                raise RuntimeError("HIP driver initialization failed")
            return initialized

        return types.SimpleNamespace(
            cuda=types.SimpleNamespace(
                is_initialized=is_initialized, device_count=lambda: count, synchronize=synced.append
            )
        )

    (first, second), _, _ = select([FakeAMDGPU(), FakeAMDGPU()])
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    first.synchronize()
    assert "torch" not in sys.modules
    for torch, want in [(fake_torch(), [0]), (fake_torch(initialized=False), []), (fake_torch(broken=True), [])]:
        synced.clear()
        monkeypatch.setitem(sys.modules, "torch", torch)
        first.synchronize()
        second.synchronize()  # torch sees one GPU here
        assert synced == want


# --- Errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, args, failing",
    [
        ("lock_sm_clock", (1500,), "amdsmi_set_gpu_clk_range"),
        ("reset_sm_clock", (), "amdsmi_set_gpu_perf_level"),
        ("set_power_limit_mw", (500_000,), "amdsmi_set_power_cap"),
        ("reset_power_limit", (), "amdsmi_set_power_cap"),
    ],
)
def test_no_permission_names_root_and_the_files(method, args, failing):
    (gpu,), _, _ = select([FakeAMDGPU(errors={failing: codes.AMDSMI_STATUS_NO_PERM})])
    with pytest.raises(DevicePermissionError) as info:
        getattr(gpu, method)(*args)
    message = str(info.value)
    assert failing in message and "GPU 0 (AMD Instinct MI300X)" in message
    assert "root" in message and "udev" in message and "--privileged" in message


def test_not_supported_names_the_call_the_gpu_and_for_setters_the_vm_guest():
    errors = {"amdsmi_get_power_cap_info": codes.AMDSMI_STATUS_NOT_SUPPORTED}
    errors["amdsmi_set_power_cap"] = codes.AMDSMI_STATUS_NOT_SUPPORTED
    (gpu,), _, _ = select([FakeAMDGPU(errors=errors)])
    with pytest.raises(DeviceNotSupportedError, match=r"GPU 0 \(AMD Instinct MI300X\) does not support amdsmi_get"):
        gpu.power_limit_mw()
    with pytest.raises(DeviceNotSupportedError) as info:
        call(gpu._amdsmi, "amdsmi_set_power_cap", gpu._handle, 0, 1, where="GPU 0")
    assert "virtual machine guest" in str(info.value)


@pytest.mark.parametrize(
    "code",
    [
        codes.AMDSMI_STATUS_DRIVER_NOT_LOADED,
        codes.AMDSMI_STATUS_NO_DRV,
        codes.AMDSMI_STATUS_FAIL_LOAD_MODULE,
        codes.AMDSMI_STATUS_INIT_ERROR,
    ],
)
def test_no_driver_says_so_and_hints_at_the_simulator(code):
    with pytest.raises(DeviceNotFoundError, match="no AMD GPU driver found.*modprobe amdgpu.*sim:mi300x"):
        select([FakeAMDGPU()], errors={"amdsmi_init": code})


@pytest.mark.parametrize(
    "code, kind, words",
    [
        (codes.AMDSMI_STATUS_FAIL_LOAD_SYMBOL, DeviceError, "does not match the installed ROCm"),
        (codes.AMDSMI_STATUS_NOT_FOUND, DeviceNotFoundError, "the GPU is gone"),
        (codes.AMDSMI_STATUS_BUSY, DeviceError, "try again"),
        (codes.AMDSMI_STATUS_RETRY, DeviceError, "try again"),
        (codes.AMDSMI_STATUS_TIMEOUT, DeviceError, "try again"),
        (codes.AMDSMI_STATUS_INVAL, DeviceError, "rejected the arguments"),
        (codes.AMDSMI_STATUS_INPUT_OUT_OF_BOUNDS, DeviceError, "rejected the arguments"),
        (codes.AMDSMI_STATUS_IO, DeviceError, "amdsmi status 12"),
    ],
)
def test_other_errors_are_perseus_errors_naming_the_call(code, kind, words):
    (gpu,), _, _ = select([FakeAMDGPU(errors={"amdsmi_get_power_info": code})])
    with pytest.raises(kind, match=f"amdsmi_get_power_info on GPU 0 .*{words}"):
        gpu.power_mw()


def test_a_wrong_argument_and_a_missing_function_are_clear_errors():
    (gpu,), _, _ = select([FakeAMDGPU()], enumeration_info=False)
    with pytest.raises(DeviceError, match="amdsmi_get_clock_info refused its arguments"):
        call(gpu._amdsmi, "amdsmi_get_clock_info", gpu._handle, "GFX")
    with pytest.raises(DeviceNotSupportedError, match="the installed amdsmi has no amdsmi_get_gpu_enumeration_info"):
        call(gpu._amdsmi, "amdsmi_get_gpu_enumeration_info", gpu._handle)


def test_amdsmi_missing_or_without_its_library_says_what_to_install():
    with unimportable(ImportError("No module named 'amdsmi'")):
        with pytest.raises(DeviceNotFoundError, match=r"cannot import amdsmi.*perseus-energy\[amd\].*sim:mi300x"):
            amd_gpus({})
    with unimportable(OSError("Could not load libamd_smi.so")):
        with pytest.raises(DeviceNotFoundError, match="cannot load AMD SMI's library.*ROCM_PATH"):
            amd_gpus({})


def test_amdsmi_is_initialised_once_even_from_many_threads():
    with installed([FakeAMDGPU()]) as smi:
        threads = [threading.Thread(target=amd_gpus, args=({},)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert smi.init_count == 1


def test_the_fake_requires_init_and_restores_the_previous_module():
    sentinel = types.ModuleType("amdsmi")
    sys.modules["amdsmi"] = sentinel
    try:
        with installed([FakeAMDGPU()]) as smi:
            module = sys.modules["amdsmi"]
            with pytest.raises(module.AmdSmiLibraryException) as info:
                module.amdsmi_get_processor_handles()
            assert info.value.get_error_code() == codes.AMDSMI_STATUS_NOT_INIT
            with pytest.raises(module.AmdSmiParameterException):
                module.amdsmi_init(2)  # a plain int, not AmdSmiInitFlags
            assert smi.init_count == 0
        assert sys.modules["amdsmi"] is sentinel
    finally:
        sys.modules.pop("amdsmi", None)


def test_the_backend_and_the_fake_agree_on_status_codes():
    for name, code in vars(amd_smi).items():
        if name.startswith("STATUS_"):
            assert codes.STATUS[f"AMDSMI_{name}"] == code, name


def test_the_fake_mirrors_the_installed_amdsmi_package():
    """Where amdsmi is installed (its import may fail without ROCm's library, so its source is read):
    every name the fake exports and every constant value it uses is the real package's."""
    spec = importlib.util.find_spec("amdsmi") if "amdsmi" not in sys.modules else None
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the amdsmi package is not installed")
    folder = spec.submodule_search_locations[0]

    def source(name):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            return f.read()

    exported = set(re.findall(r"^\s*from \.\w+ import (\w+)", source("__init__.py"), re.M))
    with installed([]):
        module = sys.modules["amdsmi"]
        names = {n for n in vars(module) if n.startswith(("amdsmi_", "AmdSmi"))} - {"amdsmi_wrapper"}
    assert names <= exported, names - exported
    assert os.path.exists(os.path.join(folder, "amdsmi_wrapper.py"))  # the submodule the fake's wrapper mirrors
    wrapper = dict(re.findall(r"^(AMDSMI_\w+|CLK_LIMIT_\w+) = (\d+)$", source("amdsmi_wrapper.py"), re.M))
    for name, code in codes.STATUS.items():
        assert int(wrapper[name]) == code, name
    assert int(wrapper["AMDSMI_INIT_AMD_GPUS"]) == codes.AmdSmiInitFlags.INIT_AMD_GPUS
    assert int(wrapper["AMDSMI_CLK_TYPE_GFX"]) == codes.AmdSmiClkType.GFX
    assert int(wrapper["AMDSMI_DEV_PERF_LEVEL_AUTO"]) == codes.AmdSmiDevPerfLevel.AUTO
    assert int(wrapper["AMDSMI_DEV_PERF_LEVEL_MANUAL"]) == codes.AmdSmiDevPerfLevel.MANUAL
    interface = source("amdsmi_interface.py")
    for key in ("energy_accumulator", "counter_resolution", "current_socket_power", "average_socket_power"):
        assert f'"{key}"' in interface or f"'{key}'" in interface, key
    for key in ("sclk_freq_limits", "min_power_cap", "max_power_cap", "default_power_cap", "hip_id", "asic_serial"):
        assert f'"{key}"' in interface, key
