"""The batch job on a Ray cluster: :class:`Answerer` for ``ray.data.Dataset.map_batches``, and :func:`run_items`.

    import ray.data
    from gguf_mcv import batch
    from gguf_mcv.jobs.batch_ray import Answerer, records
    ds = ray.data.from_items(records(batch.collect("photos/", prompts=["What is it?"])))
    rows = ds.map_batches(Answerer, fn_constructor_kwargs={"load": {"model": "minicpm-v"}},
                          compute=ray.data.ActorPoolStrategy(size=2), batch_size=2, num_cpus=1)

Each Ray worker loads the model once (``load()`` there plans the quant from that
node's memory and fetches it into that node's Hugging Face cache) and returns rows
with the same fields as the JSONL of :mod:`gguf_mcv.jobs.batch`; a bad item is a row with
an ``error``, never a failed task. Media paths must be readable on every node
(a shared file system), as with any Ray job that reads local paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..errors import ClusterError, ConfigError
from ..options import check_int
from .batch import Summary, answer, base_row, error_row, write_rows
from .batch_input import Item, for_model, model_identity

if TYPE_CHECKING:
    from ..model import Model

#: Items per Ray task: small, so a killed driver loses little and workers stay evenly busy.
BATCH_SIZE = 2


def records(items: Iterable[Item]) -> list[dict[str, str]]:
    """Dataset rows for ``items``: ``key`` and the item as JSON text (``item``; an item's
    ``problem`` travels as its class name and message)."""
    out = []
    for item in items:
        fields = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
        fields["path"] = str(item.path) if item.path is not None else None
        problem = item.problem
        fields["problem"] = [type(problem).__name__, " ".join(str(problem).split())] if problem is not None else None
        out.append({"key": item.key, "item": json.dumps(fields, ensure_ascii=False)})
    return out


def item_from(record: str) -> tuple[Item, list[str] | None]:
    """The :class:`Item` of a dataset row's ``item`` text, and its problem (class, message) if any."""
    fields = json.loads(record)
    path, problem = fields.pop("path"), fields.pop("problem", None)
    return Item(path=Path(path) if path is not None else None, **fields), problem


class Answerer:
    """A callable class for ``map_batches``: one model per Ray worker, one row per item.

    ``load`` holds :func:`gguf_mcv.load`'s keywords (plain values). A batch is a dict of
    columns with ``item`` (from :func:`records`); the result is a dict of columns with the
    JSONL row's fields.
    """

    def __init__(self, load: dict[str, Any]) -> None:
        from ..loader import load as load_model  # lazy: on the worker

        self.model: "Model" = load_model(**load)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        rows = []
        for record in batch["item"]:
            try:
                item, problem = item_from(str(record))
            except (ValueError, TypeError, KeyError) as exc:
                key = hashlib.sha256(str(record).encode("utf-8", "surrogatepass")).hexdigest()
                rows.append(error_row(Item(str(record)[:200], "", "", key=key), exc))
                continue
            if problem is not None:
                row = base_row(item)
                row["error"] = {"class": str(problem[0]), "message": str(problem[1])}
                rows.append(row)
            else:
                rows.append(answer(self.model, item))
        return {name: [row[name] for row in rows] for name in rows[0]} if rows else {}


def run_items(address: str, load: dict[str, Any], items: Sequence[Item], out: str | os.PathLike, *,
              workers: int | None = None, progress: bool | None = None) -> Summary:
    """Answer keyed ``items`` on the Ray cluster at ``address`` into ``out``, like
    :func:`gguf_mcv.jobs.batch.run_items`: rows are written (fsync'd) as they come back, items already
    in ``out`` are skipped. ``workers`` model copies (default: one per alive node), one CPU each
    unless ``load`` sets ``n_threads``. Row keys include the model (:func:`load_identity`)."""
    if workers is not None:
        check_int("workers", workers, low=1)
    ray = _import_ray()  # before anything is written: without Ray or a cluster there is no job
    check_reachable(address)
    items = for_model(items, load_identity(load))

    def rows(todo: list[Item]) -> Iterable[dict[str, Any]]:
        for item in todo:  # a bad item is an error row at once: nothing for a worker to do
            if item.problem is not None:
                yield error_row(item, item.problem)
        good = [i for i in todo if i.problem is None]
        if good:
            yield from _rows_on_cluster(ray, address, load, good, workers)

    return write_rows(items, out, rows, progress=progress)


