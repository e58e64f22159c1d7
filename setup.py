"""Packaging for ring_sp: exact ring x Ulysses sequence-parallel attention.

The top-level ``integrations/`` folder is installed as ``ring_sp.integrations`` (the
``package_dir`` mapping below), so user code imports ``ring_sp.integrations.deepspeed``
and nothing named plain ``integrations`` lands in site-packages.

Install torch FIRST (``pip install torch==2.13.0`` on a CPU machine), then this package:
none of the requirements below asks pip for a torch it does not already have.
"""

from setuptools import find_packages, setup

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
        "deepspeed": ["deepspeed>=0.19.8,<0.20", "tqdm>=4.60"],  # the version whose gradient reduction the tests verify
        "megatron": ["megatron-core>=0.16,<0.17", "einops", "tqdm>=4.60"],  # 0.16.1 is what the tests verify
        # the versions whose attention/mask interfaces, kwargs forwarding and Trainer the tests verify
        "transformers": ["transformers>=5.18.0,<5.19", "accelerate>=1.15.0,<1.16", "tqdm>=4.60"],
        "test": ["pytest>=7", "pytest-timeout>=2", "hypothesis>=6", "numpy"],
        "bench": ["matplotlib>=3.5"],
    },
    entry_points={"console_scripts": ["ring-sp=ring_sp.plan:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
