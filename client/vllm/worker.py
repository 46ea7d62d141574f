"""Worker side: vLLM's ``OffloadingWorker`` moving blocks through ``KVTierClient``.

A job names vLLM's keys (``KVTierLoadStoreSpec``) and the engine's blocks (``GPULoadStoreSpec``:
per group, ``group_sizes[g]`` block ids whose first one sits at logical block ``block_indices[g]``).
Each key becomes one ``Chunk`` of ``blocks_per_chunk`` block ids, -1 where the job has no block (the
head of a chunk a sliding window freed, the tail of a partial chunk), so the client copies exactly
the pages the job names. CPU tensors use the client's torch copies; CUDA tensors its GPU path.

Jobs run in order on one background thread, so ``submit_*`` never waits on the daemon; an
expedited load (vLLM 0.33 waits for it within the step: ``sync_load_budget_bytes``) runs on its own
thread instead of queueing behind regular jobs, and jobs are reported as they finish. A daemon that
is down or slow costs misses, not a hang: client calls time out after ``kvtierd_timeout_s``, after
which jobs complete at once (nothing moved) for ``kvtierd_retry_s``, then the client reconnects.
vLLM 0.32 has no way to report a failed job, so a failed load is logged, counted in
``load_failures`` and its blocks kept for ``take_failed_block_ids`` (``KVTierConnector`` hands them
to vLLM's load-failure recovery).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult

from kvtierd import control
from kvtierd.protocol import Op

from ..client import KVTierClient
from ..layout import KVLayout
from ..planner import Chunk
from .jobs import job_chunks, neighbour_keys
from .manager import KVTierLoadStoreSpec
from .settings import KVTierSettings

log = logging.getLogger(__name__)

# Test-only: load each chunk from its neighbour's key (a negative control that must corrupt output).
NEIGHBOUR_ENV = "KVTIER_TEST_LOAD_NEIGHBOUR_CHUNK"
# Test-only: delete a load's chunks from the daemon just before it (as if evicted after the lookup).
DROP_BEFORE_LOAD_ENV = "KVTIER_TEST_DROP_BEFORE_LOAD"


@dataclass
class _Job:
    job_id: int
    is_load: bool
    chunks: list[Chunk]
    future: Future
    started: float


class KVTierOffloadingWorker(OffloadingWorker):
    def __init__(self, layout: KVLayout, kv_caches: dict[str, torch.Tensor],
                 settings: KVTierSettings, published: Path | None = None) -> None:
        self.layout = layout
        self._published = published  # our layout file for the scheduler, removed at shutdown
        self.settings = settings
        self._kv_caches = kv_caches
        self._client: KVTierClient | None = None
        self._down_until = 0.0
        self._jobs: list[_Job] = []  # submitted, not yet reported (they may finish out of order)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-vllm")
        self._expedited = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-vllm-sync")
        self._connect_lock = threading.Lock()  # both job threads may connect first
        self._failed_lock = threading.Lock()
        self._failed_block_ids: set[int] = set()
        self.load_failures = 0  # chunks a load could not fill (daemon gone, evicted, checksum)
        self.store_failures = 0  # chunks a store could not write (a later request stores them)
        self._executor.submit(self._connected)  # connect early, off the engine's thread

    # -- OffloadingWorker -------------------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: KVTierLoadStoreSpec
                     ) -> bool:
        return self._submit(job_id, False, self._chunks(dst_spec.keys, src_spec))

    def submit_load(self, job_id: int, src_spec: KVTierLoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        chunks = self._chunks(src_spec.keys, dst_spec)
        if os.environ.get(NEIGHBOUR_ENV) == "1":
            chunks = neighbour_keys(chunks)
        return self._submit(job_id, True, chunks, self._expedited if expedited else None)

    def get_finished(self) -> list[TransferResult]:
        done: list[_Job] = []
        pending: list[_Job] = []
        for job in self._jobs:
            (done if job.future.done() else pending).append(job)
        self._jobs = pending
        return [TransferResult(job_id=job.job_id, success=True, transfer_size=job.future.result(),
                               transfer_time=time.monotonic() - job.started) for job in done]

    def wait(self, job_ids: set[int]) -> None:
        wait([job.future for job in self._jobs if job.job_id in job_ids])

    def shutdown(self) -> None:
        self._expedited.shutdown(wait=True)
        self._executor.shutdown(wait=True)
        if self._client is not None:
            try:
                self._client.close()
            except RuntimeError as exc:  # at interpreter exit the client's executor is gone
                log.debug("kvtierd client not closed cleanly: %s", exc)
            self._client = None
        if self._published is not None:
            self._published.unlink(missing_ok=True)

    def take_failed_block_ids(self) -> set[int]:
        """Blocks that failed loads left without their bytes since the last call."""
        with self._failed_lock:
            out, self._failed_block_ids = self._failed_block_ids, set()
        return out

    # -- engine thread ----------------------------------------------------------------------------
    def _submit(self, job_id: int, is_load: bool, chunks: list[Chunk],
                executor: ThreadPoolExecutor | None = None) -> bool:
        future = (executor or self._executor).submit(self._run, is_load, chunks)
        self._jobs.append(_Job(job_id, is_load, chunks, future, time.monotonic()))
        return True

    def _chunks(self, keys: list[bytes], gpu: GPULoadStoreSpec) -> list[Chunk]:
        return job_chunks(self.layout, keys, gpu.block_ids.tolist(), gpu.group_sizes,
                          gpu.block_indices)

    # -- job thread -------------------------------------------------------------------------------
    def _connected(self) -> KVTierClient | None:
        with self._connect_lock:
            return self._connect()

    def _connect(self) -> KVTierClient | None:
        if self._client is None and time.monotonic() >= self._down_until:
            try:
                # probe first: a client that cannot greet the daemon would leave its thread behind
                control.call(self.settings.address, Op.PING, timeout_s=self.settings.timeout_s)
                self._client = KVTierClient.connect(
                    self.settings.address, layout=self.layout, kv_caches=self._kv_caches,
                    timeout_s=self.settings.timeout_s, token=self.settings.token,
                    staging_bytes=self.settings.staging_bytes or None)
                log.info("kvtierd: worker rank %d connected to %s, namespace %s",
                         self.layout.rank, self.settings.address, self._client.namespace)
            except (RuntimeError, ConnectionError, OSError) as exc:  # down, refused, unreachable
                self._down_until = time.monotonic() + self.settings.retry_s
                log.warning("kvtierd at %s unavailable (%s); offloading paused for %g s",
                            self.settings.address, exc, self.settings.retry_s)
        return self._client

    def _run(self, is_load: bool, chunks: list[Chunk]) -> int:
        """Move the job's chunks; the bytes moved. Never raises: a failure is a miss."""
        client = self._connected()
        ok = [False] * len(chunks)
        if client is not None and chunks:
            try:
                if is_load and os.environ.get(DROP_BEFORE_LOAD_ENV) == "1":
                    client.delete(chunks)
                ok = (client.load if is_load else client.store)(chunks).result()
            except Exception:  # a bug must not kill the engine's step loop: log it, count it
                log.exception("kvtierd %s of %d chunk(s) failed", "load" if is_load else "store",
                              len(chunks))
            if client.session_id is None:  # the client gave up on the daemon: back off
                self._down_until = time.monotonic() + self.settings.retry_s
        failed = [c for c, hit in zip(chunks, ok) if not hit]
        if failed and is_load:
            self.load_failures += len(failed)
            with self._failed_lock:
                self._failed_block_ids.update(b for c in failed for b in c.block_ids if b >= 0)
            log.error("kvtierd: %d of %d chunk(s) could not be loaded; their blocks hold no valid "
                      "KV", len(failed), len(chunks))
        elif failed:
            self.store_failures += len(failed)
        return sum(c.nbytes for c, hit in zip(chunks, ok) if hit)

