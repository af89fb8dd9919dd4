"""Nothing is imported behind a storage shard's first read: pyarrow's first numpy conversion imports pandas
(~170 ms, which blocked a shard's event loop mid-run), so services/transferqueue/wire_format.py makes it at
import time."""

import json
import subprocess
import sys
import textwrap


def test_the_first_numpy_conversion_after_the_wire_format_imports_nothing_new():
    code = textwrap.dedent("""
        import json, sys
        import numpy as np
        import pyarrow as pa
        from services.transferqueue.shard.store import ShardStore  # what `sluice tq-shard` imports
        before = set(sys.modules)
        pa.array(np.arange(5)).take(pa.array(np.array([4, 0, 2])))  # a non-contiguous read's conversions
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_without_the_warm_up_the_first_conversion_does_import(tmp_path):
    """The test above can fail: pyarrow alone still imports on its first numpy conversion."""
    code = textwrap.dedent("""
        import json, sys
        import numpy as np
        import pyarrow as pa
        before = set(sys.modules)
        pa.array(np.arange(5))
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) != []
