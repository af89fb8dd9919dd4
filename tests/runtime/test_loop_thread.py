"""A blocking facade's `aio` (services/runtime/loop_thread.py): its core's calls awaited from another event loop run
on the facade's own loop thread, where the core's connections live, and return or raise as the core does."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.runtime.loop_thread import BlockingFacade, blocking_methods


class Core:
    async def where(self) -> str:
        return threading.current_thread().name

    async def fail(self) -> None:
        raise ValueError("refused")

    async def close(self) -> None:
        pass


@blocking_methods(Core)
class Client(BlockingFacade[Core]):
    def __init__(self) -> None:
        super().__init__(Core(), "core-thread")


def test_aio_awaits_the_core_on_the_facades_own_loop_thread():
    with Client() as client:

        async def main():
            return await client.aio.where(), client.where()

        awaited, blocking = asyncio.run(main())
        assert awaited == blocking == "core-thread"
        with pytest.raises(ValueError, match="refused"):
            asyncio.run(client.aio.fail())
