"""Watch a camera, file or stream: answers at each tick, re-encoding only the slices that changed;
zones with questions of their own; events when a followed value changes, with snapshots and
webhook and MQTT sinks."""

from .events import Event
from .mqtt import MqttSink
from .observe import Observation, Watch, watch
from .regions import Region, Zone
from .snapshots import SnapshotFolder
from .webhook import WebhookSink

__all__ = ["Event", "MqttSink", "Observation", "Region", "SnapshotFolder", "Watch", "WebhookSink", "Zone", "watch"]
