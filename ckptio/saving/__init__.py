"""The DCP StorageWriter (``writer``) and what it delegates to: who writes what (``planning``),
encoding a rank's data file (``data_file``), the cross-rank check of values saved under one key
(``consistency``), staging for async saves (``staging``, ``ordering``), the commit (``commit``),
and torch's save planner with a linear-time plan check (``planner``)."""
