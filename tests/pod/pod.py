"""A TPU pod on one machine: N hosts, each in its own network and mount namespace, each booted
as a TPU VM is (its own metadata server, deploy/tpu-vm/startup.sh, the daemon under the
installed unit's command line), all reading one bucket (tests/python/bucket_emulator.py in
front of fake-gcs-server) over their own veth.

The network: a bridge in the test's namespace holding ``GATEWAY`` (the bucket, the package
index and Prometheus listen there), and per host a network namespace with one veth to the
bridge, ``ADDRESS(i)``, a loopback for its metadata server, and no default route; the machine
does not forward, so nothing a host sends can leave the test (169.254.169.254 is not even
routable from a host). Addresses come from the benchmarking range 198.18.0.0/15.

The filesystem: a host is its root directory ``hosts/i`` (the start-up script's SHARDD_ROOT)
and a mount namespace in which that directory's ``run`` and ``var/cache`` are bind-mounted
over /run and /var/cache, so the unchanged config's /run/shardd/shardd.sock and
/var/cache/shardd are the host's own. A holder process (``sleep``) keeps both namespaces;
every process of the host enters them with nsenter. Tearing a host down kills its processes
and deletes its namespace and its root, as deleting a VM does.

What is not a VM's: every process runs as root (no systemd, so no DynamicUser; systemctl,
getent, groupadd, useradd and usermod are test_startup's stubs), and hosts share the kernel,
the CPU and the page cache."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

from conftest import ROOT, wait_for  # noqa: E402
from test_startup import ACCOUNTS, STUB  # noqa: E402

METADATA = "127.0.0.1:80"  # each host's own metadata server, on the host's own loopback
METRICS_PORT = 9464


def ip(*args, check=True):
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {out.returncode}: {out.stderr.strip()}")
    return out


def namespaces_unavailable():
    """Why this machine cannot run a pod (None if it can): root and `ip netns` are needed."""
    if os.geteuid() != 0:
        return "the pod needs root (network namespaces, bind mounts)"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "the pod needs ip (iproute2) and nsenter (util-linux)"
    probe = f"shpodprobe{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


class Network:
    """The pod's bridge and its subnet 198.18.S.0/24 (S from the process id, so two runs at
    once do not share one)."""

    def __init__(self):
        self.tag = f"{os.getpid() % 10000}"
        self.subnet = 1 + os.getpid() % 250
        self.bridge = f"sp{self.tag}br"
        self.gateway = f"198.18.{self.subnet}.1"
        ip("link", "del", self.bridge, check=False)  # a run with this process id that died
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def address(self, i):
        return f"198.18.{self.subnet}.{10 + i}"

    def namespace(self, i):
        return f"sp{self.tag}h{i}"

    def attach(self, i):
        """Host i's namespace, its veth on the bridge and its address; no default route."""
        ns, veth = self.namespace(i), self.veth(i)
        self.detach(i)  # what a run that died left
        ip("netns", "add", ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", veth, "master", self.bridge, "up")
        ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def veth(self, i):
        return f"sp{self.tag}v{i}"

    def detach(self, i):
        # The veth pair first, at once: deleting the namespace frees its end only later, in
        # the kernel's own time, and a host booted again with this index needs the name.
        ip("link", "del", self.veth(i), check=False)
        ip("netns", "del", self.namespace(i), check=False)

    def close(self):
        ip("link", "del", self.bridge, check=False)


class Host:
    """One TPU VM of the pod: ``boot()`` makes its namespaces, starts its metadata server and
    runs the start-up script; ``start_daemon()`` runs the installed unit's ExecStart."""

    def __init__(self, pod, index, attributes):
        self.pod, self.index = pod, index
        self.root = pod.dir / "hosts" / str(index)
        self.address = pod.net.address(index)
        self.state = self.root / "metadata.json"
        self.attributes = attributes
        self.procs = []
        self.daemon = self.holder = None
        self.boot_seconds = None
        self.gets_at_boot = {}

    # ---- the VM ----

    def boot(self, token_ttl):
        started = time.monotonic()
        self.gets_at_boot = self.pod.bucket.stats(objects=True)["hosts"][self.index]["gets"]
        for d in ("run/shardd", "var/cache/shardd", "home", "stubs", "db"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.set_metadata(self.attributes, token_ttl)
        self.pod.net.attach(self.index)
        # The holder: both namespaces, kept while the host lives.
        mounts = (f"mount --bind {self.root}/run /run && mount --bind {self.root}/var/cache /var/cache"
                  " && echo ready && exec sleep infinity")
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", self.pod.net.namespace(self.index),
             "unshare", "--mount", "--propagation", "private", "sh", "-c", mounts],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.holder.stdout.readline()
        if line != "ready\n":
            raise RuntimeError(f"host {self.index} did not start: {self.holder.stderr.read()}")
        self.spawn("metadata", [sys.executable, str(HERE / "metadata_server.py"), str(self.state),
                                METADATA, self.pod.secret, str(self.index)],
                   wait_line="ready")
        self.run_startup_script()
        self.boot_seconds = time.monotonic() - started
        return self

    def set_metadata(self, attributes, token_ttl=None):
        """What this host's metadata server answers from now on."""
        old = json.loads(self.state.read_text()) if self.state.exists() else {}
        self.attributes = attributes
        state = {"attributes": attributes, "token_ttl": token_ttl or old["token_ttl"]}
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.rename(self.state)

    def tokens_issued(self):
        path = pathlib.Path(str(self.state) + ".tokens")
        return len(path.read_text().splitlines()) if path.exists() else 0

    def environment(self, **extra):
        """A host process's environment: the machine's, less any credentials, with this host's
        metadata server."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GOOGLE_", "GCE_", "AWS_", "CLOUDSDK_", "PIP_"))}
        env.update(HOME=str(self.root / "home"), GCE_METADATA_HOST=METADATA,
                   GCE_METADATA_IP=METADATA, NO_PROXY="*", **extra)
        return env

    def command(self, argv):
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", "--", *argv]

    def spawn(self, name, argv, env=None, wait_line=None, log=None):
        """A process of this host; its output goes to ``logs/NAME.log`` in the host's root."""
        log = log or self.root / f"{name}.log"
        out = open(log, "a")
        proc = subprocess.Popen(self.command(argv), env=env or self.environment(),
                                stdout=subprocess.PIPE if wait_line else out, stderr=out, text=True)
        proc.log = log
        self.procs.append(proc)
        if wait_line:
            got = proc.stdout.readline().strip()
            if got != wait_line:
                raise RuntimeError(f"host {self.index}'s {name} did not start ({got!r}): {log.read_text()}")
        return proc

    def run_startup_script(self):
        """deploy/tpu-vm/startup.sh as the VM runs it at boot, under this host's root."""
        stubs, db, log = self.root / "stubs", self.root / "db", self.root / "calls.log"
        (db / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n"
                                   "trainer:x:1000:1000::/home/trainer:/bin/bash\n")
        (db / "group").write_text("root:x:0:\ntrainer:x:1000:\n")
        (stubs / "systemctl").write_text(STUB.format(log=log, tail=""))
        accounts = stubs / "accounts.py"
        accounts.write_text(ACCOUNTS.format(python=sys.executable, log=str(log), db=str(db)))
        (stubs / "pip3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pip "$@"\n')
        for f in ("systemctl", "accounts.py", "pip3"):
            (stubs / f).chmod(0o755)
        for name in ("getent", "groupadd", "useradd", "usermod"):
            if not (stubs / name).exists():
                (stubs / name).symlink_to(accounts)
        env = self.environment(PATH=f"{stubs}:{os.environ['PATH']}", SHARDD_ROOT=str(self.root),
                               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1",
                               # The index is plain HTTP at the gateway (Artifact Registry's is HTTPS).
                               PIP_TRUSTED_HOST=self.pod.net.gateway)
        out = subprocess.run(self.command(["bash", str(ROOT / "deploy/tpu-vm/startup.sh")]),
                             env=env, capture_output=True, text=True, timeout=300)
        (self.root / "startup.log").write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            raise RuntimeError(f"host {self.index}'s start-up script failed:\n{out.stdout}{out.stderr}")
        return out

    def exec_start(self):
        """The installed unit's ExecStart, its /etc/shardd being the host root's."""
        unit = (self.root / "etc/systemd/system/shardd.service").read_text()
        line = next(v for v in unit.splitlines() if v.startswith("ExecStart="))
        return [a.replace("/etc/shardd/", f"{self.root}/etc/shardd/")
                for a in line[len("ExecStart="):].split()]

    # ---- the daemon ----

    def start_daemon(self, wait=True):
        """The daemon as systemd runs it (the unit's command line and SHARDD_LOG)."""
        self.daemon = self.spawn("shardd", self.exec_start(), env=self.environment(SHARDD_LOG="info"))
        if wait:
            self.wait_ready()
        return self.daemon

    def wait_ready(self):
        def ready():
            if self.daemon.poll() is not None:
                raise RuntimeError(f"host {self.index}'s daemon exited with {self.daemon.returncode}:\n"
                                   f"{self.daemon.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.metrics_url}/readyz", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_for(ready, f"host {self.index}'s daemon to serve", timeout=60)

    def stop_daemon(self, sig=signal.SIGTERM):
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(sig)
            self.daemon.wait(timeout=60)
        self.daemon = None

    @property
    def metrics_url(self):
        return f"http://{self.address}:{METRICS_PORT}"

    def metrics(self):
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name):
        """The sum of a family's series (they must exist: a missing family is a KeyError)."""
        total, seen = 0.0, False
        for line in self.metrics().splitlines():
            series, _, value = line.rpartition(" ")
            if series == name or series.startswith(name + "{"):
                total, seen = total + float(value), True
        if not seen:
            raise KeyError(f"host {self.index}: no series {name}")
        return total

    def holdings(self):
        """The shards this VM downloaded since it booted (its cache, if nothing was evicted),
        from the bucket's counts."""
        gets = self.pod.bucket.stats(objects=True)["hosts"][self.index]["gets"]
        return {n for n, c in gets.items() if n.endswith(".tar") and c > self.gets_at_boot.get(n, 0)}

    # ---- trainers ----

    def trainer(self, name, **request):
        """A trainer process on this host (tests/pod/trainer.py): reads one stream and writes
        what it read to ``NAME.jsonl`` in the host's root."""
        out = self.root / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        request = {"socket": "/run/shardd/shardd.sock", "out": str(out), **request}
        proc = self.spawn(name, [sys.executable, str(HERE / "trainer.py"), json.dumps(request)])
        proc.out = out
        return proc

    # ---- deleting the VM ----

    def teardown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()
            self.holder = None
        self.pod.net.detach(self.index)


class Pod:
    """N hosts, one bucket, one package index (the wheel, for the start-up script)."""

    def __init__(self, directory, wheel, fake_gcs_port, hosts, config, *, token_ttl=30,
                 **bucket_options):
        from bucket_emulator import BucketEmulator

        self.dir = pathlib.Path(directory)
        self.secret = f"pod-{os.getpid()}-{time.time_ns()}"
        self.net = Network()
        self.hosts = []
        self.token_ttl = token_ttl
        self.config = config
        # The bucket, reached from every host at the gateway; each host told apart by its address.
        room = max(64, hosts)  # addresses the bucket knows: every host a test may boot
        self.bucket = BucketEmulator(
            fake_gcs_port, hosts=room, listen=self.net.gateway,
            peers=[self.net.address(i) for i in range(room)], token_secret=self.secret,
            **bucket_options).start()
        self.endpoint = self.bucket.endpoint(0)
        self.index_server = PackageIndex(self.dir / "index", wheel, self.net.gateway)
        self.count = hosts

    def attributes(self, index, count, config=None):
        """A TPU VM worker's metadata: its number, the slice's workers, the start-up keys."""
        return {
            "agent-worker-number": str(index),
            "worker-network-endpoints": ",".join(
                f"unknown:unknown:{self.net.address(i)}" for i in range(count)),
            "shardd-index": self.index_server.url,
            "shardd-config": (config or self.config).replace("ENDPOINT", self.endpoint),
            "shardd-user": "trainer",
        }

    def boot(self, indices=None, count=None):
        """Boots hosts (all of them by default), two at a time, and starts their daemons."""
        import concurrent.futures

        count = count or self.count
        indices = list(range(count)) if indices is None else indices
        new = []
        for i in indices:
            shutil.rmtree(self.dir / "hosts" / str(i), ignore_errors=True)
            h = Host(self, i, self.attributes(i, count))
            self.hosts = [x for x in self.hosts if x.index != i] + [h]
            new.append(h)
        self.hosts.sort(key=lambda h: h.index)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda h: h.boot(self.token_ttl), new))
        for h in new:
            h.start_daemon(wait=False)
        for h in new:
            h.wait_ready()
        return new

    def restart(self, wipe=False, hosts=None):
        """Restarts the daemons (of ``hosts``, default all), as `systemctl restart shardd`; with
        ``wipe``, their caches emptied first."""
        chosen = [h for h in self.hosts if hosts is None or h.index in hosts]
        for h in chosen:
            h.stop_daemon()
            if wipe:
                cache = h.root / "var/cache/shardd"
                shutil.rmtree(cache)
                cache.mkdir()
                h.gets_at_boot = self.bucket.stats(objects=True)["hosts"][h.index]["gets"]
        for h in chosen:
            h.start_daemon(wait=False)
        for h in chosen:
            h.wait_ready()

    def set_count(self, count, hosts=None):
        """Tells hosts (default all) that the slice has ``count`` workers (their metadata's
        worker-network-endpoints) and restarts their daemons, which read it at start."""
        for h in self.hosts:
            if hosts is None or h.index in hosts:
                h.set_metadata(self.attributes(h.index, count))
        self.restart(hosts=hosts)

    def ensure(self):
        """The pod as it booted: every host there, told the slice's size, its daemon running
        (what a test that failed mid-resize may have left otherwise)."""
        missing = sorted(set(range(self.count)) - {h.index for h in self.hosts})
        stale = [h.index for h in self.hosts
                 if h.attributes != self.attributes(h.index, self.count)
                 or h.daemon is None or h.daemon.poll() is not None]
        for i in stale:
            self.host(i).set_metadata(self.attributes(i, self.count))
        if stale:
            self.restart(hosts=stale)
        if missing:
            self.boot(missing)

    def host(self, i):
        return next(h for h in self.hosts if h.index == i)

    def remove(self, i):
        """Deletes host i (its processes, namespace and root)."""
        h = self.host(i)
        h.teardown()
        self.hosts.remove(h)

    def close(self):
        for h in list(self.hosts):
            h.teardown()
        self.hosts = []
        self.bucket.close()
        self.index_server.close()
        self.net.close()


class PackageIndex:
    """A PEP 503 "simple" index holding the wheel, at the gateway: the start-up script's
    shardd-index."""

    def __init__(self, directory, wheel, address):
        import functools
        import http.server
        import threading

        project = directory / "simple" / "shardd"
        project.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, project / pathlib.Path(wheel).name)

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(
            (address, 0), functools.partial(Quiet, directory=directory))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{address}:{self.server.server_address[1]}/simple/"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
