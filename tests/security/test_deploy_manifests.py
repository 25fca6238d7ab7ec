"""What a reviewer checks in deploy/k8s, checked on every run.

The manifests are read as plain YAML (no cluster): every Deployment is resourced,
probed, configured, credentialled per role and non-root; every reference
(kustomization, Service, ScaledObject, patch, policy) lands on something that exists;
KEDA scales on metrics the telemetry service really exports. Then the base and the
gpu overlay are rendered with `kubectl kustomize` and validated offline: against the
Kubernetes schemas that kubernetes-validate ships (strict: unknown fields are
errors) and against KEDA's ScaledObject schema (schemas/, the fields we use).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from services.telemetry.metrics import TelemetryMetrics
from shared import catalog
from shared.config import PREFIX, Config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
GPU = K8S / "overlays" / "gpu"
CONFIGMAP = "tensorbus-config"
CREDENTIALS = "tensorbus-nats-credentials"
ROLE_OF = {"gateway": "gateway", "scheduler": "scheduler", "telemetry": "telemetry",
           "batch": "batch", "worker-encoder": "worker", "worker-decoder": "worker",
           "registry-seed": "deploy"}
SCALING_METRICS = {"tensorbus_model_desired_replicas", "tensorbus_model_queue_depth"}
# Settings the manifests set ahead of shared/config.py reading them.
PENDING_SETTINGS = {"TENSORBUS_METRICS_HOST"}


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base_docs() -> list[dict]:
    return [d for p in sorted(BASE.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in load(p)]


def of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in base_docs() if d["kind"] == kind}


DEPLOYMENTS = of_kind("Deployment")
CONFIG = of_kind("ConfigMap")[CONFIGMAP]["data"]


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def workloads() -> dict[str, dict]:
    return DEPLOYMENTS | of_kind("Job")


# --- files and kustomizations ---------------------------------------------------


def test_every_yaml_parses_and_names_itself():
    files = sorted(K8S.rglob("*.yaml"))
    assert files
    for path in files:
        for doc in load(path):
            assert {"apiVersion", "kind"} <= doc.keys(), path
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"], path


def test_the_base_kustomization_lists_every_manifest_exactly_once():
    kust = load(BASE / "kustomization.yaml")[0]
    listed = kust["resources"]
    assert len(listed) == len(set(listed))
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk
    assert kust["namespace"] == "tensorbus"


def test_the_gpu_overlay_patches_real_workers_with_a_gpu_each():
    kust = load(GPU / "kustomization.yaml")[0]
    assert (GPU / kust["resources"][0] / "kustomization.yaml").resolve() == BASE / "kustomization.yaml"
    patched = set()
    for patch in kust["patches"]:
        target = patch["target"]
        assert target["kind"] == "Deployment" and target["name"] in DEPLOYMENTS
        patched.add(target["name"])
        body = load(GPU / patch["path"])[0]
        base_names = {c["name"] for c in pod_spec(DEPLOYMENTS[target["name"]])["containers"]}
        for c in pod_spec(body)["containers"]:
            assert c["name"] in base_names  # a strategic merge keys containers by name
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
            assert env_of(c)["JAX_PLATFORMS"]["value"] == "cuda"
            assert "cuda" in c["image"]
    assert patched == {n for n in DEPLOYMENTS if n.startswith("worker-")}


# --- every Deployment -----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_deployment_is_resourced_probed_and_configured(name):
    spec = pod_spec(DEPLOYMENTS[name])
    for c in spec["containers"]:
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        assert req["cpu"] and req["memory"] and lim["memory"], name
        assert c["readinessProbe"] and c["livenessProbe"], name
        assert {"configMapRef": {"name": CONFIGMAP}} in c["envFrom"], name
        assert c["command"][:2] == ["python", "-m"]
        module = c["command"][2]
        assert (REPO / module.replace(".", "/") / "__main__.py").exists(), module
    # Long enough to drain: at least one request deadline.
    assert spec["terminationGracePeriodSeconds"] >= float(CONFIG["TENSORBUS_REQUEST_TIMEOUT_S"])
    d = DEPLOYMENTS[name]
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels["app.kubernetes.io/part-of"] == "tensorbus"  # the NetworkPolicy selects on it


@pytest.mark.parametrize("name", sorted(workloads()))
def test_workload_runs_unprivileged(name):
    spec = pod_spec(workloads()[name])
    # The `restricted` Pod Security Standard, field by field.
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] > 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts  # the only writable places are volumes


@pytest.mark.parametrize("name", sorted(workloads()))
def test_workload_logs_in_as_its_own_role_from_the_secret(name):
    role = ROLE_OF[name]
    for c in pod_spec(workloads()[name])["containers"]:
        env = env_of(c)
        ref = env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": CREDENTIALS, "key": role}
        assert env["TENSORBUS_NATS_URL"]["value"] == f"nats://{role}:$(NATS_PASSWORD)@$(NATS_ADDRESS)"
        # No credential is ever written into a manifest.
        for e in env.values():
            assert "value" not in e or not re.search(r"://[^:$]+:[^$@]+@", e["value"])


def test_every_tensorbus_setting_is_a_real_one():
    known = {PREFIX + f.upper() for f in Config.__struct_fields__}
    used = {k for k in CONFIG if k.startswith(PREFIX)}
    for d in workloads().values():
        for c in pod_spec(d)["containers"]:
            used |= {k for k in env_of(c) if k.startswith(PREFIX)}
    assert used - known <= PENDING_SETTINGS, sorted(used - known - PENDING_SETTINGS)
    assert CONFIG["TENSORBUS_DATA_DIR"] == "/data"
    for d in DEPLOYMENTS.values():
        for c in pod_spec(d)["containers"]:
            assert "/data" in {m["mountPath"] for m in c["volumeMounts"]}


def test_scheduler_runs_two_replicas_and_workers_serve_bundled_models():
    assert DEPLOYMENTS["scheduler"]["spec"]["replicas"] == 2
    # Its probes find this pod's answer by the id, so the id is the pod's name.
    env = env_of(pod_spec(DEPLOYMENTS["scheduler"])["containers"][0])
    assert env["TENSORBUS_SCHEDULER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for name in ("worker-encoder", "worker-decoder"):
        env = env_of(pod_spec(DEPLOYMENTS[name])["containers"][0])
        assert env["TENSORBUS_MODEL"]["value"] in {catalog.ENCODER, catalog.DEMO_LM}
        assert env["TENSORBUS_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert pod_spec(DEPLOYMENTS[name])["containers"][0]["startupProbe"]


def test_batch_runners_run_side_by_side_probed_by_their_own_answer():
    """Two runners are safe (a lease per batch: services/batch/lease.py); each probe
    asks the runner's service and takes this pod's answer (services/probe.py)."""
    batch = DEPLOYMENTS["batch"]
    assert batch["spec"]["replicas"] == 2
    assert batch["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (c,) = pod_spec(batch)["containers"]
    assert c["command"] == ["python", "-m", "services.batch"]
    for probe, kind in (("readinessProbe", "ready"), ("livenessProbe", "health")):
        assert c[probe]["exec"]["command"] == ["python", "-m", "services.batch", "--check", kind]
    assert "ports" not in c  # reached over NATS only: no Service, no ingress
    assert float(CONFIG.get("TENSORBUS_BATCH_LEASE_S", Config().batch_lease_s)) > 0


# --- Services, policies, budgets ----------------------------------------------


def deployment_selected_by(selector: dict) -> dict:
    hits = [d for d in DEPLOYMENTS.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert len(hits) == 1, selector
    return hits[0]


def test_services_route_to_a_named_container_port():
    services = of_kind("Service")
    for svc in services.values():
        d = deployment_selected_by(svc["spec"]["selector"])
        ports = {p["name"]: p["containerPort"] for c in pod_spec(d)["containers"]
                 for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports
    assert services["gateway"]["spec"]["ports"][0]["port"] == int(CONFIG["TENSORBUS_HTTP_PORT"])
    tel = services["telemetry"]
    assert tel["spec"]["ports"][0]["port"] == int(CONFIG["TENSORBUS_METRICS_PORT"])
    ann = tel["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == CONFIG["TENSORBUS_METRICS_PORT"]


def test_network_policies_and_budgets_select_real_pods():
    for pol in of_kind("NetworkPolicy").values():
        sel = pol["spec"]["podSelector"]["matchLabels"]
        if sel == {"app.kubernetes.io/part-of": "tensorbus"}:
            assert "ingress" not in pol["spec"]  # the default deny
            continue
        d = deployment_selected_by(sel)
        ports = {p["containerPort"] for c in pod_spec(d)["containers"] for p in c["ports"]}
        assert {p["port"] for rule in pol["spec"]["ingress"] for p in rule["ports"]} <= ports
    for pdb in of_kind("PodDisruptionBudget").values():
        d = deployment_selected_by(pdb["spec"]["selector"]["matchLabels"])
        assert d["spec"]["replicas"] > pdb["spec"]["minAvailable"]


# --- autoscaling ----------------------------------------------------------------


def exported_metrics() -> set[str]:
    registry = CollectorRegistry()
    TelemetryMetrics(registry)
    return {m.name for m in registry.collect()}


def test_every_worker_scales_on_metrics_the_telemetry_service_exports():
    exported = exported_metrics()
    assert SCALING_METRICS <= exported
    scaled = {}
    for so in of_kind("ScaledObject").values():
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in DEPLOYMENTS
        scaled[target] = so
        model = env_of(pod_spec(DEPLOYMENTS[target])["containers"][0])["TENSORBUS_MODEL"]["value"]
        s = so["spec"]
        assert 0 <= s["minReplicaCount"] <= s["maxReplicaCount"]
        assert s["cooldownPeriod"] > 0 and s["pollingInterval"] > 0
        for trig in s["triggers"]:
            assert trig["type"] == "prometheus"
            query = trig["metadata"]["query"]
            names = set(re.findall(r"tensorbus_[a-z_]+", query))
            assert names and names <= SCALING_METRICS and names <= exported, query
            assert f'model="{model}"' in query
            assert float(trig["metadata"]["threshold"]) > 0
            if "tensorbus_model_queue_depth" in names:
                assert float(trig["metadata"]["threshold"]) == float(
                    CONFIG["TENSORBUS_TARGET_QUEUE_PER_REPLICA"])
    assert set(scaled) == {n for n in DEPLOYMENTS if n.startswith("worker-")}


# --- the NATS side --------------------------------------------------------------


def test_helm_values_give_the_server_every_role_from_the_same_secret():
    values = load(REPO / "deploy" / "nats" / "helm-values.yaml")[0]
    assert values["config"]["cluster"]["replicas"] == 3
    assert values["config"]["jetstream"]["fileStore"]["enabled"] is True
    assert values["config"]["merge"]["$include"] == "users.conf"
    env = values["container"]["env"]
    users = (REPO / "deploy" / "nats" / "users.conf").read_text()
    for role in set(ROLE_OF.values()) | {"client"}:
        var = f"TENSORBUS_NATS_PASS_{role.upper()}"
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": CREDENTIALS, "key": role}
        assert f"${var}" in users


# --- rendered by kustomize, validated against the schemas -------------------------

# The Kubernetes versions the manifests are checked against: an older release still
# in wide use and the newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
KEDA_SCHEMA = json.loads((Path(__file__).parent / "schemas" /
                          "keda-scaledobject-v1alpha1.json").read_text())


def render(path: Path) -> list[dict]:
    """`kubectl kustomize PATH`: what `kubectl apply -k` would send (no cluster needed)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed on this machine, so `kubectl kustomize` cannot "
                    "render deploy/k8s (CI machines have it; install kubectl to run this)")
    res = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, f"kubectl kustomize {path}: {res.stderr}"
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.fixture(scope="module", params=["base", "gpu"])
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(BASE if request.param == "base" else GPU)


