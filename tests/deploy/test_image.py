"""The image is built, and the stack runs from it.

1. deploy/image/build.sh builds `tensorbus:<version>` with buildah on a Debian base
   made by debootstrap (both kept under /var/cache/tensorbus-image between runs).
2. A real nats-server runs on the host, on a free port.
3. Four containers of the image (`buildah from`), each service started in its own
   with `buildah run --isolation chroot --network host` as uid 10001 (the manifests'
   runAsUser), /data and /tmp from the host (the manifests' emptyDirs), and the
   settings of deploy/k8s's ConfigMap: the gateway, telemetry and the MiniLM worker
   with the `command` their Deployments give, the scheduler through the image's
   entrypoint.
4. The manifests' own readiness probes pass inside the containers, one embeddings
   request over HTTP is answered with the vector sentence-transformers computes on
   the host from the same weights, and no service wrote to the image's filesystem
   (the Deployments run it read-only).

Needs root and Debian's buildah and debootstrap: scripts/test.sh installs them when
it runs as root (CI does); anywhere else this test fails and says so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from services.supervisor import wait_ready
from shared import catalog
from shared.natsd import NatsServer, free_port
from tests.support.bus import connect as bus_connect

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "deploy" / "image" / "build.sh"
K8S = REPO / "deploy" / "k8s" / "base"
UID = 10001
ENCODER = catalog.ENCODER
BUILDAH_OWN = {"run", "run/.containerenv"}  # what `buildah run` writes into a container
TEXTS = ["A container image built from the repository.", "Debian bookworm, debootstrapped."]

# Building a cold image takes minutes (docs/benchmarks.md); a warm one, seconds.
pytestmark = pytest.mark.timeout(900)


def need_tools() -> None:
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    if missing:
        pytest.fail(f"the image test needs {' and '.join(missing)}: `apt-get install "
                    f"--no-install-recommends buildah debootstrap` (scripts/test.sh does it "
                    f"when run as root)")
    if os.geteuid() != 0:
        pytest.fail("the image test builds and runs the image with buildah and debootstrap, "
                    "which need root here; run it as root (CI does)")


@pytest.fixture(scope="module")
def image() -> str:
    need_tools()
    res = subprocess.run([str(BUILD)], cwd=REPO, capture_output=True, text=True, timeout=840)
    assert res.returncode == 0, res.stderr[-4000:]
    phases = [line for line in res.stderr.splitlines() if line.startswith("phase ")]
    print("\n".join(phases))  # how long each part took: `pytest -s` shows them
    tag, image_id = res.stdout.split()[-2:]
    assert tag.startswith("tensorbus:")
    return image_id  # this build's, whichever image the tag names later


def manifest_container(name: str) -> dict:
    doc = next(d for d in yaml.safe_load_all((K8S / f"{name}.yaml").read_text())
               if d and d["kind"] == "Deployment")
    return doc["spec"]["template"]["spec"]["containers"][0]


def pod_env(container: dict, pod_name: str) -> dict[str, str]:
    """A container's own settings as Kubernetes would give them in pod `pod_name`:
    literal values and the pod's name; not those drawn from the Secret or built from
    it (`$(NATS_PASSWORD)`), for which config_env gives the test's NATS URL."""
    out = {}
    for e in container.get("env", []):
        if "value" in e and "$(" not in e["value"]:
            out[e["name"]] = e["value"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            out[e["name"]] = pod_name
    return out


def config_env(nats_port: int, http_port: int, metrics_port: int) -> dict[str, str]:
    """deploy/k8s's ConfigMap, pointed at this test's server and ports."""
    data = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]
    data.update({
        "NATS_ADDRESS": f"127.0.0.1:{nats_port}",
        "TENSORBUS_NATS_URL": f"nats://127.0.0.1:{nats_port}",
        "TENSORBUS_HTTP_HOST": "127.0.0.1", "TENSORBUS_HTTP_PORT": str(http_port),
        "TENSORBUS_METRICS_PORT": str(metrics_port),
        # One shape bucket: the worker compiles one program before it is ready.
        "TENSORBUS_BATCH_BUCKETS": "1", "TENSORBUS_SEQ_BUCKETS": "16",
        "TENSORBUS_MAX_BATCH": "1", "TENSORBUS_FLEET": f"{ENCODER}=1:1",
    })  # fmt: skip
    return data


