"""The NVML backend against the fake `pynvml` module: selection, reads, writes, every error path."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import pytest

from perseus.clock import VirtualClock
from perseus.devices.nvml import nvml_gpus, process_is_privileged
from perseus.devices.select import get_gpus
from perseus.exceptions import (
    ConfigError,
    DeviceError,
    DeviceNotFoundError,
    DeviceNotSupportedError,
    DevicePermissionError,
)
from perseus.testing import nvml_codes as fake
from perseus.testing.fake_nvml import FakeGPU, installed


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PERSEUS_GPU", raising=False)


def four_gpus() -> list[FakeGPU]:
    return [
        FakeGPU(uuid=u)
        for u in (
            "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
            "GPU-8932aaaa-0000-0000-0000-000000000001",
            "GPU-11112222-0000-0000-0000-000000000002",
            "GPU-33334444-0000-0000-0000-000000000003",
        )
    ]


# --- CUDA_VISIBLE_DEVICES -----------------------------------------------------------------


def uuids_of(gpus) -> list[str]:
    return [g.uuid() for g in gpus]


def test_unset_means_every_gpu_in_nvml_order():
    fakes = four_gpus()
    with installed(fakes):
        gpus = nvml_gpus()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert [g.nvml_index for g in gpus] == [0, 1, 2, 3]
    assert uuids_of(gpus) == [f.uuid for f in fakes]


def test_integer_indices_map_in_cuda_order(monkeypatch):
    fakes = four_gpus()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1")
    with installed(fakes):
        gpus = get_gpus("nvml")
    assert [g.index for g in gpus] == [0, 1]
    assert [g.nvml_index for g in gpus] == [3, 1]
    assert uuids_of(gpus) == [fakes[3].uuid, fakes[1].uuid]


def test_full_uuids_and_unique_prefixes_with_or_without_gpu_prefix():
    fakes = four_gpus()
    with installed(fakes):
        assert [g.nvml_index for g in nvml_gpus(fakes[2].uuid)] == [2]
        assert [g.nvml_index for g in nvml_gpus("GPU-3333,GPU-8932f")] == [3, 0]
        assert [g.nvml_index for g in nvml_gpus("8932F,gpu-8932a")] == [0, 1]
        # All digits is an index, as for CUDA, even where it is also a UUID prefix.
        with pytest.raises(ConfigError, match="names GPU 11112222"):
            nvml_gpus("11112222")


def test_ambiguous_unknown_and_malformed_uuids_are_config_errors():
    with installed(four_gpus()):
        with pytest.raises(ConfigError, match="matches 2 GPUs"):
            nvml_gpus("GPU-8932")
        with pytest.raises(ConfigError, match="no GPU has a UUID starting 'GPU-ffff'"):
            nvml_gpus("GPU-ffff")
        with pytest.raises(ConfigError, match="neither a GPU index nor a GPU UUID"):
            nvml_gpus("0,zero")
        with pytest.raises(ConfigError, match="neither a GPU index nor a GPU UUID"):
            nvml_gpus("0,,1")


def test_index_out_of_range_and_duplicates_are_config_errors():
    with installed(four_gpus()):
        with pytest.raises(ConfigError, match=r"names GPU 4, but NVML sees 4 GPU\(s\) \(indices 0 to 3\)"):
            nvml_gpus("0,4")
        with pytest.raises(ConfigError, match="lists GPU 'GPU-11112222' twice"):
            nvml_gpus("2,GPU-11112222")


def test_empty_cuda_visible_devices_hides_every_gpu():
    with installed(four_gpus()):
        for empty in ("", " "):
            with pytest.raises(DeviceNotFoundError, match="empty string, which hides every GPU"):
                nvml_gpus(empty)


def test_mig_instances_are_refused_with_the_reason():
    with installed(four_gpus()):
        with pytest.raises(DeviceNotSupportedError) as info:
            nvml_gpus("MIG-5c8a3c52-1c6f-5a6b-9f3e-0d7e2c1b9a11")
    message = str(info.value)
    assert "MIG instance" in message and "whole GPU" in message and "-mig 0" in message


def test_no_gpu_at_all():
    with installed([]):
        with pytest.raises(DeviceNotFoundError, match="found no NVIDIA GPU"):
            nvml_gpus()


# --- Reads --------------------------------------------------------------------------------


def test_reads_convert_nvml_units_and_sort_frequencies():
    gpu = FakeGPU(
        name="NVIDIA A40",
        power_mw=70_380,
        memory_clocks=[405, 7251, 5001],
        graphics_clocks=[210, 1740, 225, 1725],
        power_limit_range_mw=(100_000, 300_000),
        default_power_limit_mw=300_000,
    )
    with installed([gpu]):
        (g,) = nvml_gpus()
        assert g.name() == "NVIDIA A40"
        assert g.power_mw() == 70_380.0
        assert g.supported_frequencies() == [1740, 1725, 225, 210]
        assert g.max_frequency() == 1740
        assert g.power_limit_mw() == 300_000
        assert g.power_limit_range_mw() == (100_000, 300_000)
        assert g.default_power_limit_mw() == 300_000
        assert g.sm_clock() == gpu.idle_sm_clock


def test_graphics_clocks_are_read_at_the_highest_memory_clock():
    gpu = FakeGPU(memory_clocks=[405, 1215])
    with installed([gpu]) as nvml:
        (g,) = nvml_gpus()
        g.supported_frequencies()
        g.supported_frequencies()  # cached: one NVML query only
    assert nvml.calls["nvmlDeviceGetSupportedGraphicsClocks"] == 1
    # The fake raises NOT_FOUND for an unsupported memory clock, so only 1215 can have been asked.


def test_energy_counter_on_volta_and_newer_integrates_power_over_the_clock():
    clock = VirtualClock()
    gpu = FakeGPU(architecture=fake.NVML_DEVICE_ARCH_VOLTA, power_mw=100_000)
    with installed([gpu], clock=clock):
        (g,) = nvml_gpus()
        assert g.has_energy_counter()
        e0 = g.energy_mj()
        clock.advance(2.0)
        gpu.set_power(250_000)
        clock.advance(1.0)
        assert g.energy_mj() - e0 == pytest.approx(200_000 + 250_000)


def test_pre_volta_has_no_energy_counter_and_says_how_it_is_measured():
    with installed([FakeGPU(architecture=fake.NVML_DEVICE_ARCH_PASCAL)]):
        (g,) = nvml_gpus()
        assert not g.has_energy_counter()
        with pytest.raises(DeviceNotSupportedError, match="no energy counter.*sampling power"):
            g.energy_mj()


def test_unknown_architecture_falls_back_to_probing_the_counter():
    supported = FakeGPU(errors={"nvmlDeviceGetArchitecture": fake.NVML_ERROR_NOT_SUPPORTED})
    unsupported = FakeGPU(
        architecture=fake.NVML_DEVICE_ARCH_UNKNOWN,
        errors={"nvmlDeviceGetTotalEnergyConsumption": fake.NVML_ERROR_NOT_SUPPORTED},
    )
    with installed([supported, unsupported]):
        a, b = nvml_gpus()
        assert a.has_energy_counter()
        assert not b.has_energy_counter()


# --- Writes -------------------------------------------------------------------------------


def test_lock_reset_and_power_limit_reach_nvml():
    gpu = FakeGPU()
    with installed([gpu]):
        (g,) = nvml_gpus()
        g.lock_sm_clock(1005)
        assert gpu.locked_clocks == (1005, 1005)
        assert g.sm_clock() == 1005
        g.reset_sm_clock()
        assert gpu.locked_clocks is None
        g.set_power_limit_mw(250_000)
        assert g.power_limit_mw() == 250_000
        g.reset_power_limit()
        assert g.power_limit_mw() == 400_000


def test_unsupported_clock_and_out_of_range_power_limit_are_refused_before_nvml():
    gpu = FakeGPU()
    with installed([gpu]) as nvml:
        (g,) = nvml_gpus()
        with pytest.raises(ConfigError, match="1000 MHz.*nearest is 1005 MHz"):
            g.lock_sm_clock(1000)
        with pytest.raises(ConfigError, match="power limit 50 W is outside.*100 to 400 W"):
            g.set_power_limit_mw(50_000)
    assert "nvmlDeviceSetGpuLockedClocks" not in nvml.calls
    assert "nvmlDeviceSetPowerManagementLimit" not in nvml.calls


def test_can_change_clocks_is_a_read_only_privilege_check(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nCapEff:\t0000000000200000\n")  # CAP_SYS_ADMIN only
    assert process_is_privileged(euid=1000, status_path=str(status))
    status.write_text("Name:\tpython\nCapEff:\t0000000000000000\n")
    assert not process_is_privileged(euid=1000, status_path=str(status))
    assert process_is_privileged(euid=0, status_path=str(status))
    assert not process_is_privileged(euid=1000, status_path=str(tmp_path / "missing"))

    with installed([FakeGPU(), FakeGPU(architecture=fake.NVML_DEVICE_ARCH_PASCAL)]) as nvml:
        volta_plus, pascal = nvml_gpus()
        assert volta_plus.can_change_clocks() == process_is_privileged()
        assert not pascal.can_change_clocks()
    assert not [c for c in nvml.calls if "Set" in c or "Reset" in c]


def test_synchronize_waits_for_cuda_only_where_torch_drives_the_gpu(monkeypatch):
    """Perseus' one CUDA sync (the Monitor's too): never imports torch, skips a process that has
    not initialised CUDA, GPUs CUDA does not see, and a broken CUDA setup."""
    synced = []

    def fake_torch(initialized=True, count=1, broken=False):
        def is_initialized():
            if broken:
                raise RuntimeError("CUDA driver initialization failed")
            return initialized

        cuda = types.SimpleNamespace(
            is_initialized=is_initialized, device_count=lambda: count, synchronize=synced.append
        )
        return types.SimpleNamespace(cuda=cuda)

    with installed([FakeGPU(), FakeGPU()]):
        first, second = nvml_gpus()
        monkeypatch.delitem(sys.modules, "torch", raising=False)
        first.synchronize()
        assert "torch" not in sys.modules
        for torch, want in [
            (fake_torch(), [0]),
            (fake_torch(initialized=False), []),
            (fake_torch(broken=True), []),
        ]:
            synced.clear()
            monkeypatch.setitem(sys.modules, "torch", torch)
            first.synchronize()
            second.synchronize()  # CUDA sees one GPU here
            assert synced == want


# --- Errors -------------------------------------------------------------------------------


def test_no_permission_names_root_and_cap_sys_admin():
    gpu = FakeGPU(
        name="NVIDIA H100 80GB HBM3",
        errors={"nvmlDeviceSetGpuLockedClocks": fake.NVML_ERROR_NO_PERMISSION},
    )
    with installed([gpu]):
        (g,) = nvml_gpus()
        with pytest.raises(DevicePermissionError) as info:
            g.lock_sm_clock(1410)
    message = str(info.value)
    assert "nvmlDeviceSetGpuLockedClocks on GPU 0 (NVIDIA H100 80GB HBM3)" in message
    assert "root" in message and "CAP_SYS_ADMIN" in message and "sudo" in message


def test_not_supported_names_the_call_and_the_gpu():
    call = "nvmlDeviceGetPowerManagementLimitConstraints"
    gpu = FakeGPU(name="NVIDIA T4", errors={call: fake.NVML_ERROR_NOT_SUPPORTED})
    with installed([gpu]):
        (g,) = nvml_gpus()
        with pytest.raises(DeviceNotSupportedError, match=rf"GPU 0 \(NVIDIA T4\) does not support {call}"):
            g.power_limit_range_mw()


@pytest.mark.parametrize("code", [fake.NVML_ERROR_DRIVER_NOT_LOADED, fake.NVML_ERROR_LIBRARY_NOT_FOUND])
def test_no_driver_says_so_and_hints_at_the_simulator(code):
    with installed([FakeGPU()], errors={"nvmlInit": code}):
        with pytest.raises(DeviceNotFoundError) as info:
            get_gpus("nvml")
    assert "no NVIDIA driver found" in str(info.value)
    assert "PERSEUS_GPU=sim:a100-sxm" in str(info.value)


@pytest.mark.parametrize(
    "code, kind, words",
    [
        (fake.NVML_ERROR_FUNCTION_NOT_FOUND, DeviceNotSupportedError, "driver is too old"),
        (fake.NVML_ERROR_LIB_RM_VERSION_MISMATCH, DeviceNotFoundError, "reboot"),
        (fake.NVML_ERROR_GPU_IS_LOST, DeviceError, "needs a reset or a reboot"),
        (fake.NVML_ERROR_INVALID_ARGUMENT, DeviceError, "rejected the arguments"),
        (fake.NVML_ERROR_TIMEOUT, DeviceError, r"nvmlDeviceGetPowerUsage on GPU 0 .* failed: Timeout \(NVML code 10\)"),
    ],
)
def test_other_errors_are_perseus_errors_naming_the_call(code, kind, words):
    with installed([FakeGPU(errors={"nvmlDeviceGetPowerUsage": code})]):
        (g,) = nvml_gpus()
        with pytest.raises(kind, match=words) as info:
            g.power_mw()
    assert isinstance(info.value.__cause__, fake.NVMLError)


def test_unofficial_pynvml_package_is_refused(monkeypatch):
    unofficial = types.ModuleType("pynvml")
    unofficial.nvmlInit = lambda: None  # re-exported names, but no _nvmlGetFunctionPointer
    monkeypatch.setitem(sys.modules, "pynvml", unofficial)
    with pytest.raises(DeviceError, match=r"pip uninstall pynvml && pip install nvidia-ml-py"):
        nvml_gpus()


def test_missing_binding_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(DeviceNotFoundError, match="pip install nvidia-ml-py"):
        nvml_gpus()


def test_nvml_is_initialised_once_even_from_many_threads():
    with installed([FakeGPU(), FakeGPU()]) as nvml:
        threads = [threading.Thread(target=nvml_gpus) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        nvml_gpus()
    assert nvml.init_count == 1


# --- The fake itself ------------------------------------------------------------------------


def test_fake_mirrors_the_official_constants_and_exception_classes():
    real = pytest.importorskip("pynvml")
    if not hasattr(real, "_nvmlGetFunctionPointer"):
        pytest.skip("the installed pynvml is not nvidia-ml-py")
    with installed([FakeGPU()]):
        module = sys.modules["pynvml"]
    for name in dir(module):
        if name.startswith("NVML_"):
            assert getattr(module, name) == getattr(real, name), name
        if name.startswith("NVMLError_"):
            assert hasattr(real, name), name
            assert module.NVMLError(getattr(module, name)().value).__class__.__name__ == name
    assert {n for n in dir(real) if n.startswith("NVMLError_")} <= set(dir(module))
    for name in dir(module):
        if name.startswith("nvml"):
            assert hasattr(real, name), name


def test_fake_restores_the_previous_module_and_requires_init():
    before = sys.modules.get("pynvml")
    with installed([FakeGPU()]):
        import pynvml

        assert pynvml.PERSEUS_FAKE_NVML is not None
        with pytest.raises(pynvml.NVMLError_Uninitialized):
            pynvml.nvmlDeviceGetCount()
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(handle)) is handle
        (field,) = pynvml.nvmlDeviceGetFieldValues(handle, [(pynvml.NVML_FI_DEV_POWER_INSTANT, 0)])
        assert field.nvmlReturn == pynvml.NVML_SUCCESS and field.value.uiVal == 84_000
        with pytest.raises(pynvml.NVMLError) as info:
            pynvml.nvmlDeviceGetHandleByIndex(5)
        assert info.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert sys.modules.get("pynvml") is before


ZEUS_ON_FAKE = """
import logging, os
from perseus.clock import VirtualClock
from perseus.testing.fake_nvml import FakeGPU, installed
clock = VirtualClock()
with installed([FakeGPU(), FakeGPU(power_mw=200_000)], clock=clock):
    from zeus.monitor import ZeusMonitor  # binds `pynvml` at import: inside the block
    logging.getLogger("zeus").setLevel(logging.ERROR)
    monitor = ZeusMonitor(cpu_indices=[])
    monitor.begin_window("w", sync_execution=False)
    clock.advance(2.0)
    print(monitor.end_window("w", sync_execution=False).gpu_energy)
"""


def test_zeus_monitor_runs_on_the_fake():
    """The benchmarks compare against zeus on this fake. A subprocess, because zeus caches its
    NVML binding and GPUs in globals; importing zeus takes a few seconds (skipped without it)."""
    pytest.importorskip("zeus")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run([sys.executable, "-c", ZEUS_ON_FAKE], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "{0: 168.0, 1: 400.0}"
