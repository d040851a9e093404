"""EngineCoreActor: an engine core run as a Ray actor (`--data-parallel-backend ray`).

Ray places it on a node of the cluster; it serves exactly as the `enginecore.proc` process
does, over tcp sockets the frontend bound (`protocol.wire.TcpAddresses`), with its workers'
ipc sockets in a directory of its own node. `run` blocks for the core's whole life and
returns when the core stops; the frontend watches that call to learn of the core's death
(or its node's).
"""

from __future__ import annotations

import logging
import os

import msgspec

from vllm_actors.config import EngineConfig
from vllm_actors.enginecore.proc import serve
from vllm_actors.protocol.wire import TcpAddresses


class EngineCoreActor:
    def __init__(self) -> None:
        self.directory = ""

    def run(self, addresses: TcpAddresses, config: bytes) -> bool:
        """Serve until Shutdown or a fatal error (the frontend was told); False after one."""
        logging.basicConfig(level=logging.INFO, format="(EngineCore) %(levelname)s %(message)s")
        local = addresses.with_local_directory()
        self.directory = local.directory
        try:
            return serve(local, None, msgspec.msgpack.decode(config, type=EngineConfig))
        finally:
            local.remove()

    def where(self) -> dict[str, object]:
        """This actor's process, node and ipc directory (answered while `run` serves)."""
        import ray
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "directory": self.directory}
