"""Watch a camera, file or stream: answers at each tick, re-encoding only the slices that changed;
events when a followed value changes, with snapshots and a webhook sink."""

from .events import Event
from .observe import Observation, Watch, watch
from .regions import Region
from .snapshots import SnapshotFolder
from .webhook import WebhookSink

__all__ = ["Event", "Observation", "Region", "SnapshotFolder", "Watch", "WebhookSink", "watch"]
