"""The DCP StorageReader (``reader``) and what it delegates to: sub-box arithmetic and request
planning (``ranges``), fetching and checking blocks (``fetch``), raw box reads (``box_reads``),
reads shared across ranks (``shared_reads``), metadata read once (``read_once``), failing on every
rank together (``together``), the dtype conversion rule (``conversion``), safe object loading
(``safe_load``) and load buffers (``host_memory``)."""
