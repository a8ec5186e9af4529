from setuptools import find_packages, setup

setup(
    name="megatron_2bw",
    version="0.1.0",
    description="Megatron-style GPT/BERT pretraining with the PipeDream-2BW pipeline engine",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_2bw", "megatron_2bw.*"]),
    # the native CPU AdamW kernel's source, compiled on first use (megatron_2bw/optim/native.py)
    package_data={"megatron_2bw.optim": ["native_adam.c"]},
    python_requires=">=3.10",
    # a range for cluster users; development pins the CPU build in requirements-dev.txt
    # tqdm: the progress bar on a terminal (training/observe/logger.py)
    install_requires=["torch>=2.3", "numpy", "sentencepiece>=0.2,<0.3", "tqdm>=4.60"],
    # matplotlib: tools/compare_convergence.py and tools/plot_schedule.py draw PNGs (Agg)
    # hf: tools/checkpoint_convert.py (HuggingFace export/import), generate.py on HF directories,
    # --tokenizer-type HuggingFaceTokenizer; tokenizers: Megatron's tokenizer types beyond
    # sentencepiece (regex: GPT2BPETokenizer; tiktoken: TikTokenizer; transformers: HF)
    # tensorboard: --tensorboard-dir (torch.utils.tensorboard writes, tests read events back)
    extras_require={"test": ["pytest>=7", "wandb>=0.17", "matplotlib>=3.7", "tensorboard>=2.14"],
                    "wandb": ["wandb>=0.17"], "plots": ["matplotlib>=3.7"],
                    "tensorboard": ["tensorboard>=2.14"],
                    "hf": ["transformers>=4.40", "safetensors>=0.4"],
                    "tokenizers": ["regex>=2021.8", "tiktoken>=0.6", "transformers>=4.40"]},
)
