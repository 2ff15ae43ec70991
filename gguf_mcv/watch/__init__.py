"""Watch a camera, file or stream: answers at each tick, re-encoding only the slices that changed."""

from .observe import Observation, watch

__all__ = ["Observation", "watch"]
