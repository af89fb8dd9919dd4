"""An asyncio event loop on a thread of its own, and blocking facades over async clients built on it.

Each client has one implementation, its asyncio core; the blocking class every thread-based role uses is a
thin layer that runs the core's coroutines on the loop thread and waits for them. Nothing of a client's
wire API is written twice."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Generic, Iterable, TypeVar, cast

try:
    import uvloop
except ImportError:  # not on every platform: asyncio's own loop then
    uvloop = None  # type: ignore[assignment]  # a module or None, tested below


class LoopThread:
    """A running event loop (uvloop, as the services use) on a daemon thread."""

    def __init__(self, name: str):
        self.loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine) -> Any:
        """Run coro on the loop and wait for its result (or exception) in the calling thread."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking call from the client's own event loop would wait forever")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


Core = TypeVar("Core")


class BlockingFacade(Generic[Core]):
    """Base of a blocking client: its asyncio `core` runs on a private `loop_thread`. Subclasses get their
    methods from `blocking_methods`; `aio` awaits the same calls from another event loop."""

    def __init__(self, core: Core, thread_name: str):
        self.loop_thread = LoopThread(thread_name)
        self.core: Any = core  # its calls are typed through the facade's methods and `aio`

    @property
    def aio(self) -> Core:
        """The core's coroutine methods, awaited from another event loop (a service's own): each runs on this
        client's loop thread, where its connections live, so one client serves a role's threads and its asyncio
        code alike, and no worker thread is held waiting for a reply. Only coroutine methods are reachable."""
        return cast(Core, _Awaited(self.core, self.loop_thread.loop))

    if TYPE_CHECKING:  # the methods blocking_methods adds at import, which a type checker cannot see

        def __getattr__(self, name: str) -> Any: ...

    def close(self) -> None:
        if not self.loop_thread.loop.is_closed():
            self.loop_thread.run(self.core.close())
            self.loop_thread.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Awaited:
    def __init__(self, core: Any, loop: asyncio.AbstractEventLoop):
        self._core, self._loop = core, loop

    def __getattr__(self, name: str) -> Callable[..., Coroutine]:
        method = getattr(self._core, name)

        async def call(*args, **kwargs):
            # a cancelled await cancels the call on the client's loop too (asyncio chains the two futures)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(method(*args, **kwargs), self._loop))

        return call


def blocking_methods(async_cls: type, names: Iterable[str] | None = None) -> Callable[[type], type]:
    """Class decorator: for each coroutine method of async_cls named (default: every public one but close,
    which BlockingFacade has), a blocking method of the same name and signature that runs it on
    `self.loop_thread` against `self.core` (an async_cls instance)."""
    if names is None:
        names = [
            n
            for n, f in vars(async_cls).items()
            if not n.startswith("_") and n != "close" and asyncio.iscoroutinefunction(f)
        ]

    def add(cls: type) -> type:
        for name in names:
            method = getattr(async_cls, name)
            if not asyncio.iscoroutinefunction(method):
                raise TypeError(f"{async_cls.__name__}.{name} is not a coroutine function")
            setattr(cls, name, _blocking(name, method))
        return cls

    return add


def _blocking(name: str, method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return self.loop_thread.run(getattr(self.core, name)(*args, **kwargs))

    return call
