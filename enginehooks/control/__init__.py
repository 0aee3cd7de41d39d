"""The control plane, trainer side: `WeightSync` (the one coordinator, for one sender or
several: `sync.py`, `senders.py`), engine handles, and the report a push returns."""
