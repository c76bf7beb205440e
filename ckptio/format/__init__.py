"""ckptio's own bytes on disk, with no I/O: names and records (``records``), the rules every decoder
applies, format version 1/2's schema (``records``) and version 3's (``v3``, ``v3_decode``,
``stored_items``), checksums and compression (``codec``), chunk tiling (``chunks``), and the one
module that knows which version to write and how to read each (``versions``)."""
