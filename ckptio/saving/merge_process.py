"""The merge of a large fragment set, in a process of its own (``merge_once``): ``python -m
ckptio.saving.merge_process`` reads what to merge from its standard input (pickled by the saving
process, which trusts it: it is its own), merges and commits as ``ckptio merge`` does, and exits 0 when
it committed, else with one of ``merge_once``'s statuses (the merge failed: logged on its stderr); any
other status means the saving process merges in a thread instead.
Nothing imports this module (runpy would warn): it runs only as the merge process's ``__main__``."""

from __future__ import annotations

import logging
import pickle
import sys


def main() -> int:
    from ckptio.errors import CheckpointError, MixedFragmentsError
    from ckptio.saving.commit import commit_merged
    from ckptio.saving.merge_once import CANNOT_OPEN, MERGE_FAILED, MIXED, NOT_COMMITTED
    from ckptio.storage import open_store

    logging.basicConfig(level=logging.WARNING, format="ckptio merge process: %(message)s")
    try:
        url, storage_options, storage_config, save_id = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 - ours
        store = open_store(url, storage_options, storage_config)
    except Exception:  # options of classes, or a filesystem, only the saving process knows: it merges itself
        return CANNOT_OPEN
    try:
        committed = commit_merged(store, save_id)
    except MixedFragmentsError:  # an overwrite's ranks have not all replaced their fragments yet
        return MIXED
    except CheckpointError as exc:  # a mixed or damaged set: every load refuses it by name as well
        logging.warning("the fragments at %s were not merged: %s", url, exc)
        return MERGE_FAILED
    except Exception as exc:  # a storage fault: loads merge the fragments themselves
        logging.warning("the fragments at %s were not merged (loads merge them): %r", url, exc)
        return MERGE_FAILED
    return 0 if committed is not None else NOT_COMMITTED


if __name__ == "__main__":
    sys.exit(main())
