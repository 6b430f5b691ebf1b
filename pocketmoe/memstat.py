"""Process memory from /proc/self/status: peak RSS and the anonymous (non file-backed) part."""

from __future__ import annotations


def _status_kib() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0])
    except OSError:
        pass
    return out


class MemoryWatch:
    """Samples RssAnon when asked; `peak_anon_mib` is the largest sample, `peak_rss_mib` is VmHWM."""

    def __init__(self) -> None:
        self.peak_anon_kib = 0
        self.sample()

    def sample(self) -> None:
        self.peak_anon_kib = max(self.peak_anon_kib, _status_kib().get("RssAnon", 0))

    @property
    def peak_anon_mib(self) -> float:
        return self.peak_anon_kib / 1024

    @property
    def peak_rss_mib(self) -> float:
        status = _status_kib()
        return status.get("VmHWM", status.get("VmRSS", 0)) / 1024
