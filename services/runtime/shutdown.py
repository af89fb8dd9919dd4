"""SIGTERM/SIGINT -> an asyncio event the service loop waits on, for a clean shutdown."""

from __future__ import annotations

import asyncio
import signal


def shutdown_event() -> asyncio.Event:
    """Must be called from inside the running loop."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event
