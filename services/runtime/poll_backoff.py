"""How often to look again for something that is usually there at once: a waiter that starts slowly and
looks every second would add up to a second to every start (a role waiting for its run at start-up), one
that looks every few milliseconds for minutes would load the service it asks. So: a first look after
`first_s`, each later one 1.5 times later, up to `most_s`."""

from __future__ import annotations

from typing import Iterator

FIRST_POLL_S = 0.05


def poll_intervals(most_s: float, first_s: float = FIRST_POLL_S) -> Iterator[float]:
    """Seconds to wait before each next look: first_s, growing by half each time, never over most_s."""
    interval = min(first_s, most_s)
    while True:
        yield interval
        interval = min(interval * 1.5, most_s)
