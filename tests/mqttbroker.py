"""Debian's ``mosquitto`` broker on a loopback port, for tests of the MQTT sink, and a subscriber.

``Broker(folder)`` writes a config (one listener on 127.0.0.1, anonymous clients allowed, no
persistence) and ``start()`` runs ``mosquitto -c`` in a child process; ``stop()`` ends it (the
broker goes away), ``start()`` again serves on the same port (it comes back). ``mosquitto()``
is the executable's path, or None where it is not installed (the tests then skip, saying why).

``Subscriber(port, topic)`` collects every message under ``topic/#`` (with its retain flag, and
when it arrived) on a paho client of its own.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt


def mosquitto() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto",) if Path(p).exists()), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """A mosquitto broker on 127.0.0.1 (see the module docstring)."""

    def __init__(self, folder: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.config = folder / "mosquitto.conf"
        self.log = folder / "mosquitto.log"
        self.config.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                               f"log_dest file {self.log}\n")
        self._process: subprocess.Popen | None = None

    def start(self) -> "Broker":
        path = mosquitto()
        assert path is not None
        self._process = subprocess.Popen([path, "-c", str(self.config)], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self._process.poll() is not None:
                    raise RuntimeError(f"mosquitto exited ({self._process.returncode}): {self._log_tail()}")
                time.sleep(0.05)
        raise RuntimeError(f"mosquitto did not listen on {self.port}: {self._log_tail()}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else "(no log)"


class Subscriber:
    """Every message under ``topic/#`` (and ``extra`` topic filters): (topic, payload, retained)."""

    def __init__(self, port: int, topic: str, *extra: str) -> None:
        self.messages: list[tuple[str, str, bool]] = []
        self.arrived: list[float] = []  #: when each message arrived (time.time())
        self._arrived = threading.Condition()
        self._ready = threading.Event()
        self._filters = [f"{topic}/#", *extra]
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-sub-{port}-{id(self)}")
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._ready.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self._ready.wait(30), "the subscriber did not subscribe"

    def _on_connect(self, client, userdata, flags, reason, properties) -> None:
        client.subscribe([(f, 1) for f in self._filters])

    def _on_message(self, client, userdata, message) -> None:
        with self._arrived:
            self.messages.append((message.topic, message.payload.decode(), bool(message.retain)))
            self.arrived.append(time.time())
            self._arrived.notify_all()

    def on(self, topic: str) -> list[str]:
        with self._arrived:
            return [payload for t, payload, _ in self.messages if t == topic]

    def wait_for(self, topic: str, count: int, timeout_s: float = 60.0) -> list[str]:
        """The payloads on ``topic`` once ``count`` have arrived (fewer when ``timeout_s`` passes first)."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            self._arrived.wait_for(lambda: len([1 for t, _, _ in self.messages if t == topic]) >= count,
                                   timeout=max(0.0, deadline - time.monotonic()))
        return self.on(topic)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
