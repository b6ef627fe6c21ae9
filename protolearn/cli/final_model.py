"""The coordinator keeps the finished run's model, so it can be exported (or sampled) after every node left.

:func:`keep_final_model` runs beside the coordinator service. When the run's last step commits, the
core tells members to stay (``HeartbeatReply.final = "collecting"``, :mod:`protolearn.node.final_wait`);
this task then does what ``protolearn swarm export`` does, from a throwaway identity on this machine:
it fetches every stage from a live replica (:func:`~protolearn.node.swarm_export.export_swarm`) into
``<data dir>/final/model.safetensors`` (and ``model.toml``), marks the core ``saved`` (members leave)
and serves that file's stages over the state-sync protocol (:class:`~protolearn.node.model_server.ModelServer`),
which ``swarm export`` falls back to once no replica is left. A coordinator restarted on a data dir
that holds the final model of its run serves it again at once. If fetching fails :data:`ATTEMPTS`
times, the core is marked ``failed`` (members leave; their checkpoints hold the stages) and the log
says how to export from checkpoints instead.

The fetch needs torch and the node's export code, which the coordinator does not otherwise load (2.5 s of
imports here). They are loaded in a thread once half the run's steps have committed, so that every member
does not wait those seconds after the last step; not at start, where they would slow the joins and weigh on
every coordinator, and on a load test's memory per member.
"""

from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path
from typing import Any

import trio

FINAL_DIR = "final"
MODEL_FILE = "model.safetensors"
ATTEMPTS = 3
RETRY_S = 5.0
FETCH_TIMEOUT_S = 300.0
POLL_S = 0.2
# What the fetch and the serving import (the module docstring); the fetch builds each stage's worker, whose
# optimizer imports torch._dynamo on first use (1.2 s of the 2.5).
FETCH_MODULES = ("protolearn.node.swarm_export", "protolearn.node.model_server", "torch._dynamo")

log = logging.getLogger("protolearn.coordinator")


def final_model_path(data_dir: Path) -> Path:
    return Path(data_dir) / FINAL_DIR / MODEL_FILE


def _kept(path: Path, run_hash: str) -> int | None:
    """The step of the final model at ``path`` if it is one of this run, else None."""
    from protolearn.node.export import read_model_info
    from protolearn.errors import ProtolearnError

    try:
        info = read_model_info(path)
    except ProtolearnError:
        return None
    return info.step if info.run_hash == run_hash else None


async def keep_final_model(running: Any, local_addr: str, shown_addr: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """See the module docstring; ``local_addr`` is the coordinator's own address to fetch through, ``shown_addr``
    the one it printed (what other machines export with)."""
    core = running.core
    path = final_model_path(running.data_dir)
    step = _kept(path, core.run.run_hash) if path.exists() else None
    task_status.started()  # (the status and the heartbeats say "collecting" by themselves once the run ends)
    if step is not None:
        _serve(running, path, step, shown_addr)
        return
    warmed = False
    while not core.final_model.finished:
        if not warmed and core.final_model.half_done:
            warmed = True
            threading.Thread(target=_import_fetch_modules, name="final-model-imports", daemon=True).start()
        await trio.sleep(POLL_S)
    log.info("run %s finished: all %d steps committed; fetching the final model from the replicas", core.run.name, core.run.steps)
    last = ""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            result = await _fetch(local_addr, path)
        except Exception as err:  # noqa: BLE001 - one failed attempt of a best-effort archive; logged, retried
            last = str(err) or type(err).__name__
            log.warning("could not fetch the final model (attempt %d of %d): %s", attempt, ATTEMPTS, last)
            await trio.sleep(RETRY_S)
            continue
        _serve(running, result.out, result.step, shown_addr)
        return
    core.final_model.failed()
    log.warning(
        "gave up keeping the final model (%s); export it from the nodes' checkpoints: gather every stage's files into one "
        "folder and run `protolearn export --checkpoints DIR --out model.safetensors`", last,
    )


def _import_fetch_modules() -> None:
    try:
        for name in FETCH_MODULES:
            importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - only a head start: the fetch imports them again and reports what fails
        log.info("could not load the final model's fetch ahead of the run's end: %s", err)


async def _fetch(local_addr: str, path: Path) -> Any:
    from protolearn.node.swarm_export import export_swarm
    from protolearn.protocol.identity import Identity
    from protolearn.protocol.transport import TransportConfig, open_host

    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = TransportConfig(request_timeout_s=FETCH_TIMEOUT_S, connect_timeout_s=10.0)
    async with open_host(Identity.generate(), ["/ip4/127.0.0.1/tcp/0"], cfg) as host:
        return await export_swarm(host, local_addr, path, timeout_s=FETCH_TIMEOUT_S)


def _serve(running: Any, path: Path, step: int, shown_addr: str) -> None:
    from protolearn.node.model_server import ModelServer  # torch: loaded only once there is a model to serve

    core = running.core
    ModelServer(running.host, path).register()
    core.final_model.saved(step)
    log.info(
        "final model of run %s (step %d) saved to %s; from any machine: protolearn swarm export --coordinator %s --out model.safetensors",
        core.run.name, step, path, shown_addr,
    )
