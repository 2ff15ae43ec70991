"""The MQTT sink: each event published to a broker with paho-mqtt, from a thread of its own.

``mqtt://[user[:password]@]host[:port]/TOPIC`` (``mqtts://`` for TLS, port 8883 by default). For
an event of the whole frame, and likewise under ``TOPIC/ZONE`` for a zone's:

- ``TOPIC/event``: the event as JSON (what the webhook POSTs), QoS 1, not retained;
- ``TOPIC/state``: the followed value now, as JSON (``true``, ``"open"``, ``3``), QoS 1 and
  retained, so a client that subscribes later learns the current value at once;
- ``TOPIC/availability``: ``online`` while the watch runs, ``offline`` when it ends or (the
  broker's last will) when its connection dies; retained.

With ``discovery`` (a prefix, ``homeassistant`` by default in the CLI) each followed value is
announced to Home Assistant's MQTT discovery before its first state: a ``binary_sensor`` for a
true/false value, a ``sensor`` otherwise, so it appears without configuration.

:meth:`MqttSink.send` only queues (:mod:`.sink_queue`: a bounded queue, the oldest event goes
when it is full, counted). The sink's thread hands one event at a time to paho once connected
and waits for the broker's acknowledgements; paho reconnects with a backoff that doubles from
1 s to :data:`MAX_BACKOFF_S` while the broker is away, and resends what was unacknowledged,
so an event reaches the broker at least once and the queue meanwhile stays bounded.
Credentials in the URL are sent as MQTT's user name and password and masked wherever the URL
is shown.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import threading
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .sink_queue import DEFAULT_QUEUE, QueuedSink, split_url
from .sources import redact

if TYPE_CHECKING:
    import paho.mqtt.client as paho_client

log = logging.getLogger("gguf_mcv.watch")

#: Longest wait between reconnection attempts while the broker is away.
MAX_BACKOFF_S = 30.0
#: Seconds between keep-alive pings (a dead broker is noticed within about 1.5 times this).
KEEPALIVE_S = 30
#: Seconds one wait for the broker (a connection, an acknowledgement) lasts before close() is looked at again.
_POLL_S = 0.25
#: Longest topic accepted (MQTT allows 65535 bytes; brokers and Home Assistant want far less).
MAX_TOPIC = 200
_LEVEL = re.compile(r"[^/+#\x00]+")
_SLUG = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass(frozen=True)
class _Broker:
    tls: bool
    host: str
    port: int
    topic: str
    username: str | None
    password: str | None


class MqttSink(QueuedSink):
    """Publish each event to the broker named by ``url``; see the module's doc."""

    name = "mqtt"

    def __init__(self, url: str, *, discovery: str | None = None, queue_size: int = DEFAULT_QUEUE,
                 client_id: str | None = None) -> None:
        self.broker = _checked_url(url)
        self.shown = redact(url.strip())
        if discovery is not None and (not isinstance(discovery, str) or not _valid_topic(discovery)):
            raise ConfigError(f"mqtt discovery must be a topic prefix such as 'homeassistant', not {discovery!r}.")
        self.discovery = discovery
        try:
            import paho.mqtt.client as mqtt  # lazy: an optional dependency
        except ImportError:
            raise ConfigError("the MQTT sink needs paho-mqtt: pip install 'gguf-mcv[mqtt]'.") from None
        self._mqtt = mqtt
        super().__init__(queue_size=queue_size)
        self._announced: set[str] = set()  # state topics announced to discovery
        self._connected = threading.Event()
        self._client = self._new_client(client_id or f"gguf-mcv-watch-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        b = self.broker
        self._client.connect_async(b.host, b.port, keepalive=KEEPALIVE_S)
        self._client.loop_start()  # paho's thread: connects, reconnects with backoff, resends
        self._start()

    @property
    def connected(self) -> bool:
        """Whether the broker connection is up now."""
        return self._connected.is_set()

    def _new_client(self, client_id: str) -> "paho_client.Client":
        mqtt = self._mqtt
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        b = self.broker
        if b.username is not None:
            client.username_pw_set(b.username, b.password)
        if b.tls:
            client.tls_set_context(ssl.create_default_context())
        client.reconnect_delay_set(min_delay=1, max_delay=int(MAX_BACKOFF_S))
        client.will_set(self._availability, "offline", qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        return client

    @property
    def _availability(self) -> str:
        return f"{self.broker.topic}/availability"

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if getattr(reason, "is_failure", False):
            self.counts.last_error = f"the broker refused the connection ({reason})"
            log.warning("mqtt %s: %s", self.shown, self.counts.last_error)
            return
        client.publish(self._availability, "online", qos=1, retain=True)
        self._connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if self._connected.is_set() and not self.closing:
            self.counts.last_error = f"the broker connection was lost ({reason})"
            log.warning("mqtt %s: %s; reconnecting", self.shown, self.counts.last_error)
        self._connected.clear()

    def _deliver(self, event: dict[str, Any]) -> None:
        for topic, payload, retain in self._messages(event):
            if not self._publish(topic, payload, retain):
                with self._lock:  # closing before the broker took it
                    self.counts.dropped += 1
                return
        self.counts.sent += 1

    def _messages(self, event: dict[str, Any]) -> list[tuple[str, str, bool]]:
        """The messages of one event: (discovery,) its event and its state."""
        zone = event.get("zone")
        base = f"{self.broker.topic}/{zone}" if zone else self.broker.topic
        state = f"{base}/state"
        after = event.get("after")
        out = []
        if self.discovery is not None and state not in self._announced:
            out.append((*self._discovery_message(state, zone, after), True))
        out.append((f"{base}/event", json.dumps(event, ensure_ascii=False, default=str), False))
        out.append((state, json.dumps(after, ensure_ascii=False, default=str), True))
        return out

    def _discovery_message(self, state: str, zone: str | None, value: Any) -> tuple[str, str]:
        """Home Assistant's discovery topic and config for the value published on ``state``."""
        component = "binary_sensor" if isinstance(value, bool) else "sensor"
        device = _SLUG.sub("_", f"gguf_mcv_{self.broker.topic}").strip("_")[:100]
        object_id = _SLUG.sub("_", f"{device}_{zone}" if zone else device)[:120]
        config: dict[str, Any] = {
            "name": zone or "watch", "unique_id": object_id, "state_topic": state,
            "availability_topic": self._availability,
            "device": {"identifiers": [device], "name": f"gguf-mcv watch {self.broker.topic}",
                       "manufacturer": "gguf_mcv"}}
        if component == "binary_sensor":
            config.update(payload_on="true", payload_off="false")
        else:
            config["value_template"] = "{{ value_json }}"
        self._announced.add(state)
        return f"{self.discovery}/{component}/{object_id}/config", json.dumps(config)

    def _publish(self, topic: str, payload: str, retain: bool) -> bool:
        """Publish one message once connected and wait for the broker's acknowledgement (paho
        resends it after a reconnection); False when the sink closes first."""
        while not self._connected.is_set():
            if self._wait_closing(_POLL_S):
                return False
        info = self._client.publish(topic, payload, qos=1, retain=retain)
        while True:
            try:
                info.wait_for_publish(timeout=_POLL_S)
            except (ValueError, RuntimeError) as exc:  # not taken into paho's queue
                self.counts.last_error = f"{type(exc).__name__}: {exc}"
                if self._wait_closing(_POLL_S):
                    return False
                info = self._client.publish(topic, payload, qos=1, retain=retain)
                continue
            if info.is_published():
                return True
            if self.closing:
                return False

    def _stop_grace_s(self) -> float:
        return 2 * _POLL_S

    def _stopped(self) -> None:
        if self._connected.is_set():
            self._client.publish(self._availability, "offline", qos=1, retain=True).wait_for_publish(timeout=2.0)
        self._client.disconnect()
        self._client.loop_stop()


def _valid_topic(topic: str) -> bool:
    return 0 < len(topic) <= MAX_TOPIC and all(_LEVEL.fullmatch(level) for level in topic.split("/"))


def _checked_url(url: Any) -> _Broker:
    parts = split_url(url, sink="mqtt", schemes=("mqtt", "mqtts"),
                      form="a URL mqtt://host[:port]/topic (mqtts:// for TLS)")
    if "?" in url or "#" in url:
        raise ConfigError(f"mqtt URL {redact(url)}: a topic has no '?' or '#' part; give mqtt://host/topic.")
    topic = urllib.parse.unquote(parts.path.strip("/"))
    if not _valid_topic(topic):
        raise ConfigError(f"mqtt URL {redact(url)} needs a topic after the host (mqtt://host/door), with no "
                          f"empty level, '+', '#' or NUL, at most {MAX_TOPIC} characters.")
    tls = parts.scheme == "mqtts"
    username = None if parts.username is None else urllib.parse.unquote(parts.username)
    password = None if parts.password is None else urllib.parse.unquote(parts.password)
    assert parts.hostname is not None
    return _Broker(tls, parts.hostname, parts.port or (8883 if tls else 1883), topic, username, password)
