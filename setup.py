from setuptools import find_packages, setup

setup(
    name="megatron_2bw",
    version="0.1.0",
    description="Megatron-style GPT/BERT pretraining with the PipeDream-2BW pipeline engine",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_2bw", "megatron_2bw.*"]),
    python_requires=">=3.10",
    # a range for cluster users; development pins the CPU build in requirements-dev.txt
    install_requires=["torch>=2.3", "numpy", "sentencepiece>=0.2,<0.3"],
    # matplotlib: tools/compare_convergence.py and tools/plot_schedule.py draw PNGs (Agg)
    # hf: tools/checkpoint_convert.py (HuggingFace export/import), generate.py on HF directories
    extras_require={"test": ["pytest>=7", "wandb>=0.17", "matplotlib>=3.7"],
                    "wandb": ["wandb>=0.17"], "plots": ["matplotlib>=3.7"],
                    "hf": ["transformers>=4.40", "safetensors>=0.4"]},
)
