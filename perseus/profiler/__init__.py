"""Time-energy profiles of pipeline instructions."""

from perseus.profiler.profile import Profile, ProfilePoint, load_profile, save_profile

__all__ = ["Profile", "ProfilePoint", "load_profile", "save_profile"]
