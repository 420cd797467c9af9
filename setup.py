"""tfsplit: hybrid-parallel rewriting of TensorFlow training graphs."""
from setuptools import find_packages, setup

TF_VERSION = "2.21.0"

setup(
    name="tfsplit",
    version="0.1.0",
    description=("Grappler-style GraphDef passes that split, data-parallelise and "
                 "pipeline TensorFlow training steps across devices"),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tfsplit", "tfsplit.*"]),
    package_data={"tfsplit": ["cost/presets/*.json"]},
    python_requires=">=3.9",
    # TensorFlow itself is an extra, as in the TF ecosystem (tensorflow-cpu vs
    # tensorflow with CUDA): the user picks the build that fits the machine.
    install_requires=["numpy", "protobuf", "absl-py"],
    extras_require={
        "cpu": [f"tensorflow-cpu=={TF_VERSION}"],
        "gpu": [f"tensorflow[and-cuda]=={TF_VERSION}"],
        "keras": ["tf_keras==2.21.0"],
        "plot": ["matplotlib"],
        "test": [f"tensorflow-cpu=={TF_VERSION}", "tf_keras==2.21.0", "pytest", "pytest-timeout",
                 "pytest-xdist", "matplotlib"],
    },
    entry_points={"console_scripts": ["tfsplit=tfsplit.cli:main"]},
)
