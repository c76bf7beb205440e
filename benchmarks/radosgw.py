"""A throw-away Ceph radosgw on loopback for the S3 tests and ``ckptio bench --radosgw``: a production
S3 implementation that checks signatures and differs from AWS (and moto) where real stores do.

Debian 12's radosgw (Ceph 16) needs a RADOS cluster, so this starts one: a monitor, one OSD keeping
objects in memory (``memstore``, capped) and radosgw, with authentication off inside the cluster
and an S3 user with fixed keys. Every process is started and stopped here, by PID; nothing else on
the machine is touched. ``start`` raises ``Unavailable`` (with the reason) where the packages are
not installed (``make radosgw`` installs them) or the cluster does not come up.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field

ACCESS_KEY = "ckptio-test-access"
SECRET_KEY = "ckptio-test-secret-0123456789abcdef"
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
#: memstore keeps every object in RAM: bounded, and tests delete what they write.
MEMSTORE_BYTES = 3 << 30


class Unavailable(Exception):
    """radosgw cannot run here; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Radosgw:
    endpoint: str
    root: str
    conf: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def storage_options(self) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": self.endpoint}}

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        ).create_bucket(Bucket=name)  # fmt: skip

    def stop(self) -> None:
        """Kill the daemons (nothing of this throw-away cluster needs an orderly shutdown)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def start(timeout: float = 90) -> Radosgw:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not installed (Debian: apt-get install radosgw ceph-mon ceph-osd)")
    last = ""
    for _ in range(3):  # a cluster that does not come up is started afresh
        try:
            return _start_once(timeout)
        except Unavailable as exc:
            last = str(exc)
    raise Unavailable(last)


def _start_once(timeout: float) -> Radosgw:
    root = tempfile.mkdtemp(prefix="ckptio-rgw-")
    mon_port, rgw_port = _free_port(), _free_port()
    fsid = str(uuid.uuid4())
    for sub in ("mon", "osd", "run", "log", "rgw"):
        os.makedirs(os.path.join(root, sub))
    conf = os.path.join(root, "ceph.conf")
    with open(conf, "w") as f:
        f.write(
            f"""[global]
fsid = {fsid}
mon_host = v1:127.0.0.1:{mon_port}
ms_bind_ipv6 = false
ms_bind_msgr2 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
mon_warn_on_pool_no_redundancy = false
osd_objectstore = memstore
memstore_device_bytes = {MEMSTORE_BYTES}
osd_data = {root}/osd
mon_data = {root}/mon
run_dir = {root}/run
admin_socket = {root}/run/$name.asok
log_file = {root}/log/$name.log
pid_file = {root}/run/$name.pid
keyring = {root}/keyring
[client.rgw]
rgw_frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw_data = {root}/rgw
rgw_dns_name = 127.0.0.1
# Deleted objects' data is freed within seconds (the default waits two hours): memstore is RAM.
rgw_gc_obj_min_wait = 0
rgw_gc_processor_period = 5
"""
        )
    gw = Radosgw(f"http://127.0.0.1:{rgw_port}", root, conf)
    try:
        _run(["ceph-authtool", "--create-keyring", f"{root}/keyring", "--gen-key", "-n", "mon."], root)
        monmap = f"{root}/monmap"
        _run(["monmaptool", "--create", "--addv", "a", f"[v1:127.0.0.1:{mon_port}]", "--fsid", fsid, monmap], root)
        _run(["ceph-mon", "-c", conf, "--mkfs", "-i", "a", "--monmap", monmap], root)
        gw.processes.append(_spawn(["ceph-mon", "-c", conf, "-f", "-i", "a"], root, "mon"))
        osd_uuid = str(uuid.uuid4())
        osd_id = _run(["ceph", "-c", conf, "--connect-timeout", "20", "osd", "new", osd_uuid], root).strip()
        _run(["ceph-osd", "-c", conf, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid], root)
        gw.processes.append(_start_osd(conf, osd_id, root))
        gw.processes.append(_spawn(["radosgw", "-c", conf, "-f", "-n", "client.rgw"], root, "rgw"))
        _wait_http(gw, timeout)
        _run(
            ["radosgw-admin", "-c", conf, "-n", "client.rgw", "user", "create", "--uid", "ckptio",
             "--display-name", "ckptio tests", "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY],
            root,
        )  # fmt: skip
        return gw
    except BaseException:
        gw.stop()
        raise


def _run(command: list[str], root: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=root)
    if done.returncode != 0:
        raise Unavailable(f"{' '.join(command[:3])} failed: {(done.stderr or done.stdout).strip()[-400:]}")
    return done.stdout


def _start_osd(conf: str, osd_id: str, root: str, attempts: int = 8) -> subprocess.Popen:
    """The OSD's first starts can fail with 'wrong fsid' while the monitor commits the new OSD: start
    it again until it stays up."""
    for _ in range(attempts):
        osd = _spawn(["ceph-osd", "-c", conf, "-f", "-i", osd_id], root, "osd")
        try:
            osd.wait(2)
        except subprocess.TimeoutExpired:
            return osd  # still running
        time.sleep(0.5)
    raise Unavailable(f"ceph-osd kept exiting: {_tail(os.path.join(root, 'log', 'osd.out'))}")


def _spawn(command: list[str], root: str, name: str) -> subprocess.Popen:
    with open(os.path.join(root, "log", f"{name}.out"), "w") as log:  # the daemon keeps its own copy
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)


def _wait_http(gw: Radosgw, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p.args[0] for p in gw.processes if p.poll() is not None]
        if dead:
            logs = {n: _tail(os.path.join(gw.root, "log", f"{n}.out")) for n in ("mon", "osd", "rgw")}
            raise Unavailable(f"{', '.join(dead)} exited while starting: {json.dumps(logs)[-600:]}")
        try:
            with urllib.request.urlopen(gw.endpoint, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (403 for an anonymous request is an answer)
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    raise Unavailable(f"radosgw did not answer on {gw.endpoint} within {timeout:.0f} s")


def _tail(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()[-300:]
    except OSError:
        return ""
