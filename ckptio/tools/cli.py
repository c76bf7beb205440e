"""``ckptio inspect | verify | convert | bench``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from ckptio.errors import CheckpointError


def _storage_options(args: argparse.Namespace) -> dict:
    options = json.loads(args.storage_options) if args.storage_options else {}
    if getattr(args, "endpoint_url", None):
        if str(getattr(args, "url", "")).startswith(("gs://", "gcs://")):
            options["endpoint_url"] = args.endpoint_url  # gcsfs's own option
        else:
            options.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
    return options


def check_output(output: str, *, is_directory: bool) -> None:
    """Refuse, before any work is done, a local output the command could not write: a file whose
    directory does not exist, or a path of the other kind (file for directory). Remote URLs are
    checked by the store when written."""
    if "://" in output and not output.startswith("file://"):
        return
    path = os.path.abspath(output.removeprefix("file://"))
    if is_directory:
        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(f"output {output} exists and is not a directory; name a directory to write into")
        return
    if os.path.isdir(path):
        raise CheckpointError(f"output {output} is a directory; name the file to write, e.g. {output}/model.pt")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise CheckpointError(f"the directory of output {output} ({parent}) does not exist; create it first")


def _local_tier(args: argparse.Namespace) -> str | None:
    """``--local-tier``, else ``CKPTIO_LOCAL_TIER``."""
    return args.local_tier or os.environ.get("CKPTIO_LOCAL_TIER") or None


def cmd_inspect(args: argparse.Namespace) -> int:
    from ckptio.tools.inspection import describe, format_description

    desc = describe(args.url, _storage_options(args), local_tier=_local_tier(args))
    print(json.dumps(desc, indent=2) if args.json else format_description(desc))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ckptio.tools.cleanup import orphaned_files
    from ckptio.tools.inspection import every_item, open_checkpoint
    from ckptio.tools.verify import verify

    store, manifest = open_checkpoint(args.url, _storage_options(args))
    items = every_item(manifest)
    total = sum(item.stored_bytes for _, item in items)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=args.quiet) as bar:
        problems = verify(store, manifest, progress=bar.update)
    orphans = orphaned_files(store, manifest)
    if orphans:
        print(
            f"note: {len(orphans)} data file(s) here belong to saves that never committed and are never read; "
            f"safe to delete: {', '.join(orphans)} (ckptio gc --delete removes them)"
        )
    uploads = store.open_uploads()
    if uploads:
        print(f"note: {len(uploads)} unfinished multipart upload(s) here; ckptio gc --delete aborts them")
    if problems:
        print(f"{args.url}: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  BAD {problem}", file=sys.stderr)
        return 1
    print(f"{args.url}: OK, {len(items)} items in {len(manifest.files)} files, every checksum matches")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    if _local_tier(args):
        return _gc_local_tier(args, _local_tier(args))
    from ckptio.format.names import parse_fragment_name
    from ckptio.storage import open_store
    from ckptio.tools.cleanup import collect_garbage, find_garbage

    store = open_store(args.url, _storage_options(args))
    garbage = find_garbage(store)
    for name in garbage.files:
        kind = "orphaned fragment  " if parse_fragment_name(name) else "orphaned data file "
        print(f"{kind}  {store.describe(name)}")
    for name, upload_id in garbage.uploads:
        print(f"unfinished upload    {store.describe(name)}  (upload id {upload_id})")
    if not garbage.files and not garbage.uploads:
        print(f"{args.url}: nothing left over by saves that never committed")
    elif args.delete:
        failed = collect_garbage(store, garbage)
        removed = len(garbage.files) + len(garbage.uploads) - len(failed)
        print(f"removed {removed} of {len(garbage.files)} file(s) and {len(garbage.uploads)} upload(s)")
        for what, cause in failed.items():
            print(f"could not remove {what}: {cause}", file=sys.stderr)
        if failed:
            print(
                f"{len(failed)} left over: fix the cause (permissions: s3:DeleteObject and s3:AbortMultipartUpload) "
                "and run ckptio gc --delete again",
                file=sys.stderr,
            )
            return 1
    else:
        print("run again with --delete to remove them (only while no save to this location is running)")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from ckptio.saving.commit import commit_merged
    from ckptio.storage import open_store

    store = open_store(args.url, _storage_options(args))
    files = commit_merged(store)
    if files is None:
        print(f"{args.url} already has its ckptio.json: nothing to merge")
    else:
        print(f"{args.url}: merged its fragments into ckptio.json ({len(files)} data file(s))")
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    from ckptio.storage import open_store
    from ckptio.tools.upgrade import upgrade

    done = upgrade(open_store(args.url, _storage_options(args)), write=not args.check)
    if done.document is None:
        print(f"{args.url} is already in ckptio 1.0's format (version {done.old_version}): nothing to do")
    else:
        verb = "would get" if args.check else "now has"
        print(
            f"{args.url}: format version {done.old_version} ({done.old_bytes:,} bytes) {verb} ckptio 1.0's metadata "
            f"({len(done.document):,} bytes), proven to describe the same items; its data files are untouched"
        )
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from ckptio.storage import open_store
    from ckptio.tools.cleanup import checkpoint_format, delete_checkpoint

    store = open_store(args.url, _storage_options(args))
    if checkpoint_format(store) != "ckptio" and not args.force:
        print(f"{args.url} holds no committed ckptio checkpoint; pass --force to remove what is there", file=sys.stderr)
        return 1
    kept = delete_checkpoint(store)
    print(
        f"deleted {args.url}"
        + (f"; kept {len(kept)} data file(s) that incremental checkpoints beside it use" if kept else "")
    )
    return 0


def _gc_local_tier(args: argparse.Namespace, local_tier: str) -> int:
    from ckptio.config import WriterConfig
    from ckptio.tools.tier_status import node_steps, remove_node_steps

    keep = WriterConfig(local_tier=local_tier).local_tier_keep if args.keep is None else args.keep
    if keep < 1:
        raise ValueError(f"--keep must be at least 1, got {keep}")
    steps = node_steps(args.url, local_tier, _storage_options(args), keep)
    if not steps:
        print(f"{local_tier}: holds no step of the run {args.url}")
        return 0
    width = max(len(s.step) for s in steps)
    for s in steps:
        verdict = "removable" if s.removable else "kept     "
        ranks = f"ranks {','.join(map(str, s.ranks))}" if s.ranks else "no rank's files"
        print(f"{s.step.ljust(width)}  {_mib(s.size):>10}  {verdict}  {ranks}; {s.why}")
    removable = [s for s in steps if s.removable]
    if not removable:
        print(f"nothing to remove (the newest {keep} and every step not yet on the durable tier are kept)")
    elif args.delete:
        failed = remove_node_steps(removable)
        print(f"removed {len(removable) - len(failed)} of {len(removable)} step(s) from {local_tier}")
        for path, cause in failed.items():
            print(f"could not remove {path}: {cause}", file=sys.stderr)
        return 1 if failed else 0
    else:
        print("run again with --delete to remove them (only while no save of this run is running on this node)")
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def cmd_latest(args: argparse.Namespace) -> int:
    from ckptio.tiers.latest import latest

    url = latest(args.url, local_tier=_local_tier(args), storage_options=_storage_options(args), resume=False)
    if url is None:
        print(f"{args.url}: no committed ckptio checkpoint under it", file=sys.stderr)
        return 1
    print(url)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    check_output(args.output, is_directory=args.format != "torch")
    if args.format == "safetensors":
        import time

        from ckptio.hf.export import export_safetensors

        started = time.monotonic()
        written = export_safetensors(
            args.url,
            args.output,
            keys=args.keys,
            max_shard_size=args.max_shard_size,
            storage_options=_storage_options(args),
        )
        took = time.monotonic() - started
        print(f"wrote {len(written)} safetensors shard(s) and the index to {args.output} in {took:.1f}s")
        return 0
    if args.format == "ckptio":
        from ckptio.tools.convert import from_torch_dcp

        keys = from_torch_dcp(args.url, args.output, storage_options=_storage_options(args))
        print(f"wrote the ckptio checkpoint {args.output} with {keys} top-level keys")
        return 0
    from ckptio.tools.convert import to_torch_save

    keys = to_torch_save(args.url, args.output, storage_options=_storage_options(args))
    print(f"wrote {args.output} with {keys} keys")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptio", description="PyTorch distributed checkpoints on S3 and shared filesystems"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_url(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("url", help="checkpoint location (path, file://, s3://, memory://...)")
        p.add_argument("--storage-options", help="fsspec storage_options as JSON")
        p.add_argument(
            "--endpoint-url", help="S3-compatible or GCS endpoint (client_kwargs.endpoint_url; gcsfs's endpoint_url)"
        )
        return p

    p = with_url(sub.add_parser("inspect", help="show what a checkpoint holds"))
    p.add_argument(
        "--json", action="store_true", help="machine-readable output, with the metadata as a JSON object per item"
    )
    p.add_argument(
        "--local-tier",
        help="also show this node's fast-tier copy of a tiered checkpoint (default: CKPTIO_LOCAL_TIER); a "
        "checkpoint not yet committed on the durable tier is described from the node's copy",
    )
    p.set_defaults(func=cmd_inspect)
    p = with_url(sub.add_parser("verify", help="read every block and check every checksum"))
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)
    p = with_url(sub.add_parser("gc", help="list (or --delete) files and uploads of saves that never committed"))
    p.add_argument("--delete", action="store_true", help="delete the files and abort the uploads")
    p.add_argument(
        "--local-tier",
        help="instead, this node's fast tier (default: CKPTIO_LOCAL_TIER): URL then names the run (the folder of "
        "steps, as for ckptio.latest); lists each step held here and removes (--delete) those safe to go",
    )
    p.add_argument(
        "--keep", type=int, help="with --local-tier: newest steps to keep (default: CKPTIO_LOCAL_TIER_KEEP, else 2)"
    )
    p.set_defaults(func=cmd_gc)
    p = with_url(
        sub.add_parser(
            "latest",
            help="print the newest committed checkpoint under a run folder (exit 1 if none), as ckptio.latest finds it",
        )
    )
    p.add_argument(
        "--local-tier",
        help="also this node's fast tier (default: CKPTIO_LOCAL_TIER): a newer step held whole here is the answer, "
        "and its unfinished drain is completed before the command exits (run it while no job of this run runs here)",
    )
    p.set_defaults(func=cmd_latest)
    p = with_url(
        sub.add_parser(
            "delete",
            help="delete a checkpoint (its commit first); data files that incremental checkpoints beside it "
            "reference stay until the last of those is deleted",
        )
    )
    p.add_argument("--force", action="store_true", help="also where no committed ckptio checkpoint is found")
    p.set_defaults(func=cmd_delete)
    p = with_url(
        sub.add_parser(
            "merge",
            help="write the ckptio.json of a checkpoint saved without a coordinator (dcp.save(..., "
            "use_collectives=False)) from its ranks' fragments, so that loads read one document",
        )
    )
    p.set_defaults(func=cmd_merge)
    p = with_url(
        sub.add_parser(
            "upgrade",
            help="give a checkpoint of ckptio 0.x 1.0's metadata (data files untouched), once the new document is "
            "proven to describe the same items; ckptio 0.x can no longer read it afterwards",
        )
    )
    p.add_argument("--check", action="store_true", help="prove the new metadata only; write nothing")
    p.set_defaults(func=cmd_upgrade)
    p = with_url(
        sub.add_parser(
            "convert",
            help="write a torch.save file or Hugging Face safetensors shards; or (--format ckptio) rewrite a "
            "torch DCP checkpoint as a ckptio one",
        )
    )
    p.add_argument("output", help="the .pt file, the directory for --format safetensors, the new checkpoint for ckptio")
    p.add_argument("--format", choices=("torch", "safetensors", "ckptio"), default="torch")
    p.add_argument("--keys", help="safetensors: export only keys under this prefix (e.g. 'model.'), prefix removed")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors: largest shard (default 5GB)")
    p.set_defaults(func=cmd_convert)
    # Listed for --help only: main() hands "bench ..." to the benchmark's own parser.
    sub.add_parser("bench", help="benchmark ckptio against torch's writers (see ckptio bench --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from ckptio.bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (CheckpointError, OSError, ValueError) as exc:  # ValueError: e.g. --storage-options is not JSON
        return _error(str(exc))
    except Exception as exc:  # noqa: BLE001 - the promise: one line and exit 2, whatever failed
        if args.verbose:
            traceback.print_exc()
        return _error(f"{type(exc).__name__}: {exc} (ckptio -v {args.command} ... shows the traceback)")


def _error(message: str) -> int:
    print(f"ckptio: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
