"""The control plane's long-lived objects kept out of the cyclic garbage collector's walks.

Thousands of models make hundreds of thousands of objects that live as long as the process (10,000 models: about
460,000 tracked objects: their records, the store's catalog, parsed deployments). CPython's collector walks every
tracked object at each full collection, which the allocations of a listing or a sweep set off now and then: at
10,000 models a listing's statuses took 0.3-1.2 s with the collector on, about 0.2 s once they were frozen
(measured with `bench.scale_fake`'s repository, load average 3). So once many records have been made (the start's
backfill, a `serve --models` of a large folder, another node's publishes followed), they are frozen: moved to the
permanent generation, which no collection walks. Reference counting still frees them when they go; a record dropped
in a reference cycle stays (a few KiB a deleted model, only past ``FREEZE_AFTER_RECORDS``).
"""

from __future__ import annotations

import gc

# New model records since the last freeze that make the next sweep freeze what lives (below it the collector's walk
# is cheap, and a test process that starts many small control planes freezes nothing).
FREEZE_AFTER_RECORDS = 1000


def freeze_long_lived() -> None:
    """Collect first (the start's garbage would stay frozen), then freeze every object alive now. Blocking: about
    0.1-0.3 s at 10,000 models, once per ``FREEZE_AFTER_RECORDS`` new records."""
    gc.collect()
    gc.freeze()
