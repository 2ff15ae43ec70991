"""The picture factories: deterministic images, photos, animations and videos (a seed gives the
same bytes every run; a new seed, an image nothing cached can answer for)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageDraw


def encoded(rgb: np.ndarray | PIL.Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    """``rgb`` (an HxWx3 uint8 array or a PIL image) as ``fmt`` bytes."""
    image = rgb if isinstance(rgb, PIL.Image.Image) else PIL.Image.fromarray(rgb)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def data_uri(raw: bytes, mime: str = "image/png") -> str:
    """``raw`` as a ``data:`` URI, as OpenAI-style messages carry images."""
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def noise(seed: int, side: int = 96) -> np.ndarray:
    """Random pixels, ``side`` square: an image that compresses like nothing and shares nothing."""
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def png_bytes(seed: int, side: int = 96) -> bytes:
    """A PNG of :func:`noise` (fast to write: compression level 1)."""
    return encoded(noise(seed, side), "PNG", compress_level=1)


def shapes(size: int = 1344) -> np.ndarray:
    """Gradients and twelve coloured circles, ``size`` square (the chat benchmarks' picture)."""
    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([(x * 255 // size), (y * 255 // size), ((x + y) * 127 // size)], axis=2)
    image = PIL.Image.fromarray(rgb.astype(np.uint8))
    draw = PIL.ImageDraw.Draw(image)
    for i in range(12):
        r = 40 + 9 * i
        cx, cy = (97 * i) % size, (173 * i) % size
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(255 - 20 * i, 20 * i, 128))
    return np.asarray(image)


def ramps(side: int = 1344, *, noise_seed: int | None = None) -> np.ndarray:
    """Smooth diagonal ramps, ``side`` square; with ``noise_seed``, half ramps and half noise so it
    compresses like a photo (the memory benchmark's picture)."""
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    if noise_seed is None:
        return np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, -ramp) % 256,
                         np.full((side, side), 90, np.float32)], axis=-1).astype(np.uint8)
    rgb = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, ramp[::-1]) / 2,
                    np.broadcast_to(ramp, (side, side))], axis=-1)
    rng = np.random.default_rng(noise_seed)
    return (rgb * 0.5 + rng.integers(0, 128, rgb.shape)).clip(0, 255).astype(np.uint8)


def photo_bytes(seed: int, width: int = 4032, height: int = 3024) -> bytes:
    """A camera-sized JPEG (12 MP by default): smooth colour waves plus some noise, a few MB."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (height // 64 + 1, width // 64 + 1, 3), dtype=np.uint8)
    image = PIL.Image.fromarray(small).resize((width, height), PIL.Image.Resampling.BICUBIC)
    return encoded(image, "JPEG", quality=90)


def detailed_photo(path: Path, size: tuple[int, int] = (4032, 3024), seed: int = 0) -> Path:
    """A JPEG with detail everywhere (gradients, sixty shapes, sensor noise), as a phone writes."""
    w, h = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([x / w * 200 + 30, y / h * 180 + 40, (x + y) / (w + h) * 150 + 60], axis=-1)
    rgb += rng.normal(0, 6, rgb.shape).astype(np.float32)
    image = PIL.Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
    draw = PIL.ImageDraw.Draw(image)
    for _ in range(60):
        x0, y0 = int(rng.integers(0, w - 400)), int(rng.integers(0, h - 400))
        side = int(rng.integers(80, 400))
        draw.ellipse((x0, y0, x0 + side, y0 + side), fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    image.save(path, "JPEG", quality=90)
    return path


def gif_bytes(seed: int, frames: int = 3, side: int = 64) -> bytes:
    """A short animated GIF (one frame a second) of random pixels."""
    rng = np.random.default_rng(seed)
    images = [PIL.Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(frames)]
    return encoded(images[0], "GIF", save_all=True, append_images=images[1:], duration=1000, loop=0)


def write_pngs(folder: Path, n: int, side: int, seed: int = 0) -> list[Path]:
    """``n`` PNG files of random pixels in ``folder`` (``img000.png`` ...)."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        path = folder / f"img{i:03d}.png"
        PIL.Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def write_video(path: Path, *, seconds: int = 30, fps: int = 10, size: tuple[int, int] = (1280, 720),
                moving_for: float | None = None, scene_cut: bool = True, clock: bool = True,
                sensor_noise: bool = True) -> Path:
    """A synthetic MJPEG clip: a drifting background and a moving ball; with ``scene_cut`` the
    background changes at two thirds, with ``clock`` the time is written on it, with
    ``sensor_noise`` every frame gets a little noise. After ``moving_for`` seconds the picture
    freezes (a static camera)."""
    import cv2  # lazy: only the video benchmarks

    w, h = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    rng = np.random.default_rng(0)
    for i in range(seconds * fps):
        t = min(i / fps, moving_for) if moving_for is not None else i / fps
        frame = np.zeros((h, w, 3), dtype=np.uint8)
        if scene_cut:
            frame[:] = (40 + int(t * 3) % 60, 90, 140) if t < seconds * 2 / 3 else (150, 60, 40)
        else:
            frame[:] = (40 + int(t * 5) % 80, 90, 140)
        cv2.circle(frame, (int(60 + (w - 120) * (t / seconds)), h // 2 + int(80 * np.sin(t))), 50, (0, 220, 255), -1)
        if clock:
            cv2.putText(frame, f"{t:5.1f}", (30, 60), cv2.FONT_HERSHEY_SIMPLEX, 1.5, (255, 255, 255), 3)
        if sensor_noise:
            grain = rng.integers(-2, 3, frame.shape, dtype=np.int16)
            frame = np.clip(frame.astype(np.int16) + grain, 0, 255).astype(np.uint8)
        writer.write(frame)
    writer.release()
    return path


def scene(seed: int, size: tuple[int, int] = (1280, 720)) -> np.ndarray:
    """A synthetic camera scene (720p by default): gradients, ten circles and a caption naming it."""
    import cv2  # lazy: only the camera benchmarks

    w, h = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 200 // w + 20), (y * 180 // h + 40), ((x + y) * 100 // (w + h) + 60)],
                   axis=2).astype(np.uint8)
    for _ in range(10):
        cx, cy, r = int(rng.integers(60, w - 60)), int(rng.integers(60, h - 60)), int(rng.integers(15, 50))
        cv2.circle(rgb, (cx, cy), r, tuple(int(v) for v in rng.integers(0, 255, 3)), -1)
    cv2.putText(rgb, f"scene {seed}", (40, 80), cv2.FONT_HERSHEY_SIMPLEX, 2, (255, 255, 255), 4)
    return rgb


def noisy(rgb: np.ndarray, seed: int, sigma: float = 3.0) -> np.ndarray:
    """``rgb`` with Gaussian sensor noise of ``sigma`` levels (a new seed, a new draw)."""
    return np.clip(rgb + np.random.default_rng(seed).normal(0, sigma, rgb.shape), 0, 255).astype(np.uint8)
