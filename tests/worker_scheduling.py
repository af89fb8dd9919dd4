"""How `./dev test` hands tests to its pytest-xdist workers: one test at a time to whichever worker is free, in
collection order, except the modules marked `one_worker`, whose tests all go to one worker, longest first.

Those modules share a costly module-scoped fixture (an engine started, a pool of trainer ranks run once): with
their tests split between two workers each worker started the fixture for itself (CPU spent twice), or, for a
pool made once per run (tests/trainer/rank_pool.py made_once), one worker waited idle on the other's lock.
xdist's own `xdist_group` mark would say the same, but xdist 3.8 under pytest 9 no longer groups by it (it
rewrites a node id pytest no longer reads), and `--dist loadscope` groups every module, which overlapped the
end-to-end tests more heavily and made the suite slower (docs/performance.md)."""

from __future__ import annotations

import pathlib

from xdist.scheduler import LoadScopeScheduling

MARK = "mark.one_worker"


class OneWorkerModules(LoadScopeScheduling):
    """LoadScopeScheduling whose scope is the module for modules marked one_worker, the test itself otherwise.
    (Its reordering, by tests per scope, puts the grouped modules first; single tests keep their order.)"""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self._root = pathlib.Path(str(config.rootpath))
        self._marked: dict[str, bool] = {}

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        if module not in self._marked:
            path = self._root / module
            self._marked[module] = path.suffix == ".py" and path.is_file() and MARK in path.read_text()
        return module if self._marked[module] else nodeid
