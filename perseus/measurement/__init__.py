"""Energy measurement: the window Monitor and the background PowerMonitor."""

from perseus.measurement.monitor import Measurement, Monitor, Window
from perseus.measurement.power import PowerMonitor

__all__ = ["Measurement", "Monitor", "PowerMonitor", "Window"]
