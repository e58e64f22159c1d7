"""Packaging for ring_sp: exact ring x Ulysses sequence-parallel attention.

The top-level ``integrations/`` folder is installed as ``ring_sp.integrations`` (the
``package_dir`` mapping below), so user code imports ``ring_sp.integrations.deepspeed``
and nothing named plain ``integrations`` lands in site-packages.

Install torch FIRST (``pip install torch==2.13.0`` on a CPU machine), then this package:
none of the requirements below asks pip for a torch it does not already have.
"""

from pathlib import Path

from setuptools import find_packages, setup

# the supported framework ranges: one table (integrations/versions.py) for these extras and
# for the integrations' runtime checks; read as a file, since nothing is installed yet
_versions: dict = {}
exec((Path(__file__).resolve().parent / "integrations" / "versions.py").read_text(encoding="utf-8"), _versions)
_requirement = _versions["requirement"]

_library = find_packages(include=["ring_sp", "ring_sp.*"])
_integrations = ["ring_sp.integrations"] + [
    "ring_sp.integrations." + name
    for name in find_packages(where="integrations")
]

setup(
    name="ring-sp",
    version="0.1.0",
    description=(
        "Exact ring attention and ring x Ulysses (2D) sequence parallelism "
        "for DeepSpeed, Megatron-core and Hugging Face transformers"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=_library + _integrations,
    package_dir={"ring_sp.integrations": "integrations"},
    install_requires=["torch>=2.4"],
    extras_require={
        # flash-attn needs CUDA to build; it is imported lazily and never required.
        "flash": ["flash-attn>=2.1"],
        # the examples' progress bars use tqdm
        # the versions whose gradient reduction / attention interfaces / Trainer the tests verify
        "deepspeed": [_requirement("deepspeed"), "tqdm>=4.60"],
        "megatron": [_requirement("megatron-core"), "einops", "tqdm>=4.60"],
        "transformers": [_requirement("transformers"), _requirement("accelerate"), "tqdm>=4.60"],
        # TRL's SFTTrainer (SequenceParallelSFTTrainer); peft for LoRA; datasets comes with trl
        "trl": [_requirement("trl"), _requirement("peft"), _requirement("transformers"), _requirement("accelerate"),
                "tqdm>=4.60"],
        "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3", "hypothesis>=6", "numpy", "psutil"],
        "bench": ["matplotlib>=3.5"],
    },
    entry_points={"console_scripts": ["ring-sp=ring_sp.plan:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
