"""Watch a camera, file or stream: answers at each tick, re-encoding only the slices that changed."""

from .observe import Observation, Watch, watch

__all__ = ["Observation", "Watch", "watch"]
