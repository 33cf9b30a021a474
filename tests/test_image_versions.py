"""The trainer and merger images' versions (issue 62), read from the files, no Docker: the
Dockerfiles' defaults are the versions a committed GPU training result ran on (the GPU
images ship what was measured), the CPU compose build passes the CPU venv's pins
(constraints.txt), and each version build argument replaces its package's pin in the
constraints and requirements, so pip is never asked for two versions of one package."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "services/trainer/Dockerfile"
MERGER = REPO / "services/merger/Dockerfile"
# version build argument -> the package it pins, as constraints.txt spells it
PACKAGES = {
    "TORCH_VERSION": "torch",
    "TRANSFORMERS_VERSION": "transformers",
    "PEFT_VERSION": "peft",
    "HUGGINGFACE_HUB_VERSION": "huggingface_hub",
    "BITSANDBYTES_VERSION": "bitsandbytes",
}
# measured on the GPU: recorded in the result's "machine" field
MEASURED = ("torch", "peft", "bitsandbytes")
# the CPU venv's in both builds: lorastack's hub code needs huggingface_hub 2.x, which the
# result's transformers (5.17.0) does not take
AS_THE_VENV = ("transformers", "huggingface_hub")


def version_args(dockerfile: Path) -> dict[str, str]:
    """The Dockerfile's `ARG NAME_VERSION=default` lines."""
    text = dockerfile.read_text()
    return dict(re.findall(r"^ARG\s+(\w+_VERSION)=(\S+)$", text, flags=re.M))


def pins(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", path.read_text(), flags=re.M))


def gpu_result(dockerfile: Path) -> tuple[Path, dict[str, str]]:
    """The GPU training result the Dockerfile's comment names and the versions its
    "machine" field records (e.g. "torch 2.11.0+cu130, transformers 5.17.0, ...")."""
    named = re.findall(r"bench/trainer/results/\S+?\.json", dockerfile.read_text())
    assert len(set(named)) == 1, f"{dockerfile}: name one GPU training result, not {named}"
    path = REPO / named[0]
    assert "gpu" in path.name and path.is_file(), path
    machine = json.loads(path.read_text())["machine"]
    return path, dict(re.findall(r"\b(torch|transformers|peft|bitsandbytes) ([\w.+]+)", machine))


@pytest.mark.parametrize("dockerfile", [TRAINER, MERGER], ids=["trainer", "merger"])
def test_the_gpu_defaults_are_the_versions_of_a_committed_gpu_training_result(
    dockerfile: Path,
) -> None:
    result, recorded = gpu_result(dockerfile)
    assert set(MEASURED) <= set(recorded), (result, recorded)
    defaults = version_args(dockerfile)
    for arg, package in PACKAGES.items():
        if package in MEASURED and arg in defaults:
            measured = recorded[package].split("+")[0]  # torch's +cu130: the wheel's build
            assert defaults[arg] == measured, (
                f"{dockerfile.name} {arg}: {result.name} ran {package} {recorded[package]}"
            )
    constraints = pins(REPO / "constraints.txt")
    for arg, package in PACKAGES.items():
        if package in AS_THE_VENV and arg in defaults:
            assert defaults[arg] == constraints[package], (dockerfile.name, arg)
    # PyPI's torch is one CUDA build per version: the one measured is CUDA 13.0's
    assert recorded["torch"].endswith("+cu130"), recorded["torch"]
    assert {"TORCH_VERSION", "TRANSFORMERS_VERSION", "PEFT_VERSION"} <= set(defaults)
    if dockerfile == TRAINER:
        assert "BITSANDBYTES_VERSION" in defaults


def test_the_trainer_and_merger_share_their_first_layers() -> None:
    """Instruction for instruction up to the torch + transformers install (comments
    aside): the two images share that layer instead of each holding a copy."""

    def first_layers(dockerfile: Path) -> list[str]:
        lines = [ln for ln in dockerfile.read_text().splitlines() if not ln.startswith("#")]
        end = next(i for i, ln in enumerate(lines) if "pip install" in ln)
        while lines[end].endswith("\\"):
            end += 1
        return lines[: end + 1]

    assert first_layers(TRAINER) == first_layers(MERGER)


def cpu_compose_args() -> dict[str, dict[str, str]]:
    services = yaml.safe_load((REPO / "deploy/compose.cpu.yaml").read_text())["services"]
    return {
        name: {k: str(v) for k, v in services[name]["build"]["args"].items()}
        for name in ("model-import", "trainer", "merger")
    }


def build_script_args() -> dict[str, str]:
    text = (REPO / "deploy/tests/build-images.sh").read_text()
    block = re.search(r"^cpu_versions=\((.*?)\)", text, flags=re.M | re.S)
    assert block is not None, "deploy/tests/build-images.sh: no cpu_versions=(...)"
    return dict(re.findall(r"--build-arg\s+(\w+)=(\S+)", block[1]))


def test_the_cpu_builds_pass_the_cpu_venvs_pins() -> None:
    constraints = pins(REPO / "constraints.txt")
    venv = {arg: constraints[package] for arg, package in PACKAGES.items()}
    compose = cpu_compose_args()
    for name, args in compose.items():
        assert args == venv, f"deploy/compose.cpu.yaml {name}: {args} != the venv's {venv}"
    assert build_script_args() == venv, "deploy/tests/build-images.sh cpu_versions"
    # every version argument a job Dockerfile takes is passed (none falls back to the GPU's)
    assert set(version_args(TRAINER)) == set(venv)
    assert set(version_args(MERGER)) <= set(venv)
    # the CPU torch wheel the script puts in deploy/wheels/ is that version's
    script = (REPO / "deploy/tests/build-images.sh").read_text()
    assert f"torch-{venv['TORCH_VERSION']}+cpu-" in script


@pytest.mark.parametrize("dockerfile", [TRAINER, MERGER], ids=["trainer", "merger"])
def test_each_version_argument_replaces_its_packages_pin(dockerfile: Path) -> None:
    """`s/^torch==.*/torch==${TORCH_VERSION}/` for each argument, on a package name that
    constraints.txt pins: the constraints and requirements carry the argument's version
    instead of theirs, so pip is asked for one version."""
    text = dockerfile.read_text()
    constraints = pins(REPO / "constraints.txt")
    for arg in version_args(dockerfile):
        package = PACKAGES[arg]
        assert package in constraints, f"constraints.txt spells no {package}=="
        assert f"s/^{package}==.*/{package}==${{{arg}}}/" in text, (dockerfile.name, arg)
    # the requirements are rewritten before they are installed
    runs = re.findall(r"sed -i -f /src/versions.sed[^\n]*(?:\\\n[^\n]*)*?pip install", text)
    assert any("requirements.txt" in run for run in runs), dockerfile.name