def keda_errors(doc: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(KEDA_SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


def test_kustomize_renders_every_manifest_into_the_namespace(rendered):
    name, docs = rendered
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 6 and kinds.count("ScaledObject") == 2, kinds
    assert len(docs) == len(base_docs())
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "tensorbus", d["metadata"]["name"]
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tensorbus"
    images = {d["metadata"]["name"]: pod_spec(d)["containers"][0]["image"]
              for d in docs if d["kind"] in ("Deployment", "Job")}
    workers = {n for n in images if n.startswith("worker-")}
    want = "tensorbus:0.1.0-cuda12" if name == "gpu" else "tensorbus:0.1.0"
    assert {images[n] for n in workers} == {want}
    assert {images[n] for n in set(images) - workers} == {"tensorbus:0.1.0"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_are_valid_kubernetes(rendered, version):
    name, docs = rendered
    checked = 0
    for d in docs:
        if d["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: the next test
        try:
            # strict: a field Kubernetes does not know (a typo) is an error, not ignored
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {d['kind']}/{d['metadata']['name']} against {version}: "
                        f"{'/'.join(map(str, exc.path))}: {exc.message}")
        checked += 1
    assert checked == len(docs) - 2


def test_rendered_scaled_objects_match_kedas_schema(rendered):
    _, docs = rendered
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert len(scaled) == 2
    for d in scaled:
        assert keda_errors(d) == [], d["metadata"]["name"]


def test_the_validators_catch_what_a_reviewer_would():
    """Each check refuses a real mistake, so a pass above means something."""
    docs = render(BASE)
    deployment = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    pod_spec(deployment)["containers"][0]["resoures"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    scaled = copy.deepcopy(next(d for d in docs if d["kind"] == "ScaledObject"))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # KEDA wants strings
    scaled["spec"]["minReplicas"] = 0  # not KEDA's name for it
    errors = keda_errors(scaled)
    assert any("threshold" in e for e in errors) and any("minReplicas" in e for e in errors)


# --- safe without monitoring, and without the bus ---------------------------------

# How each kind of probe reaches its answer. Liveness must come from the process (a
# bus outage restarting the fleet would turn a blip into an outage); readiness from
# the bus (a pod that cannot reach NATS must get no work).
LOCAL_LIVENESS = ({"httpGet": {"path": "/healthz"}},  # a constant answer of the gateway
                  {"exec": "--check health"},  # the file the service keeps (services/liveness.py)
                  {"exec": "http://127.0.0.1:9400/metrics"})  # telemetry's own port
BUS_READINESS = ({"httpGet": {"path": "/readyz"}},  # serving and nc.is_connected
                 {"exec": "--check ready"})  # asked over NATS (services/probe.py)
# Telemetry is read by Prometheus, not given work over the bus: ready when it serves.
READY_WITHOUT_BUS = {"telemetry"}


def probe_is(probe: dict, forms: tuple[dict, ...]) -> bool:
    for form in forms:
        if "httpGet" in form and probe.get("httpGet", {}).get("path") == form["httpGet"]["path"]:
            return True
        if "exec" in form and form["exec"] in " ".join(probe.get("exec", {}).get("command", [])):
            return True
    return False


def test_every_scaled_object_keeps_its_fleet_when_prometheus_fails(rendered):
    _, docs = rendered
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert scaled
    for so in scaled:
        fallback = so["spec"]["fallback"]
        # Keep what runs (at least `replicas`), never shrink to a fixed count.
        assert fallback["behavior"] == "currentReplicasIfHigher", so["metadata"]["name"]
        assert fallback["replicas"] >= 1 and fallback["failureThreshold"] >= 1
        for trig in so["spec"]["triggers"]:
            if trig["type"] == "prometheus":
                # An empty result is an error (toward the fallback), never a 0.
                assert trig["metadata"]["ignoreNullValues"] == "false", trig["name"]
                assert trig["metricType"] == "AverageValue"  # the fallback needs it


def test_liveness_comes_from_the_process_and_readiness_from_the_bus(rendered):
    _, docs = rendered
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == set(DEPLOYMENTS)
    for name, d in deployments.items():
        for c in pod_spec(d)["containers"]:
            for kind in ("livenessProbe", "startupProbe"):
                if kind in c:
                    assert probe_is(c[kind], LOCAL_LIVENESS), (name, kind, c[kind])
                    assert not probe_is(c[kind], BUS_READINESS), (name, kind)
            if name not in READY_WITHOUT_BUS:
                assert probe_is(c["readinessProbe"], BUS_READINESS), (name, c["readinessProbe"])
            # Three failed liveness probes restart the pod: at least a minute of a
            # stuck process, never a bus outage (the file does not need the bus).
            live = c["livenessProbe"]
            assert live["periodSeconds"] * live.get("failureThreshold", 3) >= 30


def test_the_deployment_asks_for_three_jetstream_replicas(rendered):
    """The chart's cluster block advertises no routes to clients (`no_advertise`), so
    the INFO a client sees lists one server and the automatic choice would be R1: the
    ConfigMap sets R3 outright, matching the three servers of the shipped values."""
    _, docs = rendered
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == CONFIGMAP]
    values = load(REPO / "deploy" / "nats" / "helm-values.yaml")[0]
    servers = values["config"]["cluster"]["replicas"]
    assert servers == 3
    assert Config.from_env(cm["data"]).js_replicas == servers == 3

