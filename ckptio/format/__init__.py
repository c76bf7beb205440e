"""ckptio 1.0's bytes on disk, with no I/O: the metadata document's one way in and out (``document``:
``tables``, ``encode``, ``decode``, ``view``, ``merge`` of fragments), its vocabulary (``names``), records
(``records``), columns (``columns``) and rules (``rules``, ``chunks``), and the data blocks' checksums and
compression (``codec``). 0.x's checkpoints are read by ``ckptio.legacy``."""
