"""Packaging for ds_adabatch: adaptive global batch size for DeepSpeed training."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
version: dict = {}
exec((HERE / "ds_adabatch" / "_version.py").read_text(), version)

setup(
    name="ds_adabatch",
    version=version["__version__"],
    description="Change a DeepSpeed job's global batch size while it runs, exactly.",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_adabatch", "ds_adabatch.*"]),
    python_requires=">=3.10",
    install_requires=[
        # The ranges are what CI runs (docs/versions.md): the whole suite on torch 2.13.0 (the README's
        # commands pin it: the CPU build here), the focused suite (scripts/test_torch_matrix.sh) on torch
        # 2.11.0, 2.12.1, 2.14.1 and 2.15.0; deepspeed 0.19.8; transformers 4.57.6, 5.0.0, 5.2.0, 5.3.0,
        # 5.17.0 and the newest 5.x, accelerate 1.15.
        "torch>=2.11,<2.16",
        "deepspeed>=0.19.8,<0.20",
        "pydantic>=2.5,<3",
        "hjson",  # config files with comments, as DeepSpeed reads them
        "numpy",
        "tqdm",
    ],
    extras_require={
        # transformers 4.57.6 (the last 4.x) up to the newest 5.x (ds_adabatch/integrations/hf/versions.py's
        # REQUIREMENT), accelerate 1.15.
        "hf": [
            "transformers>=4.57.6,<6",
            "accelerate>=1.15.0,<2",
        ],
        # TRL's trainers composed with AdaptiveBatchSizeTrainer (docs/trainer.md); TRL 1.16 runs on
        # transformers 4.57.6 and 5.x (CI tests it on both ends).
        "trl": ["ds_adabatch[hf]", "trl>=1.16.0,<1.17"],
        "plot": ["matplotlib>=3.7"],
        # The hf extra plus what transformers' example scripts (examples/pytorch/language-modeling/
        # run_clm.py) import: datasets, evaluate, and scikit-learn for --do_eval's accuracy metric.
        "examples": ["ds_adabatch[hf]", "datasets>=3", "evaluate>=0.4", "scikit-learn>=1.3"],
        "dev": [
            "pytest>=8",
            "pytest-xdist>=3.5",  # scripts/test.sh runs the suite on two workers, one test module each
            "hypothesis>=6.100",
            "ruff>=0.6",
            "matplotlib>=3.7",
            "transformers>=4.57.6,<6",
            "accelerate>=1.15.0,<2",
            # One pure-Python wheel (its dependencies come with datasets); TRL 1.16 needs Python 3.11.
            'trl>=1.16.0,<1.17; python_version >= "3.11"',
            "pyyaml>=6",
            "datasets>=3",  # the Trainer's length column read from a datasets.Dataset
        ],
    },
    entry_points={
        "console_scripts": [
            "ds-adabatch=ds_adabatch.cli:main",
            "ds-adabatch-run=ds_adabatch.launch:main",
        ]
    },
)
