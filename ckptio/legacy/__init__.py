"""Checkpoints of ckptio 0.x (format versions 1 to 7), kept apart from the 1.0 format: read into the same
``Manifest`` a 1.0 document gives, so that they load (``reader``); nothing writes them but the tests of
this reader. ``ckptio.format.document`` hands a document of a version below 8 here; nothing else of
ckptio imports this package."""

#: The newest 0.x format version.
NEWEST = 7
#: The first format version whose data files may sit under spread key prefixes.
SPREAD_KEYS_VERSION = 5
#: The format version of a rank's fragment of a save without a coordinator (its tensors table may hold
#: a key's one chunk that is part of the tensor: the ``boxed`` column).
FRAGMENT_VERSION = 6
#: The first format version whose items may be stored in a sibling checkpoint's data files (incremental
#: saves) and whose blocks may carry a content digest (``digests``).
INCREMENTAL_VERSION = 7