#: :func:`gguf_mcv.load` keywords that change answers, as given (each worker resolves "auto" for its node)
ANSWER_SETTINGS = {"vision_backend": "auto", "mmproj_precision": "auto", "vision_gpu": None,
                   "chat_template": None, "n_ctx": None}


def load_identity(load: dict[str, Any]) -> str:
    """The model of ``load`` (:func:`gguf_mcv.load`'s keywords) for batch keys: the files' SHA-256
    for local files; for a name, which the workers resolve and plan each for its node, the name,
    quant and revision; and the keywords of :data:`ANSWER_SETTINGS` as given (their defaults when
    left out), so an explicit ``vision_backend="onnx-int8"`` and ``"onnx-fp32"`` key apart."""
    if load.get("model_path") and load.get("mmproj_path"):
        model = model_identity(load["model_path"], load["mmproj_path"])
    else:
        model = "load:" + json.dumps({name: load.get(name) for name in ("model", "quant", "revision")},
                                     sort_keys=True, default=str)
    settings = {name: load.get(name, default) for name, default in ANSWER_SETTINGS.items()}
    return f"{model}+{json.dumps(settings, sort_keys=True, default=str)}"


def _rows_on_cluster(ray: Any, address: str, load: dict[str, Any], items: list[Item],
                     workers: int | None) -> Iterable[dict[str, Any]]:
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError
        raise ClusterError(f"Cannot join the Ray cluster at {address!r}: {exc}. Start one with "
                           "'ray start --head' and pass its address (or 'auto').") from None
    try:
        import ray.data  # lazy: with Ray

        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        alive = [n for n in ray.nodes() if n.get("Alive")]
        copies = workers or max(1, len(alive))
        threads = load.get("n_threads") or 1
        largest = max((n.get("Resources", {}).get("CPU", 0) for n in alive), default=0)
        if threads > largest:  # Ray Data would wait for such a worker forever
            raise ClusterError(f"Each worker reserves --threads {threads} CPUs, but the largest node of the "
                               f"cluster at {address} has {largest:g}: use --threads {int(largest) or 1} or less.")
        dataset = ray.data.from_items(records(items))
        # one actor per model copy; Ray Data's default scheduling strategy (SPREAD) spreads them over nodes
        mapped = dataset.map_batches(Answerer, fn_constructor_kwargs={"load": load}, batch_size=BATCH_SIZE,
                                     compute=ray.data.ActorPoolStrategy(size=copies), num_cpus=threads)
        try:
            for row in mapped.iter_rows():
                yield _plain(dict(row))
        except Exception as exc:  # noqa: BLE001 - a worker that cannot load the model ends the job
            raise ClusterError(f"The Ray job failed: {' '.join(str(exc).split())[:2000]}") from None
    finally:
        ray.shutdown()


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """:class:`ClusterError` unless something answers at ``address`` (``host:port`` or
    ``ray://host:port``; ``auto`` is left to Ray): ``ray.init`` would wait minutes for a dead one."""
    if address == "auto" or address.startswith("local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"Ray address {address!r} is not HOST:PORT (e.g. 10.0.0.5:6379) or 'auto'.")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise ClusterError(f"No Ray cluster answers at {address} ({exc}): start one with 'ray start --head' "
                           "and pass the address it prints.") from None


def _plain(value: Any) -> Any:
    """Ray's values as plain JSON data (numpy scalars and arrays become Python ones)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalar or array
        return _plain(value.tolist())
    return value


def _import_ray() -> Any:
    try:
        import ray  # lazy: an optional extra
    except ImportError as exc:
        raise ConfigError(f"Ray jobs need the extra: pip install 'gguf-mcv[ray]' ({exc}).") from None
    return ray
