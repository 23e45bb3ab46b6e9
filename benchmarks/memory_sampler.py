"""A process's memory from Linux's /proc/self/status, for the benchmarks' child processes (which import this file
with the benchmarks folder on their path). The kernel keeps a high-water mark for VmRSS only (VmHWM), so `Peak`
samples the fields every 2 ms: RssAnon is what the process allocated, VmRSS that plus the file pages it mapped."""

from __future__ import annotations

import threading
import time


def status(keys=("RssAnon", "VmRSS")) -> dict[str, int]:
    """{field: bytes} of the /proc/self/status lines named in `keys`."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in keys:
                out[key] = int(line.split()[1]) * 1024
    return out


class Peak:
    """Started on creation: the largest value of each field until `stop()`, which returns them ({field: bytes})."""

    def __init__(self, keys=("RssAnon", "VmRSS")):
        self.keys, self.peak, self.done = keys, status(keys), threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self._sample()
            time.sleep(0.002)

    def _sample(self) -> None:
        self.peak = {k: max(v, self.peak[k]) for k, v in status(self.keys).items()}

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.thread.join()
        self._sample()
        return self.peak