class Container:
    """One container of the image; commands run in it as a pod's would: uid 10001,
    the host's network, /data and /tmp mounted from the host."""

    def __init__(self, image: str, name: str, workdir: Path, env: dict[str, str]) -> None:
        self.name, self.env = name, env
        self.log = workdir / f"{name}.log"
        self.mounts = []
        for sub in ("data", "tmp"):
            d = workdir / name / sub
            d.mkdir(parents=True)
            os.chown(d, UID, UID)
            self.mounts += ["--volume", f"{d}:/{sub}"]
        self.id = subprocess.run(
            ["buildah", "from", "--pull=never", "--name", f"tensorbus-test-{name}-{os.getpid()}",
             image], check=True, capture_output=True, text=True, timeout=120).stdout.strip()
        self.proc: subprocess.Popen | None = None

    def argv(self, command: list[str], **env: str) -> list[str]:
        settings = [f"--env={k}={v}" for k, v in (self.env | env).items()]
        return ["buildah", "run", "--isolation", "chroot", "--network", "host",
                "--user", f"{UID}:{UID}", *self.mounts, *settings, self.id, "--", *command]

    def start(self, command: list[str]) -> None:
        with open(self.log, "ab") as log:
            # A session of its own: buildah, its chroot helper and the service are one
            # process group, stopped together.
            self.proc = subprocess.Popen(self.argv(command), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def run(self, command: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(command, **env), capture_output=True, text=True,
                              timeout=timeout)

    def written(self) -> list[str]:
        """What its processes wrote to the image's own filesystem: the container's
        layer in buildah's overlay storage, where buildah run itself leaves only /run
        and its marker /run/.containerenv. Nothing else means the Deployments'
        readOnlyRootFilesystem holds."""
        mnt = subprocess.run(["buildah", "mount", self.id], check=True, capture_output=True,
                             text=True, timeout=60).stdout.strip()
        try:
            upper = Path(mnt).parent / "diff"
            assert upper.is_dir(), f"no overlay layer at {upper}: buildah's storage is not overlay"
            return sorted(str(p.relative_to(upper)) for p in upper.rglob("*")
                          if p.relative_to(upper).as_posix() not in BUILDAH_OWN)
        finally:
            subprocess.run(["buildah", "umount", self.id], capture_output=True, timeout=60)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        subprocess.run(["buildah", "rm", self.id], capture_output=True, timeout=120)


def image_config(image: str) -> dict:
    import json

    out = subprocess.run(["buildah", "inspect", "--type", "image", image], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)["OCIv1"]["config"]


async def test_the_image_runs_the_stack_and_answers_embeddings(image, tmp_path, sentence_transformer):
    config = image_config(image)
    assert config["User"] == f"{UID}:{UID}"
    entrypoint = config["Entrypoint"]
    gateway_c, worker_c = manifest_container("gateway"), manifest_container("worker-encoder")
    http_port, metrics_port = free_port(), free_port()
    containers: list[Container] = []
    with NatsServer(tmp_path / "nats") as server:
        env = config_env(server.port, http_port, metrics_port)
        try:
            started = time.monotonic()
            scheduler_c, telemetry_c = manifest_container("scheduler"), manifest_container("telemetry")
            for name, command, extra in (
                ("scheduler", [*entrypoint, "scheduler"], pod_env(scheduler_c, "scheduler-0")),
                ("worker", worker_c["command"], pod_env(worker_c, "worker-encoder-0")),
                ("gateway", gateway_c["command"], pod_env(gateway_c, "gateway-0")),
                ("telemetry", telemetry_c["command"], pod_env(telemetry_c, "telemetry-0")),
            ):
                c = Container(image, name, tmp_path, env | extra)
                containers.append(c)
                c.start(command)

            import nats

            nc = await bus_connect(server.url)
            try:
                try:
                    await wait_ready(nc, ENCODER, timeout=240)
                except TimeoutError:
                    pytest.fail("\n".join(f"--- {c.name}:\n{c.log.read_text()[-3000:]}"
                                          for c in containers))
            finally:
                await nc.close()
            ready_s = time.monotonic() - started

            async with httpx.AsyncClient(timeout=30) as http:
                resp = await http.post(f"http://127.0.0.1:{http_port}/v1/embeddings",
                                       json={"model": ENCODER, "input": TEXTS})
            assert resp.status_code == 200, resp.text[:2000]
            got = np.array([d["embedding"] for d in resp.json()["data"]], dtype=np.float64)
            want = sentence_transformer.encode(TEXTS, convert_to_numpy=True).astype(np.float64)
            cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
            assert got.shape == want.shape and cos.min() >= 0.9999, cos

            # Telemetry serves the fleet's /metrics (its probes name port 9400; ours differs).
            async with httpx.AsyncClient(timeout=10) as http:
                metrics = await http.get(f"http://127.0.0.1:{metrics_port}/metrics")
            assert metrics.status_code == 200 and "tensorbus_" in metrics.text

            # The Deployments' own readiness probes, inside the running containers.
            by_name = {c.name: c for c in containers}
            for name, manifest in (("worker", worker_c), ("scheduler", scheduler_c)):
                probe = manifest["readinessProbe"]["exec"]["command"]
                res = by_name[name].run(probe, timeout=60)
                assert res.returncode == 0, f"{name} probe {probe}: {res.stdout}{res.stderr}"
            for c in containers:
                assert c.alive(), f"{c.name} exited:\n{c.log.read_text()[-3000:]}"
                assert c.written() == [], f"{c.name} wrote outside /data and /tmp"
            print(f"stack ready {ready_s:.1f} s after the containers started")
        finally:
            for c in containers:
                c.stop()


def test_the_image_carries_every_bundled_model_and_no_torch(image, tmp_path):
    """The catalogue finds the three bundled models in the installed (non-editable)
    package; torch is not installed, and asking a worker for it ends with exit 78."""
    c = Container(image, "check", tmp_path, {})
    try:
        res = c.run(["python", "-c",
                     "from shared import catalog; import importlib.util as u\n"
                     "for name in (catalog.ENCODER, catalog.SMOLLM2, catalog.DEMO_LM):\n"
                     "    assert catalog.is_model_dir(catalog.bundled_dir(name)), name\n"
                     "assert u.find_spec('torch') is None\n"
                     "import services, shared; print(services.__file__)"])
        assert res.returncode == 0, res.stderr[-3000:]
        assert "/opt/tensorbus/lib/" in res.stdout  # the installed copy, not a checkout
        res = c.run(["tensorbus-service", "worker"], timeout=60, TENSORBUS_ENGINE="torch",
                    TENSORBUS_MODEL=ENCODER, TENSORBUS_NATS_URL=f"nats://127.0.0.1:{free_port()}")
        assert res.returncode == 78, res.stdout + res.stderr
        assert "torch is not installed here" in res.stderr
    finally:
        c.stop()
