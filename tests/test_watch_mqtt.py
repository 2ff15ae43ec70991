"""gguf_mcv.watch.mqtt: events published to a real broker (Debian's mosquitto on a loopback port).

Each event in order, once; the value retained on the state topic; Home Assistant's discovery;
a broker that goes away and comes back; a bounded queue meanwhile; credentials never shown; a
watch killed mid-way leaves ``offline`` (the broker's last will).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytest.importorskip("paho.mqtt", reason="the MQTT sink's tests need paho-mqtt (the test extra)")

from mqttbroker import Broker, Subscriber, free_port, mosquitto  # noqa: E402  (tests/ is on sys.path)

from gguf_mcv.errors import ConfigError  # noqa: E402
from gguf_mcv.watch.mqtt import MqttSink  # noqa: E402

if mosquitto() is None:
    pytest.skip("no MQTT broker: install Debian's mosquitto (apt-get install mosquitto) to run the MQTT sink's "
                "tests", allow_module_level=True)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory):
    running = Broker(tmp_path_factory.mktemp("mosquitto")).start()
    yield running
    running.stop()


def _event(i: int, after, zone: str | None = None, kind: str = "changed") -> dict:
    return {"event": kind, "on": "present", "before": None, "after": after, "zone": zone, "time": 1000.0 + i,
            "frame": i, "answer": "", "parsed": {"present": after}, "snapshot": None, "warning": None}


def test_every_event_arrives_once_in_order_and_the_state_is_retained(broker: Broker) -> None:
    sub = Subscriber(broker.port, "door")
    sink = MqttSink(f"mqtt://127.0.0.1:{broker.port}/door")
    try:
        for i in range(20):
            sink.send(_event(i, i % 2 == 0))
        counts = sink.close(timeout_s=60)
        assert counts.sent == 20 and counts.dropped == counts.failed == 0
        events = [json.loads(p) for p in sub.wait_for("door/event", 20)]
        assert [e["frame"] for e in events] == list(range(20))
        assert sub.wait_for("door/availability", 2)[-1] == "offline"
    finally:
        sub.close()
    late = Subscriber(broker.port, "door")  # subscribes after the watch ended: the retained messages
    try:
        assert late.wait_for("door/state", 1) == ["false"]  # event 19's value
        assert late.wait_for("door/availability", 1) == ["offline"]
        assert all(retained for topic, _, retained in late.messages if topic == "door/state")
    finally:
        late.close()


def test_zones_have_their_own_topics_and_discovery_announces_each_value_once(broker: Broker) -> None:
    sub = Subscriber(broker.port, "shop", "ha/#")
    sink = MqttSink(f"mqtt://127.0.0.1:{broker.port}/shop", discovery="ha")
    try:
        sink.send(_event(0, True, zone="door", kind="started"))
        sink.send(_event(1, "three boxes", zone="shelf", kind="started"))
        sink.send(_event(2, False, zone="door", kind="ended"))
        assert sink.close(timeout_s=60).sent == 3
        assert sub.wait_for("shop/door/state", 2) == ["true", "false"]
        assert sub.wait_for("shop/shelf/state", 1) == ['"three boxes"']
        door = [json.loads(p) for p in sub.wait_for("ha/binary_sensor/gguf_mcv_shop_door/config", 1)]
        shelf = [json.loads(p) for p in sub.wait_for("ha/sensor/gguf_mcv_shop_shelf/config", 1)]
        assert len(door) == len(shelf) == 1  # announced once, before the first state
        assert door[0]["state_topic"] == "shop/door/state" and door[0]["payload_on"] == "true"
        assert door[0]["availability_topic"] == "shop/availability"
        assert shelf[0]["value_template"] == "{{ value_json }}"
        order = [t for t, _, _ in sub.messages]
        assert order.index("ha/binary_sensor/gguf_mcv_shop_door/config") < order.index("shop/door/state")
    finally:
        sub.close()


def test_a_broker_that_goes_away_and_comes_back_gets_the_queued_events(tmp_path: Path) -> None:
    """Sends never block while the broker is away; the queue keeps the newest ``queue_size``
    events, counts the rest dropped, and delivers what it kept once the broker is back."""
    broker = Broker(tmp_path).start()
    sink = MqttSink(f"mqtt://127.0.0.1:{broker.port}/away", queue_size=3)
    try:
        sink.send(_event(0, True))
        assert _wait(lambda: sink.counts.sent == 1)
        broker.stop()
        assert _wait(lambda: not sink.connected)
        for i in range(1, 11):
            sink.send(_event(i, i % 2 == 0))  # returns at once: queued
        assert sink.pending() <= 3 + 1
        broker.start()
        sub = Subscriber(broker.port, "away")
        try:
            counts = sink.close(timeout_s=90)
            assert counts.dropped >= 10 - 3 - 1 and counts.sent + counts.dropped == 11
            frames = [json.loads(p)["frame"] for p in sub.wait_for("away/event", counts.sent - 1)]
            assert frames == sorted(frames) and frames[-1] == 10  # the newest kept, in order
        finally:
            sub.close()
    finally:
        broker.stop()


def test_a_broker_that_never_comes_is_no_hang_and_its_events_are_counted_dropped() -> None:
    sink = MqttSink(f"mqtt://127.0.0.1:{free_port()}/nobody")
    for i in range(5):
        sink.send(_event(i, True))
    counts = sink.close(timeout_s=1)
    assert counts.sent == 0 and counts.dropped == 5 and not sink.connected


def test_concurrent_senders_lose_nothing(broker: Broker) -> None:
    sub = Subscriber(broker.port, "many")
    sink = MqttSink(f"mqtt://127.0.0.1:{broker.port}/many", queue_size=1000)
    try:
        threads = [threading.Thread(target=lambda k=k: [sink.send(_event(100 * k + i, True)) for i in range(25)])
                   for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sink.close(timeout_s=60).sent == 100
        frames = [json.loads(p)["frame"] for p in sub.wait_for("many/event", 100)]
        assert sorted(frames) == sorted(100 * k + i for k in range(4) for i in range(25))
        for k in range(4):  # each sender's events in its order
            mine = [f for f in frames if f // 100 == k]
            assert mine == sorted(mine)
    finally:
        sub.close()


def test_credentials_never_appear_in_messages_or_logs(broker: Broker, caplog: pytest.LogCaptureFixture,
                                                      tmp_path: Path) -> None:
    own = Broker(tmp_path).start()
    url = f"mqtt://watcher:s3cr3t-pw@127.0.0.1:{own.port}/creds"
    sink = MqttSink(url)
    try:
        assert "s3cr3t" not in sink.shown and "watcher:***" in sink.shown
        assert _wait(lambda: sink.connected)
        with caplog.at_level(logging.WARNING, logger="gguf_mcv.watch"):
            own.stop()
            assert _wait(lambda: not sink.connected)
        assert "connection was lost" in caplog.text and "s3cr3t" not in caplog.text
    finally:
        sink.close(timeout_s=1)
        own.stop()
    with pytest.raises(ConfigError) as refused:
        MqttSink("mqtt://watcher:s3cr3t-pw@127.0.0.1/")
    assert "s3cr3t" not in str(refused.value)


@pytest.mark.parametrize("url, match", [
    ("http://127.0.0.1/door", "mqtt://host"), ("mqtt://127.0.0.1", "needs a topic"), ("mqtt:///door", "mqtt://host"),
    ("mqtt://127.0.0.1/door/#", "'#'"), ("mqtt://127.0.0.1/a/+/b", "needs a topic"), ("mqtt://127.0.0.1/a//b", "topic"),
    ("mqtt://127.0.0.1:99999/door", "cannot be read"), ("mqtt://127.0.0.1/door?x=1", "no '\\?'"),
    ("mqtt://127.0.0.1/" + "t" * 201, "at most"), ("", "mqtt://host"), (None, "mqtt://host"), (5, "mqtt://host"),
])
def test_bad_urls_are_refused_before_anything_connects(url, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MqttSink(url)


def test_bad_discovery_prefixes_and_queue_sizes_are_refused() -> None:
    for bad in ("", "ha/#", 5):
        with pytest.raises(ConfigError, match="discovery"):
            MqttSink("mqtt://127.0.0.1/door", discovery=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="queue_size"):
        MqttSink("mqtt://127.0.0.1/door", queue_size=0)


def test_a_watch_killed_mid_way_leaves_offline_by_the_brokers_last_will(broker: Broker) -> None:
    sub = Subscriber(broker.port, "killed")
    script = textwrap.dedent(f"""
        import sys, time
        from gguf_mcv.watch.mqtt import MqttSink
        sink = MqttSink("mqtt://127.0.0.1:{broker.port}/killed")
        while not sink.connected:
            time.sleep(0.05)
        sink.send({{"event": "started", "after": True, "zone": None, "frame": 0}})
        while sink.counts.sent < 1:
            time.sleep(0.05)
        print("sent", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "sent"
        assert sub.wait_for("killed/availability", 1) == ["online"]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert sub.wait_for("killed/availability", 2, timeout_s=120)[-1] == "offline"  # the socket closed with the process
        assert sub.on("killed/state") == ["true"]
    finally:
        if child.poll() is None:
            child.kill()
        sub.close()


def _wait(condition, timeout_s: float = 60.0) -> bool:
    """Whether ``condition()`` came true within ``timeout_s`` (a liveness wait, not a speed bound)."""
    done = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return True
        done.wait(0.05)
    return condition()
