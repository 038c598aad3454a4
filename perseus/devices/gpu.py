"""The one GPU interface every part of Perseus uses, whatever the backend."""

from __future__ import annotations

import abc

from perseus.clock import REAL_CLOCK, Clock
from perseus.devices.instruction_timer import HostTimer, InstructionTimer, torch_cuda
from perseus.exceptions import ConfigError


class GPU(abc.ABC):
    """One GPU. Units: energy mJ, power mW, frequency MHz (SM clock)."""

    #: Index of this GPU within its selection (the CUDA index the user sees).
    index: int

    @property
    def clock(self) -> Clock:
        """The clock this GPU's counters advance with (virtual for simulated GPUs in tests)."""
        return REAL_CLOCK

    # Reads
    @abc.abstractmethod
    def name(self) -> str: ...

    @abc.abstractmethod
    def uuid(self) -> str: ...

    @abc.abstractmethod
    def has_energy_counter(self) -> bool: ...

    @abc.abstractmethod
    def energy_mj(self) -> float:
        """Total energy counter since an arbitrary origin; never decreases."""

    @abc.abstractmethod
    def power_mw(self) -> float: ...

    @abc.abstractmethod
    def supported_frequencies(self) -> list[int]:
        """Supported SM clocks (MHz) at the highest memory clock, highest first."""

    @abc.abstractmethod
    def sm_clock(self) -> int:
        """Current SM clock (MHz)."""

    @abc.abstractmethod
    def power_limit_mw(self) -> int: ...

    @abc.abstractmethod
    def power_limit_range_mw(self) -> tuple[int, int]:
        """(min, max) settable power limit."""

    @abc.abstractmethod
    def default_power_limit_mw(self) -> int: ...

    # Writes
    @abc.abstractmethod
    def lock_sm_clock(self, mhz: int) -> None:
        """Lock the SM clock to one frequency (must be a supported one)."""

    @abc.abstractmethod
    def reset_sm_clock(self) -> None: ...

    @abc.abstractmethod
    def set_power_limit_mw(self, mw: int) -> None: ...

    @abc.abstractmethod
    def reset_power_limit(self) -> None: ...

    def energy_counter_period_s(self) -> float:
        """How often the energy counter steps, before `perseus probe` measured it: NVML's
        total-energy counter steps about every 100 ms on the data-centre GPUs probed so far."""
        return 0.1

    def can_change_clocks(self) -> bool:
        """Whether this process may lock clocks and set power limits."""
        return True

    def agent_restores_on_exit(self) -> bool:
        """Whether the node's perseus agent restores this GPU's defaults when this process ends
        (its writes go through the agent's lease), so it needs no watchdog process of its own."""
        return False

    def synchronize(self) -> None:
        """Wait until work already issued to this GPU has finished (so counters include it).

        Not abstract: the default, for a GPU with nothing queued behind its counters, returns at once."""
        return None

    def instruction_timer(self) -> InstructionTimer:
        """How a rank times this GPU's instructions (perseus.devices.instruction_timer). The
        default synchronises and reads `clock` per mark: exact for a GPU whose work runs on that
        clock (a simulated one); GPUs that torch may drive return a `DeviceTimer`."""
        return HostTimer(self)

    def max_frequency(self) -> int:
        return self.supported_frequencies()[0]

    def check_power_limit_mw(self, mw: int) -> int:
        """`mw` as an int if this GPU accepts it as a power limit; else ConfigError naming the range."""
        low, high = self.power_limit_range_mw()
        if not low <= mw <= high:
            raise ConfigError(
                f"{self!r}: power limit {mw / 1000:g} W is outside the range this GPU accepts, "
                f"{low / 1000:g} to {high / 1000:g} W; choose a limit between {low / 1000:g} and {high / 1000:g} W"
            )
        return int(mw)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.index}: {self.name()}>"


def torch_synchronize(index: int) -> None:
    """Wait for GPU `index`'s queued work when torch drives it: Perseus' one device sync, for
    NVIDIA (CUDA) and AMD (ROCm's torch, which exposes HIP as `torch.cuda`) alike. Without an
    imported torch that drives it (see `torch_cuda`), nothing is queued."""
    cuda = torch_cuda(index)
    if cuda is not None:
        cuda.synchronize(index)
