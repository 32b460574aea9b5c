"""Start a multi-host jaxserve on loopback for the tests: `--nnodes N` processes of `scripts/serve.py`,
each with its own JAX_NUM_CPU_DEVICES, rank 0 serving HTTP on a free port."""

from __future__ import annotations

import os
import time
from pathlib import Path
from unittest import mock

from tests.server.conftest import ServerProcess, free_port


class LoopbackCluster:
    """Ranks 0..nnodes-1 (`ranks[0]` serves HTTP at `url`); `stop()` ends every process."""

    def __init__(self, nnodes: int, devices_per_rank: int, flags: list[str], log_dir: Path, name: str,
                 dist_timeout: int = 20, rank_flags: dict[int, list[str]] | None = None):
        self.coordinator = f"127.0.0.1:{free_port()}"
        common = ["--nnodes", str(nnodes), "--dist-init-addr", self.coordinator, "--dist-timeout", str(dist_timeout)]
        self.ranks: list[ServerProcess] = []
        try:
            # followers first: rank 0 is the one whose port the tests wait on
            for rank in reversed(range(nnodes)):
                extra = (rank_flags or {}).get(rank, [])
                with mock.patch.dict(os.environ, {"JAX_NUM_CPU_DEVICES": str(devices_per_rank)}):
                    self.ranks.insert(0, ServerProcess([*flags, *common, "--node-rank", str(rank), *extra],
                                                       log_dir / f"{name}_rank{rank}.log"))
        except BaseException:
            self.stop()
            raise
        self.url = self.ranks[0].url

    def wait_healthy(self, timeout: float) -> None:
        self.ranks[0].wait_healthy(timeout)

    def wait_exit(self, rank: int, timeout: float) -> int | None:
        """The exit status of `rank`, or None if it still runs after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (rc := self.ranks[rank].proc.poll()) is not None:
                return rc
            time.sleep(0.2)
        return None

    def stop(self) -> None:
        for p in self.ranks:
            if p.proc.poll() is None:
                p.proc.kill()
        for p in self.ranks:
            p.stop()
