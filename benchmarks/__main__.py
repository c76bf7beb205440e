"""``python -m benchmarks`` / ``ckptio bench``: ckptio against torch's writers, side by side.

With no target it benchmarks a temporary directory and an S3 server (moto) it starts on
127.0.0.1 itself, so it runs anywhere without an account.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time

from . import lagging, report, usage_error, workload
from .launch import launch
from .writers import WRITERS, select


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    text = args.plan_tensors.strip().lower()
    try:
        args.plan_tensors = [] if text in ("", "none", "0") else [int(n) for n in text.split(",")]
    except ValueError:
        usage_error(f"--plan-tensors takes counts separated by commas, e.g. 100,10000; got {text!r}")
    if args.async_saves < 0 or any(n < 1 for n in args.plan_tensors):
        usage_error("--async-saves and --plan-tensors take counts of at least 0 and 1")
    try:
        args.replicas, args.shards = (int(x) for x in args.mesh.lower().split("x"))
    except ValueError:
        usage_error(f"--mesh takes REPLICASxSHARDS, e.g. 2x2; got {args.mesh!r}")
    if args.replicas < 1 or args.shards < 1 or args.replicas * args.shards != args.ranks:
        usage_error(f"--mesh {args.mesh} has {args.replicas * args.shards} ranks but --ranks is {args.ranks}")
    # Outputs and inputs are checked now, not after minutes of benchmarking.
    for flag, value in (("--out", args.out), ("--path", args.path)):
        if value and os.path.exists(value) and not os.path.isdir(value):
            usage_error(f"{flag} {value} exists and is not a directory")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        usage_error(f"cannot create --out {args.out}: {exc}")
    if args.compare and not os.path.isfile(args.compare):
        usage_error(f"--compare {args.compare} is not a file (give a results .json of an earlier run)")
    if args.scale:
        from .scale import parse_points

        args.scale = parse_points(args.scale)
    if args.compressible:
        args.data = "bf16-in-fp32"
    return args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptio bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4, help="processes to spawn (default 4)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="where the state lives (default: cuda when available); NCCL when there is a GPU per rank, else gloo",
    )
    p.add_argument("--mesh", default="2x2", help="replicate x shard mesh, e.g. 2x2 (default), 1x4, 4x1")
    p.add_argument("--size", default="256MiB", help="total state size: model + 2 Adam moments (default 256MiB)")
    p.add_argument("--repeats", type=int, default=1, help="saves/loads per writer and target (median reported)")
    p.add_argument(
        "--data",
        choices=workload.DATA_KINDS,
        default="randn",
        help="what the tensors hold: randn (fp32, default), bf16-in-fp32 (compress ~2x), bf16-weights "
        "(bf16 weights, fp32 Adam moments), adam-moments (a trained state: bf16 weights 0.02 N(0,1), exp_avg "
        "1e-3 N(0,1), exp_avg_sq its square, a step tensor per parameter), random-bytes (incompressible), "
        "transformer (adam-moments' values in a hidden-512 transformer's ~200 tensors of many shapes)",
    )
    p.add_argument("--compressible", action="store_true", help="same as --data bf16-in-fp32")
    p.add_argument("--writers", nargs="+", help=f"subset of: {', '.join(w.name for w in WRITERS)}")
    p.add_argument("--compressed", action="store_true", help="also run ckptio's zstd variants")
    p.add_argument("--path", help="local or NFS directory to benchmark")
    p.add_argument("--s3", help="s3://bucket/prefix to benchmark (standard AWS credentials)")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for --s3")
    p.add_argument(
        "--target",
        action="append",
        default=[],
        help="a further store to benchmark, repeatable: gcs, azure or moto (fake-gcs-server, Azurite or the "
        "embedded S3 server, started on 127.0.0.1 by this run), or a gs://bucket/prefix or "
        "az://container/prefix URL (credentials: --storage-options, else Application Default Credentials / "
        "DefaultAzureCredential). With --target alone, the local and moto defaults do not run",
    )
    p.add_argument("--storage-options", help="fsspec storage_options as JSON, for --target URLs")
    p.add_argument(
        "--radosgw",
        action="store_true",
        help="also benchmark a Ceph radosgw this run starts on 127.0.0.1 (a one-node in-memory cluster; Debian "
        "packages radosgw ceph-mon ceph-osd, `make radosgw`)",
    )
    p.add_argument("--out", default="bench-results", help="directory for JSON, Markdown and charts")
    p.add_argument(
        "--shared-reads",
        action="store_true",
        help="also load each ckptio checkpoint on the saved mesh, Wx1 and 1xW with dedup_reads False/True/auto "
        "(torch FsspecWriter's with torch's reader): load time, bytes served, GETs",
    )
    p.add_argument(
        "--async-saves",
        type=int,
        default=8,
        metavar="N",
        help="on the local/NFS target, N consecutive dcp.async_save calls per writer, stager and executor "
        "with a training-step loop running beside them: blocking time, steps/s, host memory (default 8; 0: skip)",
    )
    p.add_argument(
        "--tiered",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on each S3 target, tiered saves (a node-local fast tier drained to S3) against direct and local-only "
        "saves: blocking time (sync and dcp.async_save), drain time and training speed during it, restart load "
        "from the fast tier vs from S3, S3 bytes with one rank's fast tier emptied (default on; --no-tiered skips)",
    )
    p.add_argument(
        "--tiered-lagging",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --tiered: tiered incremental saves of a LoRA-shaped state (48MiB, or --size if smaller) about "
        "1 s apart, the drain limited to half the rate full saves would need and unlimited: bytes uploaded per save "
        "against bytes changed, saves waiting to upload, every step loaded bit-exact from S3 (default on)",
    )
    p.add_argument(
        "--lagging-saves",
        type=int,
        default=20,
        help="with --tiered-lagging: saves per run (default 20)",
    )
    p.add_argument(
        "--incremental",
        action="store_true",
        help="on every target, incremental saves (WriterConfig.incremental_from) beside full saves of three states: "
        "a LoRA-shaped fine-tune (frozen bf16 base, 5%% trainable), a sparse embedding table (1%% of rows change) "
        "and a full training step (everything changes): bytes and objects written, save and load time, CPU",
    )
    p.add_argument(
        "--incremental-states",
        default="lora,sparse,full",
        help="with --incremental: which states (default lora,sparse,full)",
    )
    p.add_argument(
        "--incremental-depth",
        type=int,
        default=4,
        help="with --incremental: the chain's bound, the depth of the link loaded beside a full save (default 4); "
        "also the saves in a row whose memory is followed, plus 2",
    )
    p.add_argument(
        "--all-stagers",
        action="store_true",
        help="async section: also ckptio + ckptio.Stager and ckptio + torch's DefaultStager (default: ckptio's "
        "plain call and torch FileSystemWriter)",
    )
    p.add_argument(
        "--plan-tensors",
        default="none",
        help="plan time of save 1 vs saves 2+ (torch's plan cache on) for states of these many small tensors, "
        "e.g. 100,10000 (default: skipped)",
    )
    p.add_argument(
        "--scale",
        metavar="RANKS[:LAYERS],...",
        help="also simulate the coordinator (global plan, finish, metadata decode) and the metadata size for "
        "Llama-70B-like plans of this many ranks (LAYERS of its 80 layers, default all), HSDP/FSDP/FSDP+TP, "
        "ckptio and torch's FileSystemWriter; e.g. 1024:8,8192:1 (off by default: minutes, GiBs of memory)",
    )
    p.add_argument("--compare", help="a previous results.json: show deltas")
    p.add_argument("--no-charts", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written (default: delete each after use)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the ranks' warnings and logs here as they come (default: in bench-<time>.log beside the results)",
    )
    return p


@contextlib.contextmanager
def targets_for(args: argparse.Namespace):
    """Yield the target list; the embedded default starts (and stops) its own S3 server."""
    run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    with contextlib.ExitStack() as stack:
        targets = []
        defaults = not (args.s3 or args.path or args.target)
        if args.path or defaults:
            base = args.path or stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptio-bench-"))
            targets.append(
                {"name": "local", "kind": "local", "base": os.path.join(base, run_id), "embedded": not args.path}
            )
        if args.s3:
            options = {"client_kwargs": {"endpoint_url": args.endpoint_url}} if args.endpoint_url else {}
            targets.append(
                {
                    "name": "s3",
                    "kind": "s3",
                    "base": f"{args.s3.rstrip('/')}/{run_id}",
                    "storage_options": options,
                    "embedded": False,
                }
            )
        if args.radosgw:
            targets.append(_radosgw_target(stack, run_id))
        targets += [_store_target(stack, args, target, run_id) for target in args.target if target != "moto"]
        if defaults or "moto" in args.target:
            targets.append(_moto_target(stack, run_id))
        yield targets


def _moto_target(stack: contextlib.ExitStack, run_id: str) -> dict:
    """The embedded S3 server (moto, in a thread of this process)."""
    from .s3server import create_bucket, local_s3_server, use_test_credentials

    endpoint = stack.enter_context(local_s3_server())
    use_test_credentials()
    create_bucket(endpoint, "ckptio-bench")
    return {
        "name": "s3 (moto)",
        "kind": "s3",
        "base": f"s3://ckptio-bench/{run_id}",
        "storage_options": {"client_kwargs": {"endpoint_url": endpoint}},
        "embedded": True,
        "server_pids": [os.getpid()],  # moto serves from a thread of this process
    }


def _store_target(stack: contextlib.ExitStack, args: argparse.Namespace, target: str, run_id: str) -> dict:
    """``--target``: an emulator this run starts (``gcs``, ``azure``), or a bucket's URL."""
    from . import emulators

    kinds = {"gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
    if "://" in target:
        kind = kinds.get(target.partition("://")[0])
        if kind is None:
            usage_error(f"--target {target}: a gs:// or az:// URL, or gcs or azure (the emulators)")
        options = json.loads(args.storage_options) if args.storage_options else {}
        base = f"{target.rstrip('/')}/{run_id}"
        return {"name": kind, "kind": kind, "base": base, "storage_options": options, "embedded": False}
    try:
        if target == "gcs":
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # gcsfs 2026.10 probes a new bucket
            endpoint = stack.enter_context(emulators.local_gcs_server())
            emulators.create_gcs_bucket(endpoint, "ckptio-bench")
            options, name, url = emulators.gcs_options(endpoint), "gcs (fake-gcs-server)", "gs://ckptio-bench"
        elif target == "azure":
            connection_string = stack.enter_context(emulators.local_azure_server())
            emulators.create_azure_container(connection_string, "ckptio-bench")
            options, name, url = emulators.azure_options(connection_string), "azure (Azurite)", "az://ckptio-bench"
        else:
            usage_error(f"--target {target}: gcs, azure, moto, or a gs:// or az:// URL")
    except emulators.Unavailable as exc:
        usage_error(f"--target {target}: {exc}")
    return {"name": name, "kind": target, "base": f"{url}/{run_id}", "storage_options": options, "embedded": True}


def _radosgw_target(stack: contextlib.ExitStack, run_id: str) -> dict:
    from . import radosgw

    try:
        gateway = radosgw.start()
    except radosgw.Unavailable as exc:
        usage_error(f"--radosgw: {exc}")
    stack.callback(gateway.stop)
    gateway.create_bucket("ckptio-bench")
    return {
        "name": "s3 (radosgw)",
        "kind": "s3",
        "base": f"s3://ckptio-bench/{run_id}",
        "storage_options": gateway.storage_options,
        "embedded": True,
        "server_pids": [p.pid for p in gateway.processes],  # monitor, OSD and gateway
    }


def run(args: argparse.Namespace) -> dict:

    replicas, shards = args.replicas, args.shards
    chosen = select(args.writers, args.compressed)
    writers = [w.name for w in chosen]
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device == "cuda" and torch.cuda.device_count() >= args.ranks else "gloo"
    size_bytes = workload.parse_size(args.size)
    with targets_for(args) as targets, tempfile.TemporaryDirectory() as scratch:
        progress_file = os.path.join(scratch, "progress")
        cfg = {
            "device": device,
            "keep": args.keep,
            "size_bytes": size_bytes,
            "mesh": [replicas, shards],
            "data": args.data,
            "writers": writers,
            "writer_targets": {w.name: w.targets for w in chosen},
            "repeats": args.repeats,
            "targets": targets,
            "progress_file": progress_file,
            "shared_reads": args.shared_reads,
        }
        steps = sum(args.repeats for t in targets for w in chosen if t["kind"] in w.targets)
        from . import runner

        records = _spawn_with_progress(args, runner.run_rank, cfg, progress_file, steps, backend)
        raw = report.raw_bandwidth([r for r in records if "raw_bandwidth" in r])
        records = [r for r in records if "raw_bandwidth" not in r]
        by_state = {args.data: records}
        training_state = _training_state_pass(args, cfg, chosen, targets)
        if training_state is not None:
            state_cfg, state_steps = training_state
            state_records = _spawn_with_progress(args, runner.run_rank, state_cfg, progress_file, state_steps, backend)
            by_state[state_cfg["data"]] = [r for r in state_records if "raw_bandwidth" not in r]
        async_rows, plan_rows = _async_and_plan_sections(args, cfg, targets, progress_file, backend)
        tiered_rows, lagging_rows = _tiered_section(args, cfg, targets, progress_file, backend)
        incremental_rows = _incremental_section(args, cfg, targets, progress_file, backend)
        listings = {r["url"]: r["listing"] for rows in by_state.values() for r in rows if "listing" in r}
        results = []
        for data, rows in by_state.items():  # each state's byte counts are its own
            sizes = workload.byte_counts(workload.tensor_specs(size_bytes, data), (replicas, shards), data)
            results += report.summarize(rows, listings, args.ranks, sizes)
        shared_reads = report.shared_reads(records, listings)
    import torch

    import ckptio

    return {
        "schema_version": report.SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "versions": {"ckptio": ckptio.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.machine()},
        "config": {
            "ranks": args.ranks,
            "device": device,
            "backend": backend,
            "mesh": [replicas, shards],
            "size_bytes": size_bytes,
            "data": args.data,
            "compressible": args.data == "bf16-in-fp32",
            "repeats": args.repeats,
            "writers": writers,
            "writer_targets": {w.name: w.targets for w in chosen},
            "targets": [{k: v for k, v in t.items() if k != "storage_options"} for t in targets],
        },
        "results": results,
        "raw_bandwidth": raw,
        "shared_reads": shared_reads,
        "async_saves": async_rows,
        "tiered": tiered_rows,
        "tiered_lagging": lagging_rows,
        "incremental": incremental_rows,
        "plan_time": plan_rows,
        "scale": _scale_section(args),
    }


def _scale_section(args) -> list[dict]:
    if not args.scale:
        return []
    from tqdm import tqdm

    from . import scale

    with tqdm(
        total=len(args.scale) * len(scale.LAYOUTS) * len(scale.WRITERS),
        desc="scale",
        disable=args.quiet,
        file=sys.stderr,
    ) as bar:
        return scale.run(args.scale, progress=lambda what: (bar.set_postfix_str(what), bar.update()))


#: The state a --compressed run also saves with the compressed writers (locally) when --data is
#: another: a training state's bf16 weights compress differently from fp32, and loads of them are
#: where compression has cost the most.
TRAINING_STATE = "bf16-weights"


def _training_state_pass(args, cfg: dict, chosen: list, targets: list[dict]) -> tuple[dict, int] | None:
    """The config (and progress steps) of the extra pass over ``TRAINING_STATE``, or None."""
    compressed = [w for w in chosen if "zstd" in w.name and "local" in w.targets]
    local = next((t for t in targets if t["kind"] == "local"), None)
    if not args.compressed or args.data == TRAINING_STATE or not compressed or local is None:
        return None
    target = {**local, "name": f"{local['name']} {TRAINING_STATE}", "base": f"{local['base']}/{TRAINING_STATE}"}
    state_cfg = {
        **cfg,
        "data": TRAINING_STATE,
        "writers": [w.name for w in compressed],
        "writer_targets": {w.name: ("local",) for w in compressed},
        "targets": [target],
        "shared_reads": False,
    }
    return state_cfg, args.repeats * len(compressed)


def _async_and_plan_sections(args, cfg: dict, targets: list[dict], progress_file: str, backend: str):
    """``--async-saves`` on the first file-system target (torch's FileSystemWriter is a peer there) and
    ``--plan-tensors``; each in processes of its own, so torch's PROCESS executor ends with them."""
    from . import async_saves, plan_time

    async_rows: list[dict] = []
    local = next((t for t in targets if t["kind"] == "local"), None)
    if args.async_saves and local is None:
        print("note: --async-saves needs a local or NFS target (--path); skipped", file=sys.stderr)
    elif args.async_saves:
        setups = [
            s.name
            for s in async_saves.SETUPS
            if (cfg["device"] == "cuda" or not s.needs_gpu) and (s.by_default or args.all_stagers)
        ]
        section = {
            **cfg,
            "async_base": f"{local['base']}/async",
            "async_saves": args.async_saves,
            "async_setups": setups,
        }
        records = _spawn_with_progress(args, async_saves.run_rank, section, progress_file, 2 * len(setups), backend)
        async_rows = async_saves.summarize(records)
    plan_rows: list[dict] = []
    if args.plan_tensors:
        with contextlib.ExitStack() as stack:
            base = local["base"] if local else stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptio-plan-"))
            section = {**cfg, "plan_base": f"{base}/plan", "plan_tensors": args.plan_tensors}
            steps = len(args.plan_tensors) * len(plan_time.WRITERS)
            records = _spawn_with_progress(args, plan_time.run_rank, section, progress_file, steps, backend)
        plan_rows = plan_time.summarize(records)
    return async_rows, plan_rows


def _tiered_section(
    args, cfg: dict, targets: list[dict], progress_file: str, backend: str
) -> tuple[list[dict], list[dict]]:
    """``--tiered`` (and ``--tiered-lagging``) on every S3 target, the fast tier on the local target's disk
    (else a temp dir)."""
    from . import tiered

    s3_targets = [t for t in targets if t["kind"] == "s3"]
    if not args.tiered or not s3_targets:
        return [], []
    local = next((t for t in targets if t["kind"] == "local"), None)
    with contextlib.ExitStack() as stack:
        fast = (
            f"{local['base']}/tiers"
            if local
            else stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptio-tier-"))
        )
        section = {**cfg, "targets": s3_targets, "tiered_fast_base": fast}
        records = _spawn_with_progress(
            args, tiered.run_rank, section, progress_file, args.repeats * len(s3_targets), backend
        )
        lagging = _lagging_section(args, section, progress_file, backend)
    return tiered.summarize(records), lagging


def _lagging_section(args, section: dict, progress_file: str, backend: str) -> list[dict]:
    """``--tiered-lagging``, on the tiered section's targets and fast tier."""

    if not args.tiered_lagging:
        return []
    if args.lagging_saves < 2:
        usage_error(f"--lagging-saves must be at least 2, got {args.lagging_saves}")
    steps = args.repeats * len(section["targets"])
    size = min(lagging.LAGGING_SIZE, section["size_bytes"])  # the drain is limited relative to it: it lags anyway
    cfg = {**section, "lagging_saves": args.lagging_saves, "lagging_size": size}
    records = _spawn_with_progress(args, lagging.run_rank, cfg, progress_file, steps, backend)
    return lagging.summarize(records)


def _incremental_section(args, cfg: dict, targets: list[dict], progress_file: str, backend: str) -> list[dict]:
    """``--incremental`` on every target."""
    from . import incremental

    if not args.incremental:
        return []
    states = [s.strip() for s in args.incremental_states.split(",") if s.strip()]
    if not states or set(states) - set(incremental.STATES):
        known = ", ".join(incremental.STATES)
        usage_error(f"--incremental-states takes some of {known}, got {args.incremental_states!r}")
    if args.incremental_depth < 2:
        usage_error(f"--incremental-depth must be at least 2, got {args.incremental_depth}")
    section = {
        **cfg,
        "incremental_states": states,
        "incremental_depth": args.incremental_depth,
        "incremental_memory_saves": args.incremental_depth + 2,
    }
    steps = args.repeats * len(targets) * len(states)
    records = _spawn_with_progress(args, incremental.run_rank, section, progress_file, steps, backend)
    return incremental.summarize(records)


@contextlib.contextmanager
def _warnings_to(log_path: str | None):
    """This process's Python warnings and log records go to ``log_path`` too (None: unchanged)."""
    if log_path is None:
        yield
        return
    handler = logging.FileHandler(log_path)
    root = logging.getLogger()
    root.addHandler(handler)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        handler.close()


def _spawn_with_progress(args, rank_fn, cfg, progress_file: str, steps: int, backend: str) -> list[dict]:
    from tqdm import tqdm

    if os.path.exists(progress_file):
        os.remove(progress_file)
    out: dict = {}

    def work() -> None:
        try:
            out["records"] = [
                r
                for rank_records in launch(args.ranks, rank_fn, cfg, backend=backend, log_path=args.log_path)
                for r in rank_records
            ]
        except BaseException as exc:  # reported below, in the main thread
            out["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    with tqdm(total=steps, desc="bench", unit="run", disable=args.quiet, file=sys.stderr) as bar:
        while thread.is_alive():
            thread.join(0.5)
            done = sum(1 for _ in open(progress_file)) if os.path.exists(progress_file) else 0
            bar.update(done - bar.n)
    if "error" in out:
        raise out["error"]
    return out["records"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(args.out, f"bench-{stamp}")
    args.log_path = None if args.verbose else base + ".log"
    with _warnings_to(args.log_path):
        doc = run(args)
    if not args.no_charts:
        if report.charts(doc["results"], base + ".png"):
            doc["charts"] = os.path.basename(base + ".png")
        else:
            print(
                "note: no chart written: matplotlib is not installed (pip install 'ckptio[bench]'); "
                "the table, JSON and Markdown are complete",
                file=sys.stderr,
            )
    if not args.no_charts and report.async_charts(doc["async_saves"], base + "-async.png"):
        doc["async_charts"] = os.path.basename(base + "-async.png")
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(report.markdown_report(doc))
    print(report.table(doc["results"]))
    phases = report.phase_table(doc["results"], doc.get("raw_bandwidth", {}))
    if phases:
        print(
            "\nPhases (s in each writer method on the slowest rank, median (min-max) over repeats; waits for other "
            "ranks between methods excluded):\n" + phases + "\n" + report.raw_lines(doc["raw_bandwidth"], args.ranks)
        )
    by_dtype = report.dtype_table(doc["results"])
    if by_dtype and any("zstd" in r["writer"] for r in doc["results"]):
        print("\nBytes saved by compression, per dtype (tensor data):\n" + by_dtype)
    requests = report.request_table(doc["results"])
    if requests:
        print("\nS3 requests (client side, summed over ranks):\n" + requests)
    shared = report.shared_reads_table(doc.get("shared_reads", []))
    if shared:
        print("\nShared reads (loads on other meshes; served/stored and GETs on S3, all ranks):\n" + shared)
    asynchronous = report.async_table(doc["async_saves"])
    if asynchronous:
        print("\nAsynchronous saves (training-step loop beside each; blocking = time in async_save):\n" + asynchronous)
    tiers = report.tiered_table(doc["tiered"])
    lagging_rows = lagging.table(doc.get("tiered_lagging", []))
    if lagging_rows:
        title = "Tiered incremental saves about 1 s apart, the drain limited to half a full save's rate and not"
        print(f"\n{title} (median (min-max) over repeats):\n{lagging_rows}")
    if tiers:
        print("\nTiered saves (fast tier on the local disk, drained to S3; slowest rank, median (min-max)):\n" + tiers)
    incremental = report.incremental_table(doc.get("incremental", []))
    if incremental:
        title = "Incremental saves beside full saves of the same state (slowest rank, median (min-max))"
        print(f"\n{title}:\n{incremental}")
    plans = report.plan_table(doc["plan_time"])
    if plans:
        print("\nPlan time (dcp.save until write_data; torch's plan cache on):\n" + plans)
    scaled = report.scale_table(doc["scale"])
    if scaled:
        print(
            "\nCoordinator and metadata at scale (simulated plans; us/item = all three phases per plan item):\n"
            + scaled
        )
    if args.compare:
        print("\nagainst " + args.compare + ":\n" + report.compare(doc["results"], args.compare))
    print(
        f"\nresults: {base}.json, {base}.md"
        + (f", {base}.png" if "charts" in doc else "")
        + (f", {base}-async.png" if "async_charts" in doc else "")
        + f"  ({time.time() - started:.0f}s)"
    )
    if args.log_path and os.path.exists(args.log_path):
        print(f"warnings and logs of the ranks: {args.log_path} (--verbose shows them live)")
    bad = [r for r in doc["results"] if not (r["load_bit_exact"] and r["reshard_bit_exact"])]
    bad += [
        {"writer": f"{r['setup']} ({r['executor']})", "target": "async"}
        for r in doc["async_saves"]
        if not r["bit_exact"]
    ]
    bad += [{"writer": "ckptio tiered", "target": r["target"]} for r in doc["tiered"] if not r["bit_exact"]]
    bad += [
        {"writer": f"ckptio tiered lagging ({r['drain']})", "target": r["target"]}
        for r in doc.get("tiered_lagging", [])
        if not r["bit_exact"]
    ]
    bad += [
        {"writer": f"ckptio incremental ({r['state']})", "target": r["target"]}
        for r in doc.get("incremental", [])
        if not r["bit_exact"]
    ]
    if bad:
        print("LOAD MISMATCH for: " + ", ".join(f"{r['writer']} on {r['target']}" for r in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
