"""GPU utilization as NVML measures it: a background thread samples every visible device.

NVML's utilization is the fraction of the last sample period in which a kernel ran, the
definition ``util/gpu`` uses everywhere; here it is measured, and the report says so
(``util/gpu_source: nvml``). Without a GPU (or without NVML) the sampler reports nothing
and the report keeps the span-based figure with ``util/gpu_source: spans``.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

log = logging.getLogger(__name__)


class NvmlSampler:
    """``with NvmlSampler() as s: ...`` then ``s.summary()``; inert where no GPU is visible."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.samples: list[list[tuple[float, float]]] = []  # per device: (util, memory used GB)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._handles: list = []
        self._nvml = None

    def __enter__(self) -> "NvmlSampler":
        try:
            import pynvml

            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # no driver, no device: nothing to measure
            log.debug("NVML unavailable: %s", exc)
            return self
        if n == 0:
            return self
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        self.samples = [[] for _ in range(n)]
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.wait(self.period_s):
            for i, h in enumerate(self._handles):
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
                mem = nv.nvmlDeviceGetMemoryInfo(h).used / 1e9
                self.samples[i].append((util, mem))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._nvml.nvmlShutdown()

    def summary(self) -> Optional[dict]:
        """``util/gpu`` (mean over devices and time), per-device means and peak memory; None
        if nothing was measured."""
        if not self.samples or not any(self.samples):
            return None
        out: dict = {"util/gpu_source": "nvml"}
        means = []
        for i, rows in enumerate(self.samples):
            if not rows:
                continue
            u = sum(r[0] for r in rows) / len(rows)
            means.append(u)
            out[f"util/gpu{i}"] = u
            out[f"util/gpu{i}_memory_peak_gb"] = max(r[1] for r in rows)
        out["util/gpu"] = sum(means) / len(means)
        out["util/gpu_samples"] = sum(len(r) for r in self.samples)
        return out
